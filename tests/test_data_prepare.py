"""`prepare_dataset` and `tenax data prepare / inspect`: corpora in, indexed datasets out.

Expected ids are each tokenizer's own `encode` of each document plus EOS; the output is read
with the independent reader of tests/test_indexed_dataset.py.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import fsspec
import numpy as np
import pytest

from tenax.orchestrator.cli.main import main
from tenax.workers.data import load_tokenizer, prepare_dataset
from tests.test_indexed_dataset import read_idx, read_sequences
from tests.test_tokenizer import (corpus_text, make_hf_tokenizer, make_sentencepiece,
                                  make_tiktoken)


def documents(n: int = 60) -> list[str]:
    lines = corpus_text(lines=3 * n, seed=1).splitlines()
    docs = ["\n".join(lines[i: i + 3]) for i in range(0, 3 * n, 3)]
    docs[3] = ""  # an empty document: counted, not written
    docs[5] = "ünïcödé — 東京 🚀"
    return docs


def write_inputs(tmp: Path, docs: list[str]) -> dict[str, list[str]]:
    """The same documents as jsonl, jsonl.gz, parquet (two row groups) and txt files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    half = len(docs) // 2
    lines = [json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)]
    (tmp / "a.jsonl").write_text("".join(lines[:half]) + "\n")  # a blank line is skipped
    with gzip.open(tmp / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("".join(lines[half:]))
    pq.write_table(pa.table({"text": docs, "n": list(range(len(docs)))}), tmp / "c.parquet",
                   row_group_size=max(1, len(docs) // 2))
    txts = []
    for i, d in enumerate(docs[:4]):
        (tmp / f"t{i}.txt").write_text(d, encoding="utf-8")
        txts.append(str(tmp / f"t{i}.txt"))
    return {"jsonl": [str(tmp / "a.jsonl"), str(tmp / "b.jsonl.gz")],
            "parquet": [str(tmp / "c.parquet")], "txt": txts}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, str | None]:
    tmp = tmp_path_factory.mktemp("tok")
    return {"bytes": None, "hf": str(make_hf_tokenizer(tmp / "tokenizer.json")),
            "sentencepiece": str(make_sentencepiece(tmp)),
            "tiktoken": str(make_tiktoken(tmp / "ranks.tiktoken"))}


@pytest.mark.parametrize("kind", ["bytes", "hf", "sentencepiece", "tiktoken"])
def test_prepared_ids_are_the_tokenizers_own_encoding_plus_eos(tmp_path, tokenizers, kind):
    docs = documents()
    inputs = write_inputs(tmp_path, docs)
    tok = load_tokenizer(tokenizers[kind])
    for fmt, files in inputs.items():
        want_docs = docs[:4] if fmt == "txt" else docs
        stats = prepare_dataset(files, str(tmp_path / f"out_{fmt}"), tokenizer=tokenizers[kind],
                                workers=1, progress=False)
        want = [tok.encode(d) + [tok.eos_id] for d in want_docs if d]
        assert read_sequences(tmp_path / f"out_{fmt}") == want, (kind, fmt)
        assert stats["documents"] == len(want) == len(want_docs) - 1
        assert stats["empty_documents"] == 1
        assert stats["tokens"] == sum(map(len, want))
        assert stats["dtype"] == "uint16" and stats["prefix"] == str(tmp_path / f"out_{fmt}")
        on_disk = sum((tmp_path / f"out_{fmt}{s}").stat().st_size for s in (".bin", ".idx"))
        assert stats["bytes"] == on_disk
        assert read_idx(tmp_path / f"out_{fmt}.idx")["docs"].tolist() == \
            list(range(len(want) + 1))


def test_two_workers_write_byte_identical_output(tmp_path, tokenizers, monkeypatch):
    import tenax.workers.data.corpus as corpus

    monkeypatch.setattr(corpus, "BATCH_DOCUMENTS", 7)  # many batches, so order matters
    docs = documents(200)
    inputs = write_inputs(tmp_path, docs)
    files = inputs["jsonl"] + inputs["parquet"]
    for workers in (1, 2):
        prepare_dataset(files, str(tmp_path / f"w{workers}"), tokenizer=tokenizers["hf"],
                        workers=workers, progress=False)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"w1{suffix}").read_bytes() == (tmp_path / f"w2{suffix}").read_bytes()
    tok = load_tokenizer(tokenizers["hf"])
    assert read_sequences(tmp_path / "w2") == \
        [tok.encode(d) + [tok.eos_id] for d in docs * 2 if d]


BAD_LINES = [
    (b'{"text": "ok"}\n{"text": "caf\xe9"}\n', r"bad\.jsonl: line 2: invalid UTF-8 at byte 13"),
    (b'{"text": "ok"}\n{"text": "a"}\n{"body": "x"}\n', r"bad\.jsonl: line 3: no field 'text'"),
    (b'{"text": 5}\n', r"bad\.jsonl: line 1: field 'text' is a number, not a string"),
    (b'{"text": null}\n', r"bad\.jsonl: line 1: field 'text' is null, not a string"),
    (b'{"text": "ok"}\nnot json\n', r"bad\.jsonl: line 2: not JSON"),
    (b'["text"]\n', r"bad\.jsonl: line 1: not a JSON object but an array; each line must be "
                    r"an object with the text in field 'text'"),
    (b'"just a string"\n', r"bad\.jsonl: line 1: not a JSON object but a string"),
]


@pytest.mark.parametrize("content, message", BAD_LINES)
def test_bad_jsonl_names_file_and_line_and_leaves_no_output(tmp_path, content, message):
    import tenax.workers.data.corpus as corpus

    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "fine"}\n' * 3)
    (tmp_path / "bad.jsonl").write_bytes(content)
    before = sorted(tmp_path.iterdir())
    with pytest.raises(ValueError, match=message):
        prepare_dataset([str(good), str(tmp_path / "bad.jsonl")], str(tmp_path / "out"),
                        workers=1, progress=False)
    assert sorted(tmp_path.iterdir()) == before
    assert corpus.BATCH_DOCUMENTS == 1000


