"""Megatron's indexed dataset format (MMIDIDX), against a reader and a writer written here.

`read_idx` / `write_idx` below follow the published layout byte by byte with `struct` and
`np.frombuffer`, independently of tenax's classes, and stand in for Megatron-LM's own reader
(which is not installable without its training stack).
"""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from tenax.workers.data import (IndexedDataset, IndexedDatasetWriter, dtype_for_vocab,
                                is_indexed_dataset)

MEGATRON_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                  6: np.float64, 7: np.float32, 8: np.uint16}


def read_idx(path: Path) -> dict:
    raw = path.read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack_from("<Q", raw, 9)
    (code,) = struct.unpack_from("<B", raw, 17)
    n_seq, n_doc = struct.unpack_from("<QQ", raw, 18)
    off = 34
    lengths = np.frombuffer(raw, np.int32, n_seq, off)
    pointers = np.frombuffer(raw, np.int64, n_seq, off + 4 * n_seq)
    docs = np.frombuffer(raw, np.int64, n_doc, off + 12 * n_seq)
    assert len(raw) == off + 12 * n_seq + 8 * n_doc
    return {"version": version, "dtype": np.dtype(MEGATRON_CODES[code]), "lengths": lengths,
            "pointers": pointers, "docs": docs}


def read_sequences(prefix: Path) -> list[list[int]]:
    idx = read_idx(Path(f"{prefix}.idx"))
    tokens = np.frombuffer(Path(f"{prefix}.bin").read_bytes(), idx["dtype"])
    item = idx["dtype"].itemsize
    return [tokens[p // item: p // item + n].tolist()
            for p, n in zip(idx["pointers"], idx["lengths"])]


def write_idx(prefix: Path, sequences: list[list[int]], docs: list[int], code: int = 8) -> None:
    dtype = np.dtype(MEGATRON_CODES[code])
    lengths = [len(s) for s in sequences]
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]) * dtype.itemsize
    Path(f"{prefix}.bin").write_bytes(b"".join(np.array(s, dtype).tobytes() for s in sequences))
    Path(f"{prefix}.idx").write_bytes(
        b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, len(sequences), len(docs))
        + np.array(lengths, np.int32).tobytes() + np.array(pointers, np.int64).tobytes()
        + np.array(docs, np.int64).tobytes())


DOCS = [[5, 6, 7, 0], [8, 0], [], [65535, 1, 2, 3, 4, 0]]


def test_writer_output_reads_back_with_the_independent_reader(tmp_path):
    prefix = tmp_path / "sub" / "ds"
    with IndexedDatasetWriter(str(prefix), np.uint16) as writer:
        writer.add_document(DOCS[0])
        writer.add_documents(DOCS[1:3])
        writer.add_packed(np.array(DOCS[3]), np.array([len(DOCS[3])]))
    idx = read_idx(Path(f"{prefix}.idx"))
    assert idx["version"] == 1 and idx["dtype"] == np.uint16
    assert idx["docs"].tolist() == [0, 1, 2, 3, 4]
    assert read_sequences(prefix) == DOCS
    assert sorted(p.name for p in prefix.parent.iterdir()) == ["ds.bin", "ds.idx"]


def test_reader_opens_an_independently_written_dataset(tmp_path):
    # Two documents of several sequences each (Megatron's sentence-split datasets).
    seqs = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    write_idx(tmp_path / "m", seqs, [0, 2, 4], code=4)
    ds = IndexedDataset(str(tmp_path / "m"))
    assert (ds.num_sequences, ds.num_docs, ds.num_tokens) == (4, 2, 10)
    assert ds.dtype == np.int32 and ds.sequence_lengths.dtype == np.int32
    assert ds.sequence_offsets.tolist() == [0, 3, 5, 6]
    assert ds.document_indices.tolist() == [0, 2, 4]
    assert ds.document_token_offsets.tolist() == [0, 5, 10]
    assert ds.read_tokens(2, 7).tolist() == [3, 4, 5, 6, 7]  # spans three sequences
    assert ds.read_tokens(2, 7).dtype == np.int64
    assert [a.tolist() for a in ds.read_ranges([(0, 1), (9, 10), (4, 4)])] == [[1], [10], []]
    assert [ds.sequence(i).tolist() for i in range(4)] == seqs
    assert ds.document(1).tolist() == [6, 7, 8, 9, 10]
    with pytest.raises(ValueError, match=r"\[8, 11\) is outside \[0, 10\)"):
        ds.read_tokens(8, 11)
    assert is_indexed_dataset(str(tmp_path / "m"))
    assert IndexedDataset(str(tmp_path / "m.idx")).num_tokens == 10  # suffix given: same data


