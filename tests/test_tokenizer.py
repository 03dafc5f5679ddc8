"""Tokenizers read from local files: HF tokenizer.json, SentencePiece, tiktoken BPE, bytes.

Every tokenizer is built here from a few KB of generated text (nothing from a hub), and each
wrapper is checked against the library it wraps, called directly.
"""
from __future__ import annotations

import base64
import json
import pickle
import random
import shutil
from pathlib import Path

import fsspec
import pytest

from tenax.workers.data import ByteTokenizer, Tokenizer, auto_vocab_size, load_tokenizer

SAMPLES = ["the quick brown fox", "Ünïcödé text, with punctuation!", "",
           "numbers 12345 and  double  spaces\nand lines", "<|endoftext|> inside text"]
MERGES = [b"th", b"he", b"the", b" t", b"in", b"ing"]


def corpus_text(lines: int = 400, seed: int = 0) -> str:
    """A few KB of varied text: enough distinct characters and words to train small vocabs."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789éüßø"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(1, 8))) for _ in range(300)]
    words += ["the", "tenax", "training", "token", "fault", "elastic", "ing", "in"]
    return "\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(3, 15)))
                     + rng.choice([".", "!", "?", ","]) for _ in range(lines))


def make_hf_tokenizer(path: Path, special: str | None = "<|endoftext|>",
                      vocab_size: int = 400) -> Path:
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                  special_tokens=[special] if special else [],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus_text().splitlines(), trainer)
    tok.save(str(path))
    return path


def make_sentencepiece(tmp: Path, vocab_size: int = 200) -> Path:
    import sentencepiece

    text = tmp / "sp_corpus.txt"
    text.write_text(corpus_text())
    sentencepiece.SentencePieceTrainer.train(input=str(text), model_prefix=str(tmp / "sp"),
                                             vocab_size=vocab_size, minloglevel=2)
    return tmp / "sp.model"


def make_tiktoken(path: Path) -> Path:
    ranks = {bytes([i]): i for i in range(256)}
    for merge in MERGES:
        ranks[merge] = len(ranks)
    path.write_text("".join(f"{base64.b64encode(tok).decode()} {rank}\n"
                            for tok, rank in ranks.items()))
    return path


def test_byte_tokenizer_is_utf8_bytes_then_eos_256():
    tok = load_tokenizer(None)
    assert isinstance(tok, ByteTokenizer) and isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.eos_id, tok.files()) == (257, 256, [])
    assert tok.encode("é!") == [0xC3, 0xA9, 0x21]
    assert tok.encode_batch(SAMPLES) == [list(s.encode()) for s in SAMPLES]
    assert tok.decode(tok.encode("héllo") + [256]) == "héllo"
    assert auto_vocab_size(tok) == 320


def test_hf_tokenizer_matches_the_library_and_finds_endoftext(tmp_path):
    from tokenizers import Tokenizer as RustTokenizer

    path = make_hf_tokenizer(tmp_path / "tokenizer.json")
    ref = RustTokenizer.from_file(str(path))
    ref.encode_special_tokens = True  # a literal "<|endoftext|>" in a text is text
    tok = load_tokenizer(str(path))
    assert isinstance(tok, Tokenizer)
    assert tok.eos_id == ref.token_to_id("<|endoftext|>")
    assert tok.vocab_size == ref.get_vocab_size(with_added_tokens=True) == 400
    assert tok.encode_batch(SAMPLES) == [ref.encode(s, add_special_tokens=False).ids
                                         for s in SAMPLES]
    assert [tok.encode(s) for s in SAMPLES] == tok.encode_batch(SAMPLES)
    assert tok.decode(tok.encode(SAMPLES[1])) == SAMPLES[1]
    assert tok.files() == [str(path)]
    assert auto_vocab_size(tok) == 448


def test_a_literal_eos_token_in_text_is_ordinary_text_for_every_backend(tmp_path):
    """Only the EOS appended after a document may end it: no backend turns the written-out
    name of its EOS token into the EOS id (the library's default for tokenizer.json would)."""
    from tokenizers import Tokenizer as RustTokenizer

    hf = make_hf_tokenizer(tmp_path / "tokenizer.json")
    default = RustTokenizer.from_file(str(hf))
    text = "before <|endoftext|> after"
    assert default.token_to_id("<|endoftext|>") in default.encode(text).ids  # the trap
    paths = [hf, make_sentencepiece(tmp_path), make_tiktoken(tmp_path / "ranks.tiktoken")]
    for path in paths:
        tok = load_tokenizer(str(path))
        for name in ("<|endoftext|>", "</s>"):
            written = f"before {name} after"
            ids = tok.encode(written)
            assert tok.eos_id not in ids, (path.name, name)
            assert tok.encode_batch([written]) == [ids]
            assert pickle.loads(pickle.dumps(tok)).encode(written) == ids
            if path is not paths[1]:  # SentencePiece normalises spaces, the others round-trip
                assert tok.decode(ids) == written


def test_tokenizers_pickle_and_rebuild_from_their_bytes(tmp_path):
    paths = [make_hf_tokenizer(tmp_path / "tokenizer.json"), make_sentencepiece(tmp_path),
             make_tiktoken(tmp_path / "ranks.tiktoken")]
    for path in paths:
        tok = load_tokenizer(str(path))
        want = tok.encode_batch(SAMPLES)
        copy = pickle.loads(pickle.dumps(tok))
        path.unlink()  # the copy must not need the file any more
        assert copy.encode_batch(SAMPLES) == want, path.name
        assert (copy.vocab_size, copy.eos_id) == (tok.vocab_size, tok.eos_id)


def test_hf_eos_from_config_then_template_then_error(tmp_path):
    from tokenizers import processors

    plain = make_hf_tokenizer(tmp_path / "tokenizer.json", special=None)
    with pytest.raises(ValueError, match=r"tokenizer.json.*no end-of-document.*data\.eos_id"):
        load_tokenizer(str(plain))
    assert load_tokenizer(str(plain), eos_id=7).eos_id == 7
    with pytest.raises(ValueError, match=r"data.eos_id: 400 .*vocab_size 400"):
        load_tokenizer(str(plain), eos_id=400)

    from tokenizers import Tokenizer as RustTokenizer

    tok = RustTokenizer.from_file(str(plain))
    tok.add_special_tokens(["</s>", "<my_eos>"])
    template = tmp_path / "templated"
    template.mkdir()
    tok.post_processor = processors.TemplateProcessing(
        single="$A <my_eos>", special_tokens=[("<my_eos>", tok.token_to_id("<my_eos>"))])
    tok.save(str(template / "tokenizer.json"))
    assert load_tokenizer(str(template / "tokenizer.json")).eos_id == tok.token_to_id("<my_eos>")
    # A tokenizer_config.json next to the file names the EOS and beats the template.
    (template / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    found = load_tokenizer(str(template / "tokenizer.json"))
    assert found.eos_id == tok.token_to_id("</s>")
    assert found.files() == [str(template / "tokenizer.json"),
                             str(template / "tokenizer_config.json")]


def test_sentencepiece_matches_the_library(tmp_path):
    import sentencepiece

    path = make_sentencepiece(tmp_path)
    ref = sentencepiece.SentencePieceProcessor(model_file=str(path))
    tok = load_tokenizer(str(path))
    assert tok.eos_id == ref.eos_id() == ref.piece_to_id("</s>")
    assert tok.vocab_size == ref.get_piece_size() == 200
    assert tok.encode_batch(SAMPLES) == [ref.encode(s) for s in SAMPLES]
    assert tok.decode(tok.encode("the tenax")) == "the tenax"


def test_tiktoken_file_applies_its_merges_and_appends_endoftext(tmp_path):
    path = make_tiktoken(tmp_path / "ranks.tiktoken")
    tok = load_tokenizer(str(path))
    the = 256 + MERGES.index(b"the")
    assert tok.vocab_size == 256 + len(MERGES) + 1 and tok.eos_id == 256 + len(MERGES)
    assert tok.encode("the") == [the]
    assert tok.encode(" then") == [32, the, ord("n")]  # the cl100k pattern splits " then"
    # special text is ordinary text: never the EOS id
    assert tok.eos_id not in tok.encode("<|endoftext|>")
    for text in SAMPLES:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode_batch(SAMPLES) == [tok.encode(s) for s in SAMPLES]


def test_kind_is_detected_by_content_and_uris_are_read_through_fsspec(tmp_path):
    hf = make_hf_tokenizer(tmp_path / "tokenizer.json")
    sp = make_sentencepiece(tmp_path)
    tk = make_tiktoken(tmp_path / "ranks.tiktoken")
    for src, kind in ((hf, "hf"), (sp, "sentencepiece"), (tk, "tiktoken")):
        bare = tmp_path / f"no_extension_{kind}"
        shutil.copy(src, bare)
        assert load_tokenizer(str(bare)).kind == kind
        uri = f"memory://tok-test/{kind}/{src.name}"
        with fsspec.open(uri, "wb") as f:
            f.write(src.read_bytes())
        remote = load_tokenizer(uri)
        assert remote.encode_batch(SAMPLES) == load_tokenizer(str(src)).encode_batch(SAMPLES)
        assert remote.files() == [uri]
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x00\x01not a tokenizer")
    with pytest.raises(ValueError, match="junk.bin.*could not be read"):
        load_tokenizer(str(junk))
    with pytest.raises(FileNotFoundError, match="missing.json"):
        load_tokenizer(str(tmp_path / "missing.json"))


def test_a_tokenizer_without_eos_sizes_auto_vocab_with_data_eos_id(tmp_path):
    from tenax.workers.errors import SpecError
    from tenax.workers.spec import load_spec

    path = make_hf_tokenizer(tmp_path / "tokenizer.json", special=None)
    with pytest.raises(SpecError, match="eos_id"):
        load_spec(overrides=[f"data.tokenizer={path}", "model.vocab_size=auto"])
    spec = load_spec(overrides=[f"data.tokenizer={path}", "model.vocab_size=auto",
                                "data.eos_id=7"])
    assert spec.model.vocab_size == 448 and spec.data.eos_id == 7  # 400 rounded up to 64


def test_a_file_larger_than_any_tokenizer_is_refused_without_reading_it_all():
    from tenax.workers.data.tokenizer import read_bytes

    with pytest.raises(ValueError, match="larger than 1 MiB"):
        read_bytes("/dev/zero", limit=1 << 20)


def test_a_missing_tokenizer_is_named_once(tmp_path):
    from tenax.workers.errors import SpecError
    from tenax.workers.spec import load_spec

    missing = str(tmp_path / "missing.json")
    with pytest.raises(SpecError) as err:
        load_spec(overrides=[f"data.tokenizer={missing}"])
    assert f"data.tokenizer: {missing!r} does not exist" in str(err.value)
    assert str(err.value).count("does not exist") == 1
