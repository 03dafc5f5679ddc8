"""Tests for workers/data/loader.py: the data order is a pure function of (seed, global sample
index), independent of dp, resumable under another dp, and token files are read by byte ranges
only."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import fsspec
import numpy as np
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem
from hypothesis import given, settings
from hypothesis import strategies as st

from tenax.orchestrator.spec import DataSpec
from tenax.workers.data import EOS_ID, TokenDataLoader, permute, prepare_token_file

logger = logging.getLogger(__name__)
torch.set_num_threads(1)

SEQ, VOCAB, SEED, G = 16, 512, 7, 8


@pytest.fixture
def mem_root() -> Iterator[str]:
    """A unique memory:// folder, removed afterwards (the memory store is process-global)."""
    root = f"/tenax-test-{os.getpid()}-{np.random.default_rng().integers(1 << 30)}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


def synthetic(global_batch_size: int = G, seed: int = SEED) -> TokenDataLoader:
    return TokenDataLoader(DataSpec(), SEQ, VOCAB, seed, global_batch_size)


def global_batch(loader: TokenDataLoader, step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [loader.batch(step, r, dp) for r in range(dp)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def write_tokens(uri: str, tokens: np.ndarray) -> None:
    with fsspec.open(uri, "wb") as f:
        f.write(tokens.astype(tokens.dtype.newbyteorder("<")).tobytes())


def test_global_batches_identical_for_any_dp() -> None:
    loader = synthetic()
    for step in range(4):
        ref_x, ref_y = global_batch(loader, step, 1)
        assert ref_x.shape == (G, SEQ) and ref_x.dtype == torch.int64
        for dp in (2, 4, 8):
            x, y = global_batch(loader, step, dp)
            assert torch.equal(x, ref_x) and torch.equal(y, ref_y), (step, dp)
    assert not torch.equal(global_batch(loader, 0, 1)[0], global_batch(loader, 1, 1)[0])
    other = global_batch(synthetic(seed=SEED + 1), 0, 1)[0]
    assert not torch.equal(other, global_batch(loader, 0, 1)[0])


def test_step_is_a_window_of_global_samples() -> None:
    loader = synthetic()
    ids = loader.sample_ids(2 * G, G)
    direct = torch.from_numpy(loader.source.samples(ids))
    x, y = loader.batch(2, 0, 1)
    assert torch.equal(x, direct[:, :-1]) and torch.equal(y, direct[:, 1:])
    # A different global batch size reuses the same global sample order.
    big = synthetic(global_batch_size=2 * G)
    halves = [loader.batch(2, 0, 1)[0], loader.batch(3, 0, 1)[0]]
    assert torch.equal(big.batch(1, 0, 1)[0], torch.cat(halves))


def test_synthetic_samples_are_learnable_progressions() -> None:
    x, y = synthetic().batch(0, 0, 1)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.min()) >= 0 and int(x.max()) < VOCAB
    stride = (x[:, 1:2] - x[:, :1]) % VOCAB
    assert torch.equal((y - x) % VOCAB, stride.expand_as(x))
    assert len(set(stride.flatten().tolist())) > 1


def test_resume_under_another_dp_continues_identically() -> None:
    clean = synthetic()
    expected = [clean.next_batch(0, 1) for _ in range(6)]
    ranks = [synthetic() for _ in range(2)]
    for step in range(3):
        x = torch.cat([ranks[r].next_batch(r, 2)[0] for r in range(2)])
        assert torch.equal(x, expected[step][0])
    state = json.loads(json.dumps(ranks[1].state_dict()))
    assert state == {"samples_consumed": 3 * G}
    resumed = [synthetic() for _ in range(4)]
    for r, loader in enumerate(resumed):
        loader.load_state_dict(state)
    for step in range(3, 6):
        parts = [resumed[r].next_batch(r, 4) for r in range(4)]
        assert torch.equal(torch.cat([p[0] for p in parts]), expected[step][0])
        assert torch.equal(torch.cat([p[1] for p in parts]), expected[step][1])


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**31), epoch=st.integers(0, 1000))
def test_permute_is_a_bijection(n: int, seed: int, epoch: int) -> None:
    out = permute(np.arange(n), n, seed, epoch)
    assert np.array_equal(np.sort(out), np.arange(n))


def test_permutation_is_shuffled_and_differs_by_epoch() -> None:
    n = 1000
    a, b = permute(np.arange(n), n, 0, 0), permute(np.arange(n), n, 0, 1)
    assert not np.array_equal(a, b)
    assert not np.array_equal(a, np.arange(n))
    assert abs(np.corrcoef(a, np.arange(n))[0, 1]) < 0.2


def test_epochs_cover_each_sample_once(mem_root: str) -> None:
    uri = f"memory://{mem_root}/small.bin"
    write_tokens(uri, np.arange(10 * SEQ + 1, dtype=np.uint16) % VOCAB)
    loader = TokenDataLoader(DataSpec(source=uri), SEQ, VOCAB, SEED, 4)
    assert loader.num_samples == 10
    ids = loader.sample_ids(0, 30)
    for epoch in range(3):
        assert sorted(ids[epoch * 10:(epoch + 1) * 10].tolist()) == list(range(10))
    assert ids[:10].tolist() != ids[10:20].tolist()
    # Batches straddling an epoch boundary stay dp-invariant.
    assert torch.equal(global_batch(loader, 2, 1)[0], global_batch(loader, 2, 4)[0])


