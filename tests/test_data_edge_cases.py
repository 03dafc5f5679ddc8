"""What a new user of `tenax data prepare / inspect` and indexed sources runs into.

A worker killed mid-prepare, Ctrl-C or SIGTERM, `--out` into a new directory, inputs with no
documents, half a dataset or a directory as `data.source`, a dataset whose documents end in ids
beyond the model's vocabulary, and tokens decoded with another tokenizer: each ends in an
error naming the field or file and the value, and nothing is left at the output.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from concurrent.futures.process import BrokenProcessPool

from tenax.orchestrator.cli.main import main
from tenax.workers.data import (IndexedDatasetWriter, TokenDataLoader, load_tokenizer, open_uri,
                                prepare_dataset)
from tenax.workers.spec import DataSpec
from tests.test_data_prepare import StubTokenizer
from tests.test_tokenizer import corpus_text, make_hf_tokenizer, make_sentencepiece


class DyingTokenizer(StubTokenizer):
    """Kills its own worker process on a document holding "die", as the OOM killer would."""

    def encode(self, text: str) -> list[int]:
        if "die" in text:
            os.kill(os.getpid(), signal.SIGKILL)
        return [1]


def jsonl(path: Path, texts: list[str]) -> str:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def test_a_worker_that_dies_fails_the_prepare_instead_of_hanging(tmp_path):
    inputs = [jsonl(tmp_path / "in.jsonl", ["a", "b", "please die", "c"])]
    with pytest.raises(BrokenProcessPool, match=r"a tokenizer worker process died .* from "
                                                r".*in\.jsonl: line 1 on; try fewer --workers"):
        prepare_dataset(inputs, str(tmp_path / "out"), tokenizer=DyingTokenizer(), workers=1,
                        progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_an_interrupt_while_the_writer_opens_its_file_leaves_no_directory_behind(
        tmp_path, monkeypatch):
    """The signal the CLI test sends once the temporary `.bin` exists can land before the
    writer's constructor has returned, when there is no writer to abort yet."""
    from fsspec.implementations.local import LocalFileSystem

    opened = LocalFileSystem.open

    def open_then_interrupted(self, path, mode="rb", **kwargs):
        opened(self, path, mode, **kwargs).close()  # the file exists, as the CLI test sees it
        raise KeyboardInterrupt

    monkeypatch.setattr(LocalFileSystem, "open", open_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        IndexedDatasetWriter(str(tmp_path / "new" / "dir" / "ds"), np.uint16)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupting_the_cli_prepare_leaves_nothing(tmp_path, signum):
    """Ctrl-C, or SIGTERM (kill, a scheduler's limit), while prepare runs: exit 130, no
    `.bin`/`.idx` and no temporary files, and the directory `--out` created is gone too. Run
    as a user runs it, in a process of its own: a signal that lands while a process starts
    its multiprocessing forkserver may leave that forkserver unusable, which only the
    interrupted process may pay for, never the test run."""
    tok = make_hf_tokenizer(tmp_path / "tokenizer.json")
    text = corpus_text(lines=400)
    inputs = jsonl(tmp_path / "in.jsonl", [text] * 400)  # seconds of tokenizing on 1 worker
    out = tmp_path / "new" / "dir" / "ds"
    before = sorted(tmp_path.iterdir())
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-m", "tenax.orchestrator.cli.main", "data",
                             "prepare", inputs, "--out", str(out), "--tokenizer", str(tok),
                             "--workers", "1"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:  # the writer's temporary .bin marks the start of the writing
        while not any((tmp_path / "new" / "dir").glob("ds.bin.tmp-*")):
            assert proc.poll() is None, "prepare ended before it wrote anything"
            threading.Event().wait(0.01)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err[-3000:]
    assert f"interrupted: nothing was written at {out}" in err
    assert sorted(tmp_path.iterdir()) == before


def test_the_sigterm_handler_of_prepare_is_put_back() -> None:
    from tenax.orchestrator.cli.data import sigterm_interrupts

    previous = signal.getsignal(signal.SIGTERM)  # another test's Ray may have set its own
    with sigterm_interrupts():
        assert signal.getsignal(signal.SIGTERM) is not previous
    assert signal.getsignal(signal.SIGTERM) is previous


def test_an_error_leaves_no_directory_that_out_created(tmp_path):
    (tmp_path / "keep").mkdir()
    bad = jsonl(tmp_path / "bad.jsonl", ["fine"])
    with open(bad, "a") as f:
        f.write("[1, 2]\n")
    for out in (tmp_path / "a" / "b" / "ds", tmp_path / "keep" / "c" / "ds"):
        with pytest.raises(ValueError, match=r"bad\.jsonl: line 2: not a JSON object"):
            prepare_dataset([bad], str(out), workers=1, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "keep"]
    assert list((tmp_path / "keep").iterdir()) == []
    with IndexedDatasetWriter(str(tmp_path / "x" / "y" / "ds"), np.uint16) as writer:
        writer.add_document([1, 2])
    assert sorted(p.name for p in (tmp_path / "x" / "y").iterdir()) == ["ds.bin", "ds.idx"]


def test_inputs_without_documents_are_refused(tmp_path, capsys):
    (tmp_path / "blank.jsonl").write_text("\n\n  \n")
    with pytest.raises(ValueError, match=r"the inputs \(.*blank\.jsonl\) hold no documents"):
        prepare_dataset([str(tmp_path / "blank.jsonl")], str(tmp_path / "out" / "ds"),
                        workers=1, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blank.jsonl"]
    (tmp_path / "empty.txt").write_text("")  # a .txt is one document: an empty one is skipped
    with pytest.raises(ValueError, match=r"hold no documents with tokens: 1 empty document"):
        prepare_dataset([str(tmp_path / "empty.txt")], str(tmp_path / "one"), workers=1,
                        progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blank.jsonl", "empty.txt"]


def prepared(tmp_path: Path, name: str, texts: list[str], tokenizer: str | None = None) -> str:
    prefix = str(tmp_path / name)
    prepare_dataset([jsonl(tmp_path / f"{name}.jsonl", texts)], prefix, tokenizer=tokenizer,
                    workers=1, progress=False)
    return prefix


def test_half_a_dataset_or_a_directory_is_named_as_such(tmp_path):
    prefix = prepared(tmp_path, "ds", ["hello world"] * 20)
    (tmp_path / "half").mkdir()
    os.replace(prefix + ".idx", tmp_path / "half" / "ds.idx")
    with pytest.raises(FileNotFoundError, match=r"data.source: indexed dataset .* has its "
                                                rf"\.bin but no {prefix}\.idx"):
        open_uri(prefix, "uint16", 8, 512, 0, "data.source")
    # PREFIX.bin itself is what a flat token file of earlier releases may be called
    assert open_uri(prefix + ".bin", "uint16", 8, 512, 0, "data.source").n_tokens == 20 * 12
    with pytest.raises(FileNotFoundError, match=r"data.sources\[1\].uri: indexed dataset .* "
                                                r"has its \.idx but no .*half/ds\.bin"):
        open_uri(str(tmp_path / "half" / "ds"), "uint16", 8, 512, 0, "data.sources[1].uri")
    with pytest.raises(FileNotFoundError, match=r"data.validation.uri: .*half' is a directory; "
                                                r"give the prefix of an indexed dataset"):
        open_uri(str(tmp_path / "half"), "uint16", 8, 512, 0, "data.validation.uri")


def test_document_ends_beyond_the_vocabulary_are_refused_on_open(tmp_path):
    """A byte-level dataset (EOS 256) under model.vocab_size=128: its text bytes all fit, so
    only windows holding an EOS would fail, after steps had trained on it; the loader refuses
    it on open, naming the field and the vocabulary, never the id."""
    prefix = prepared(tmp_path, "bytes", ["plain ascii text, long enough " * 4] * 10)
    with pytest.raises(ValueError, match=r"data.source: a token id outside \[0, "
                                         r"model.vocab_size=128\) ends one of the first 64 "
                                         r"documents of") as err:
        TokenDataLoader(DataSpec(source=prefix), 16, 128, 0, 4)
    assert "256" not in str(err.value)
    loader = TokenDataLoader(DataSpec(source=prefix), 16, 257, 0, 4)
    assert loader.batch(0, 0, 1)[0].shape == (4, 16)


def test_decoding_ids_of_another_tokenizer_names_the_id(tmp_path, capsys):
    hf = make_hf_tokenizer(tmp_path / "tokenizer.json", vocab_size=300)
    sp = make_sentencepiece(tmp_path, vocab_size=100)
    small = load_tokenizer(str(sp))
    with pytest.raises(ValueError, match=rf"token id 150 is outside its vocabulary \[0, "
                                         rf"{small.vocab_size}\); were these tokens made"):
        small.decode([5, 150])
    prefix = prepared(tmp_path, "ds", [corpus_text(lines=20)] * 3, str(hf))
    assert main(["data", "inspect", prefix, "--tokenizer", str(sp), "--count", "64"]) == 2
    assert "is outside its vocabulary" in capsys.readouterr().err
    assert main(["data", "inspect", prefix, "--count", "-1"]) == 2
    assert "--count: must be a non-negative integer, got -1" in capsys.readouterr().err


def test_inspect_decodes_with_a_tokenizer_that_names_no_eos(tmp_path, capsys):
    plain = str(make_hf_tokenizer(tmp_path / "tokenizer.json", special=None))
    prefix = str(tmp_path / "ds")
    assert main(["data", "prepare", jsonl(tmp_path / "in.jsonl", ["hello tenax"]), "--out",
                 prefix, "--tokenizer", plain, "--eos-id", "7", "--workers", "1",
                 "--json"]) == 0
    capsys.readouterr()
    assert main(["data", "inspect", prefix, "--tokenizer", plain]) == 2
    assert "set --eos-id" in capsys.readouterr().err
    assert main(["data", "inspect", prefix, "--tokenizer", plain, "--eos-id", "7",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["first_text"].startswith("hello tenax")


def test_out_naming_a_directory_is_refused(tmp_path, monkeypatch, capsys):
    """`--out data/` would write data.bin beside the directory while the summary said
    data/.bin; it is refused before anything is read or written."""
    monkeypatch.chdir(tmp_path)
    inputs = jsonl(tmp_path / "in.jsonl", ["hello"])
    (tmp_path / "data").mkdir()
    assert main(["data", "prepare", inputs, "--out", "data/", "--workers", "1"]) == 2
    assert "--out: 'data/' is not a dataset prefix; name the files, e.g. 'data/train'" \
        in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "in.jsonl"]
    assert list((tmp_path / "data").iterdir()) == []


class BlockingTokenizer(StubTokenizer):
    """Writes its worker's pid to `marker`, then tokenizes forever."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        Path(self.marker + ".tmp").write_text(str(os.getpid()))
        os.replace(self.marker + ".tmp", self.marker)
        threading.Event().wait()
        return []


def gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"  # a zombie no one reaped yet


def test_workers_end_when_the_parent_is_killed(tmp_path):
    """SIGKILL (the OOM killer) gives the parent no chance to stop its workers; they notice
    and exit rather than hold a CPU or wait on their queue forever."""
    import subprocess
    import sys

    inputs = jsonl(tmp_path / "in.jsonl", ["a", "b"])
    marker = str(tmp_path / "worker.pid")
    script = ("from tenax.workers.data import prepare_dataset\n"
              "from tests.test_data_edge_cases import BlockingTokenizer\n"
              "if __name__ == '__main__':\n"
              f"    prepare_dataset([{inputs!r}], {str(tmp_path / 'out')!r}, workers=1, "
              f"progress=False, tokenizer=BlockingTokenizer({marker!r}))\n")
    (tmp_path / "run.py").write_text(script)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    parent = subprocess.Popen([sys.executable, str(tmp_path / "run.py")], env=env)
    try:
        while not os.path.exists(marker):
            assert parent.poll() is None, "prepare ended before its worker started"
            threading.Event().wait(0.05)
        worker = int(Path(marker).read_text())
    finally:
        parent.kill()
        parent.wait()
    while not gone(worker):
        threading.Event().wait(0.05)