def test_int32_for_large_vocabularies_and_memory_uris():
    assert dtype_for_vocab(257) == dtype_for_vocab(65536) == np.uint16
    assert dtype_for_vocab(65537) == dtype_for_vocab(128256) == np.int32
    with IndexedDatasetWriter("memory://idx-test/big", np.int32) as writer:
        writer.add_document([128000, 5, 128001])
    ds = IndexedDataset("memory://idx-test/big")
    assert ds.dtype == np.int32 and ds.read_tokens(0, 3).tolist() == [128000, 5, 128001]
    assert is_indexed_dataset("memory://idx-test/big")
    assert not is_indexed_dataset("memory://idx-test/nothing")


def test_truncated_index_and_short_bin_fail_clearly(tmp_path):
    write_idx(tmp_path / "d", [[1, 2, 3], [4, 5]], [0, 1, 2])
    idx, bin_ = tmp_path / "d.idx", tmp_path / "d.bin"
    whole_idx, whole_bin = idx.read_bytes(), bin_.read_bytes()
    idx.write_bytes(whole_idx[:-5])
    with pytest.raises(ValueError, match=rf"d\.idx.*{len(whole_idx) - 5} bytes.*needs "
                                         rf"{len(whole_idx)}; truncated"):
        IndexedDataset(str(tmp_path / "d"))
    idx.write_bytes(whole_idx[:20])
    with pytest.raises(ValueError, match=r"d\.idx.*truncated index, 20 bytes"):
        IndexedDataset(str(tmp_path / "d"))
    idx.write_bytes(whole_idx)
    bin_.write_bytes(whole_bin[:-2])
    with pytest.raises(ValueError, match=r"d\.bin.* 8 bytes, shorter than its index .*= 10\)"):
        IndexedDataset(str(tmp_path / "d"))
    bin_.unlink()
    with pytest.raises(FileNotFoundError, match=r"d\.bin"):
        IndexedDataset(str(tmp_path / "d"))


@pytest.mark.parametrize("patch, message", [
    ((0, b"NOTANIDX\x00"), "not a Megatron indexed dataset"),
    ((9, struct.pack("<Q", 2)), "index version 2"),
    ((17, struct.pack("<B", 7)), "dtype code 7 is not an integer"),
    ((34 + 8 + 8, struct.pack("<q", 4)), r"sequence 1 starts at byte 4 .* at byte 6"),
])
def test_corrupt_headers_fail_clearly(tmp_path, patch, message):
    write_idx(tmp_path / "d", [[1, 2, 3], [4, 5]], [0, 1, 2])
    raw = bytearray((tmp_path / "d.idx").read_bytes())
    at, data = patch
    raw[at: at + len(data)] = data
    (tmp_path / "d.idx").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=message):
        IndexedDataset(str(tmp_path / "d"))


def test_writer_aborts_on_error_and_rejects_ids_that_do_not_fit(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(str(tmp_path / "x"), np.uint16) as writer:
            writer.add_document([1, 2, 3])
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match=r"token id 65536 does not fit dtype uint16"):
        with IndexedDatasetWriter(str(tmp_path / "x"), np.uint16) as writer:
            writer.add_document([1, 65536])
    with pytest.raises(ValueError, match=r"token id -1 does not fit"):
        with IndexedDatasetWriter(str(tmp_path / "x"), np.int32) as writer:
            writer.add_document([-1])
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="float32.*not an integer"):
        IndexedDatasetWriter(str(tmp_path / "x"), np.float32)