CHILD = """
import hashlib
from tenax.workers.data import TokenDataLoader
from tenax.workers.spec import DataSpec
loader = TokenDataLoader(DataSpec(), {seq}, {vocab}, {seed}, {g})
h = hashlib.sha256()
for step in (0, 5, 1000):
    x, y = loader.batch(step, 1, 2)
    h.update(x.numpy().tobytes()); h.update(y.numpy().tobytes())
print(h.hexdigest())
"""


def test_order_is_identical_in_another_process() -> None:
    import hashlib
    loader = synthetic()
    h = hashlib.sha256()
    for step in (0, 5, 1000):
        x, y = loader.batch(step, 1, 2)
        h.update(x.numpy().tobytes())
        h.update(y.numpy().tobytes())
    code = CHILD.format(seq=SEQ, vocab=VOCAB, seed=SEED, g=G)
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == h.hexdigest()


def test_dp_validation_and_state_errors() -> None:
    loader = synthetic(global_batch_size=6)
    with pytest.raises(ValueError, match="dp_size: 4 does not divide train.global_batch_size=6"):
        loader.batch(0, 0, 4)
    with pytest.raises(ValueError, match="dp_rank"):
        loader.batch(0, 3, 3)
    with pytest.raises(ValueError, match="step"):
        loader.batch(-1, 0, 1)
    with pytest.raises(ValueError, match="samples_consumed"):
        loader.load_state_dict({"samples_consumed": -3})
    with pytest.raises(ValueError, match="global_batch_size"):
        TokenDataLoader(DataSpec(), SEQ, VOCAB, SEED, 0)


def check_roundtrip(uri: str, out_uri: str, texts: list[bytes], token_dtype: str,
                    eos_id: int | None) -> None:
    fs, _ = fsspec.core.url_to_fs(uri)
    for i, text in enumerate(texts):
        with fsspec.open(f"{uri}/doc{i}.txt", "wb") as f:
            f.write(text)
    stats = prepare_token_file([f"{uri}/doc{i}.txt" for i in range(len(texts))], out_uri,
                               token_dtype=token_dtype, eos_id=eos_id)
    expected: list[int] = []
    for text in texts:
        expected += list(text) + ([] if eos_id is None else [eos_id])
    itemsize = np.dtype(token_dtype).itemsize
    assert stats["n_tokens"] == len(expected) and stats["n_docs"] == len(texts)
    assert stats["bytes"] == len(expected) * itemsize
    with fsspec.open(out_uri, "rb") as f:
        raw = np.frombuffer(f.read(), dtype=np.dtype(token_dtype).newbyteorder("<"))
    assert raw.tolist() == expected

    loader = TokenDataLoader(DataSpec(source=out_uri, token_dtype=token_dtype), SEQ, VOCAB, SEED, 4)
    assert loader.num_samples == (len(expected) - 1) // SEQ
    x, y = loader.batch(1, 1, 2)
    for row, sample_id in enumerate(loader.sample_ids(4 + 2, 2).tolist()):
        window = raw[sample_id * SEQ: sample_id * SEQ + SEQ + 1].astype(np.int64)
        assert x[row].tolist() == window[:-1].tolist() and y[row].tolist() == window[1:].tolist()


def test_token_file_roundtrip_memory(mem_root: str) -> None:
    texts = ["héllo wörld ✓ ".encode() * 20, b"second document\n" * 30, b""]
    check_roundtrip(f"memory://{mem_root}", f"memory://{mem_root}/out/tokens.bin", texts,
                    "uint16", EOS_ID)


def test_token_file_roundtrip_local_uint8(tmp_path: Path) -> None:
    texts = [b"abcdefghij" * 40, b"0123456789" * 30]
    check_roundtrip(tmp_path.as_uri(), (tmp_path / "nested" / "t.bin").as_uri(), texts, "uint8",
                    None)
    with pytest.raises(ValueError, match="eos_id 256 does not fit token_dtype 'uint8'"):
        prepare_token_file([(tmp_path / "doc0.txt").as_uri()], (tmp_path / "x.bin").as_uri(),
                           token_dtype="uint8")