def test_bad_parquet_and_txt_inputs_fail_clearly(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "nocol.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    pq.write_table(pa.table({"text": ["a", None]}), tmp_path / "null.parquet")
    (tmp_path / "bad.txt").write_bytes(b"abc\xff")
    whole = gzip.compress(b"".join(b'{"text": "document %d"}\n' % i for i in range(2000)))
    (tmp_path / "cut.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "plain.jsonl.gz").write_text('{"text": "not compressed"}\n')
    (tmp_path / "junk.parquet").write_bytes(b"this is not a parquet file at all\n" * 10)
    cases = [("nocol.parquet", r"nocol\.parquet: no column 'text'"),
             ("ints.parquet", r"ints\.parquet: column 'text' is int64, not a string"),
             ("null.parquet", r"null\.parquet: row 1 column 'text' is null"),
             ("bad.txt", r"bad\.txt: invalid UTF-8 at byte 3"),
             ("x.csv", r"x\.csv' is not one of"),
             ("cut.jsonl.gz", r"cut\.jsonl\.gz: unreadable jsonl\.gz file at line \d+ "
                              r"\(Compressed file ended before the end-of-stream marker"),
             ("plain.jsonl.gz", r"plain\.jsonl\.gz: unreadable jsonl\.gz file at line 1 "
                                r"\(Not a gzipped file"),
             ("junk.parquet", r"junk\.parquet: unreadable parquet file \(.*magic bytes")]
    (tmp_path / "x.csv").write_text("a,b\n")
    before = sorted(tmp_path.iterdir())
    for name, message in cases:
        with pytest.raises(ValueError, match=message):
            prepare_dataset([str(tmp_path / name)], str(tmp_path / "out"), progress=False,
                            workers=1)
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        prepare_dataset([str(tmp_path / "nope.jsonl")], str(tmp_path / "out"), progress=False)
    with pytest.raises(FileNotFoundError, match=r"\*\.jsonl' matches no file"):
        prepare_dataset([str(tmp_path / "*.jsonl")], str(tmp_path / "out"), progress=False)
    assert sorted(tmp_path.iterdir()) == before


class StubTokenizer:
    """A tokenizer object for prepare_dataset: every document is token 1; subclasses make
    chosen documents misbehave."""

    vocab_size, eos_id = 300, 299

    def encode(self, text: str) -> list[int]:
        return [1]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return ""

    def files(self) -> list[str]:
        return []


class HugeIdTokenizer(StubTokenizer):
    """Claims a small vocabulary but emits an id that does not fit uint16."""

    def encode(self, text: str) -> list[int]:
        return [70000] if "boom" in text else [1]


def test_token_id_beyond_the_dtype_names_the_document(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n{"text": "boom"}\n')
    with pytest.raises(ValueError, match=r"in\.jsonl: line 3: token id 70000 does not fit the "
                                         r"dataset dtype uint16"):
        prepare_dataset([str(tmp_path / "in.jsonl")], str(tmp_path / "out"),
                        tokenizer=HugeIdTokenizer(), workers=1, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


class SilentHugeIdTokenizer(HugeIdTokenizer):
    """Maps "" and "nothing" to no tokens, "boom" to an id beyond uint16."""

    def encode(self, text: str) -> list[int]:
        return [] if text in ("", "nothing") else super().encode(text)


def test_a_bad_token_is_named_by_its_input_line_after_skipped_documents(tmp_path):
    lines = ["a", "", "nothing", "b", "boom"]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    with pytest.raises(ValueError, match=r"in\.jsonl: line 5: token id 70000 does not fit"):
        prepare_dataset([str(tmp_path / "in.jsonl")], str(tmp_path / "out"),
                        tokenizer=SilentHugeIdTokenizer(), workers=1, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


EMPTY_CORPUS = ["", "first document", "", "", "second — ünï 東京", "", "", "", "third", ""]


@pytest.mark.parametrize("kind, workers", [("bytes", 1), ("bytes", 2), ("hf", 1)])
def test_empty_documents_are_skipped_and_counted(tmp_path, tokenizers, monkeypatch, caplog,
                                                 kind, workers):
    """Empty texts between real ones write nothing, in any batch layout (a batch of only
    empty documents included); the count and the first one's line are reported."""
    import tenax.workers.data.corpus as corpus

    monkeypatch.setattr(corpus, "BATCH_DOCUMENTS", 3)
    path = tmp_path / "in.jsonl"
    path.write_text("\n" + "".join(json.dumps({"text": t}) + "\n" for t in EMPTY_CORPUS))
    with caplog.at_level("INFO", logger="tenax.workers.data.prepare"):
        stats = prepare_dataset([str(path)], str(tmp_path / "ds"), tokenizer=tokenizers[kind],
                                workers=workers, progress=False)
    real = ["first document", "second — ünï 東京", "third"]
    if kind == "bytes":  # the bytes themselves, not the tokenizer's word for them
        want = [list(t.encode("utf-8")) + [256] for t in real]
    else:
        tok = load_tokenizer(tokenizers[kind])
        want = [tok.encode(t) + [tok.eos_id] for t in real]
        assert all(len(w) > 1 for w in want)
    assert read_sequences(tmp_path / "ds") == want
    assert read_idx(tmp_path / "ds.idx")["docs"].tolist() == [0, 1, 2, 3]
    assert (stats["documents"], stats["empty_documents"]) == (3, 7)
    assert stats["tokens"] == sum(map(len, want))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == ["data prepare: skipped 7 empty documents (no tokens; the first at "
                        f"{path}: line 2)"]
    infos = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    assert len(infos) == 1 and infos[0].endswith("; skipped 7 empty documents")


def test_text_the_tokenizer_maps_to_nothing_is_an_empty_document(tmp_path, tokenizers):
    """SentencePiece normalizes whitespace away: such a document has no tokens either."""
    tok = load_tokenizer(tokenizers["sentencepiece"])
    texts = ["hello world", "   ", "\n\n", "the end"]
    assert [len(tok.encode(t)) > 0 for t in texts] == [True, False, False, True]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    stats = prepare_dataset([str(path)], str(tmp_path / "ds"), workers=1, progress=False,
                            tokenizer=tokenizers["sentencepiece"])
    assert read_sequences(tmp_path / "ds") == \
        [tok.encode("hello world") + [tok.eos_id], tok.encode("the end") + [tok.eos_id]]
    assert (stats["documents"], stats["empty_documents"]) == (2, 2)


def test_only_empty_documents_is_an_empty_dataset(tmp_path, tokenizers, capsys):
    path = tmp_path / "all.jsonl"
    path.write_text('\n{"text": ""}\n{"text": ""}\n\n{"text": ""}\n')
    (tmp_path / "one.txt").write_text("")
    before = sorted(tmp_path.iterdir())
    for inputs, count, first in (([path], 3, r"all\.jsonl: line 2"), ([tmp_path / "one.txt"], 1,
                                                                      r"one\.txt")):
        with pytest.raises(ValueError, match=r"data prepare: the inputs \(.*\) hold no documents "
                                             rf"with tokens: {count} empty documents? skipped "
                                             rf"\(the first at .*{first}\); nothing was written"):
            prepare_dataset([str(p) for p in inputs], str(tmp_path / "out" / "ds"), workers=1,
                            progress=False)
    ws = tmp_path / "ws.jsonl"
    ws.write_text('{"text": "  "}\n{"text": ""}\n')
    before.append(ws)
    assert main(["data", "prepare", str(ws), "--out", str(tmp_path / "ds"), "--tokenizer",
                 tokenizers["sentencepiece"], "--workers", "1"]) == 2
    assert f"hold no documents with tokens: 2 empty documents skipped (the first at {ws}: " \
           f"line 1); nothing was written" in capsys.readouterr().err
    assert sorted(tmp_path.iterdir()) == sorted(before)


def test_fsspec_inputs_globs_and_output(tmp_path, tokenizers):
    for i in range(3):
        with fsspec.open(f"memory://prep-test/in/p{i}.jsonl", "w") as f:
            f.write(json.dumps({"body": f"document {i}"}) + "\n")
    # The workers do not share this process's memory:// filesystem: the tokenizer travels as
    # bytes, the documents in their batches.
    with fsspec.open("memory://prep-test/tok/ranks.tiktoken", "wb") as f:
        f.write(Path(tokenizers["tiktoken"]).read_bytes())
    stats = prepare_dataset(["memory://prep-test/in/p*.jsonl"], "memory://prep-test/out/ds",
                            tokenizer="memory://prep-test/tok/ranks.tiktoken", text_field="body",
                            workers=2, progress=False)
    from tenax.workers.data import IndexedDataset

    ds = IndexedDataset("memory://prep-test/out/ds")
    tok = load_tokenizer(tokenizers["tiktoken"])
    assert stats["documents"] == ds.num_docs == 3
    assert [ds.sequence(i).tolist() for i in range(3)] == \
        [tok.encode(f"document {i}") + [tok.eos_id] for i in range(3)]


def test_cli_prepare_then_inspect(tmp_path, tokenizers, capsys):
    (tmp_path / "in.jsonl").write_text('{"text": "hello tenax"}\n{"text": "second"}\n')
    out = tmp_path / "ds"
    assert main(["data", "prepare", str(tmp_path / "in.jsonl"), "--out", str(out),
                 "--tokenizer", tokenizers["hf"], "--workers", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    tok = load_tokenizer(tokenizers["hf"])
    ids = tok.encode("hello tenax") + [tok.eos_id] + tok.encode("second") + [tok.eos_id]
    assert doc["documents"] == 2 and doc["tokens"] == len(ids) and doc["dtype"] == "uint16"
    assert doc["empty_documents"] == 0
    assert main(["data", "prepare", str(tmp_path / "in.jsonl"), "--out", str(out),
                 "--tokenizer", tokenizers["hf"], "--workers", "1"]) == 0
    # people get a progress line and a summary on stderr
    err = capsys.readouterr().err
    assert f"prepared 2 documents, {len(ids)} tokens (uint16) into {out}.bin/.idx" in err
    assert "skipped" not in err
    (tmp_path / "gaps.jsonl").write_text('{"text": ""}\n{"text": "hello tenax"}\n{"text": ""}\n'
                                         '{"text": "second"}\n')
    assert main(["data", "prepare", str(tmp_path / "gaps.jsonl"), "--out", str(out),
                 "--tokenizer", tokenizers["hf"], "--workers", "1"]) == 0
    assert f"prepared 2 documents, {len(ids)} tokens (uint16) into {out}.bin/.idx" in \
        (err := capsys.readouterr().err) and err.rstrip().endswith("; skipped 2 empty documents")
    assert main(["data", "prepare", str(tmp_path / "gaps.jsonl"), "--out", str(out),
                 "--tokenizer", tokenizers["hf"], "--workers", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["documents"], doc["tokens"], doc["empty_documents"]) == (2, len(ids), 2)
    assert main(["data", "prepare", str(tmp_path / "in.jsonl"), "--out", str(out),
                 "--workers", "0"]) == 2
    assert "--workers: must be a positive integer, got 0" in capsys.readouterr().err
    assert main(["data", "inspect", str(out), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["first_tokens"] == ids and shown["documents"] == 2 and "first_text" not in shown
    assert main(["data", "inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"first {len(ids)} tokens: {ids}" in text and "decoded:" not in text
    assert text.endswith("(pass --tokenizer FILE to decode)\n")
    assert main(["data", "inspect", str(out), "--tokenizer", tokenizers["hf"]]) == 0
    text = capsys.readouterr().out
    assert f"{out}: 2 documents, {len(ids)} tokens, dtype uint16" in text
    assert f"first {len(ids)} tokens: {ids}" in text
    assert "decoded: 'hello tenax<|endoftext|>second<|endoftext|>'" in text
    assert main(["data", "inspect", str(tmp_path / "missing")]) == 2
    assert "missing.idx' does not exist" in capsys.readouterr().err
    assert np.array_equal(read_sequences(out)[0], ids[: len(tok.encode("hello tenax")) + 1])


def test_a_tokenizer_without_eos_needs_eos_id(tmp_path, capsys):
    """prepare_dataset(eos_id=) / --eos-id append that id; without it the error names the flag."""
    plain = str(make_hf_tokenizer(tmp_path / "tokenizer.json", special=None))
    (tmp_path / "in.jsonl").write_text('{"text": "hello tenax"}\n{"text": "second"}\n')
    inputs, before = [str(tmp_path / "in.jsonl")], sorted(tmp_path.iterdir())
    with pytest.raises(ValueError, match=r"no end-of-document token.*set --eos-id "
                                         r"\(data\.eos_id when training\)"):
        prepare_dataset(inputs, str(tmp_path / "ds"), tokenizer=plain, workers=1,
                        progress=False)
    assert sorted(tmp_path.iterdir()) == before
    tok = load_tokenizer(plain, eos_id=7)
    want = [tok.encode("hello tenax") + [7], tok.encode("second") + [7]]
    stats = prepare_dataset(inputs, str(tmp_path / "ds"), tokenizer=plain, workers=1,
                            progress=False, eos_id=7)
    assert read_sequences(tmp_path / "ds") == want and stats["tokens"] == sum(map(len, want))
    assert main(["data", "prepare", *inputs, "--out", str(tmp_path / "cli"), "--tokenizer",
                 plain, "--eos-id", "7", "--workers", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["documents"] == 2
    assert read_sequences(tmp_path / "cli") == want
    assert main(["data", "prepare", *inputs, "--out", str(tmp_path / "none"), "--tokenizer",
                 plain, "--workers", "1"]) == 2
    assert "set --eos-id (data.eos_id when training)" in capsys.readouterr().err
    assert not (tmp_path / "none.bin").exists()