def test_token_file_is_read_by_ranges(mem_root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    uri = f"memory://{mem_root}/big.bin"
    write_tokens(uri, np.arange(100_000, dtype=np.uint16) % VOCAB)
    file_bytes = 200_000
    read: list[int] = []
    orig_cat, orig_open = MemoryFileSystem.cat_file, MemoryFileSystem._open

    def cat_file(self: Any, path: str, start: Any = None, end: Any = None, **kw: Any) -> bytes:
        data = orig_cat(self, path, start, end, **kw)
        read.append(len(data))
        return data

    def _open(self: Any, path: str, mode: str = "rb", **kw: Any) -> Any:
        f = orig_open(self, path, mode, **kw)
        if "r" in mode:
            raw_read = f.read
            f.read = lambda n=-1: read.append(len(out := raw_read(n))) or out  # type: ignore
        return f

    monkeypatch.setattr(MemoryFileSystem, "cat_file", cat_file)
    monkeypatch.setattr(MemoryFileSystem, "_open", _open)
    loader = TokenDataLoader(DataSpec(source=uri), SEQ, VOCAB, SEED, G)
    x, _ = loader.batch(3, 0, 2)
    per_sample = (SEQ + 1) * 2
    assert sum(read) == (G // 2) * per_sample < file_bytes // 100
    assert x.shape == (G // 2, SEQ)


def test_token_file_errors(mem_root: str, tmp_path: Path) -> None:
    short = f"memory://{mem_root}/short.bin"
    write_tokens(short, np.arange(SEQ, dtype=np.uint16))
    with pytest.raises(ValueError, match=f"{short}.*holds {SEQ} tokens.*seq_len={SEQ}"):
        TokenDataLoader(DataSpec(source=short), SEQ, VOCAB, SEED, G)

    odd = f"memory://{mem_root}/odd.bin"
    with fsspec.open(odd, "wb") as f:
        f.write(b"\x00" * 101)
    with pytest.raises(ValueError, match="not a multiple of 2"):
        TokenDataLoader(DataSpec(source=odd), SEQ, VOCAB, SEED, G)

    bad = f"memory://{mem_root}/bad.bin"
    tokens = np.zeros(SEQ + 1, dtype=np.uint16)
    tokens[5] = 999
    write_tokens(bad, tokens)
    loader = TokenDataLoader(DataSpec(source=bad), SEQ, VOCAB, SEED, 1)
    with pytest.raises(ValueError, match=r"a token id outside \[0, model.vocab_size=512\) in "
                       f"sample 0 of '{bad}'") as err:
        loader.batch(0, 0, 1)
    assert "999" not in str(err.value)  # the data's values never reach an error message

    with pytest.raises(FileNotFoundError, match="missing.bin"):
        TokenDataLoader(DataSpec(source=f"memory://{mem_root}/missing.bin"), SEQ, VOCAB, SEED, G)


def test_prepare_errors(tmp_path: Path) -> None:
    out = (tmp_path / "out.bin").as_uri()
    with pytest.raises(ValueError, match="text_uris is empty"):
        prepare_token_file([], out)
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        prepare_token_file([(tmp_path / "nope.txt").as_uri()], out)
    with pytest.raises(ValueError, match="token_dtype: 'float32'"):
        prepare_token_file([(tmp_path / "nope.txt").as_uri()], out, token_dtype="float32")
    good, broken = tmp_path / "good.txt", tmp_path / "broken.txt"
    good.write_bytes(b"fine text")
    broken.write_bytes(b"ok \xff\xfe not utf8")
    with pytest.raises(ValueError, match="broken.txt.*not valid UTF-8 near byte 3"):
        prepare_token_file([good.as_uri(), broken.as_uri()], out)
    assert not (tmp_path / "out.bin").exists()


def train_bpe(path: Path, vocab_size: int = 300) -> int:
    """A byte-level BPE tokenizer.json trained here (nothing from a hub); its vocabulary size."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [f"document {i}: the quick brown fox jumps over the lazy dog {i * 7}"
             for i in range(200)]
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return tok.get_vocab_size()


def test_vocab_size_auto_comes_from_the_tokenizer(tmp_path: Path) -> None:
    from tenax.workers.data import resolve_eos_id
    from tenax.workers.spec import load_spec

    path = tmp_path / "tokenizer.json"
    size = train_bpe(path)
    spec = load_spec(overrides=[f"data.tokenizer={path}", "model.vocab_size=auto"])
    assert spec.model.vocab_size == -(-size // 64) * 64 >= size
    assert resolve_eos_id(spec.data) == 0  # "<|endoftext|>", the first special token
    assert load_spec(overrides=[f"data.tokenizer={path}", "data.eos_id=5"]).data.eos_id == 5


def test_vocab_size_errors(tmp_path: Path) -> None:
    from tenax.workers.errors import SpecError
    from tenax.workers.spec import load_spec

    path = tmp_path / "tokenizer.json"
    size = train_bpe(path)
    with pytest.raises(SpecError, match=f"model.vocab_size: 64 is smaller than the vocabulary "
                                        f"of data.tokenizer \\({size} tokens\\)"):
        load_spec(overrides=[f"data.tokenizer={path}", "model.vocab_size=64"])
    with pytest.raises(SpecError, match="model.vocab_size: 'auto' needs data.tokenizer"):
        load_spec(overrides=["model.vocab_size=auto"])
    with pytest.raises(SpecError, match="data.tokenizer: .*does not exist"):
        load_spec(overrides=[f"data.tokenizer={tmp_path / 'nope.json'}",
                             "model.vocab_size=auto"])
