"""Where samples come from: synthetic progressions, a flat token file, an indexed dataset.

A source is a list of `num_samples` windows; window i is tokens [i*S, i*S + S + 1) of the
source's concatenated token stream (inputs the first S, targets shifted by one). Which window a
global sample index reads is decided elsewhere (the loader's seeded permutation, or a blend);
sources only read windows, by ranged reads, never the whole file (it may be terabytes on object
storage).

Token ids are checked against vocab_size as they are read. The error names the sample and the
URI but never the offending value or a byte offset: a job's errors reach whoever submitted it,
and the data (or a file pointed at by mistake) must not leak through them.

`permute` is the seeded O(1) permutation behind every order: a keyed Feistel network with
cycle-walking, O(1) memory and time per index even for billions of samples.
"""
from __future__ import annotations

import hashlib
import logging
from typing import Protocol

import fsspec
import numpy as np

from tenax.workers.spec import DataSpec

logger = logging.getLogger(__name__)

SYNTHETIC_NUM_SAMPLES = 1 << 20
SYNTHETIC_MAX_STRIDE = 8
FEISTEL_ROUNDS = 4
DOCUMENT_END_CHECKS = 64  # documents whose last token an indexed source checks on open


def stable_u64(*parts: object) -> int:
    """A 64-bit key from `parts`; hashlib so it is identical in every process (hash() is salted)."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _mix(x: np.ndarray, key: int) -> np.ndarray:
    """splitmix64 finaliser of x ^ key; uint64 arrays wrap on overflow, which is intended."""
    z = x ^ np.uint64(key)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def permute(index: np.ndarray, n: int, seed: int | str, epoch: int) -> np.ndarray:
    """Apply the (seed, epoch) pseudo-random permutation of range(n) to `index` (values < n)."""
    if n == 1:
        return np.zeros_like(index, dtype=np.int64)
    bits = max(2, (n - 1).bit_length())
    bits += bits % 2  # balanced Feistel halves
    half, mask = np.uint64(bits // 2), np.uint64((1 << (bits // 2)) - 1)
    keys = [stable_u64("tenax-order", seed, epoch, r) for r in range(FEISTEL_ROUNDS)]

    def feistel(x: np.ndarray) -> np.ndarray:
        left, right = x >> half, x & mask
        for key in keys:
            left, right = right, left ^ (_mix(right, key) & mask)
        return (left << half) | right

    out = np.asarray(index, dtype=np.uint64)
    with np.errstate(over="ignore"):
        out = feistel(out)
        # Cycle-walking: a bijection on [0, 2^bits) walked until it lands in [0, n) is a
        # bijection on [0, n); 2^bits < 4n, so a few walks suffice on average.
        outside = out >= np.uint64(n)
        while outside.any():
            out[outside] = feistel(out[outside])
            outside = out >= np.uint64(n)
    return out.astype(np.int64)


class TokenSource(Protocol):
    num_samples: int

    def samples(self, ids: np.ndarray) -> np.ndarray:
        """int64 array [len(ids), seq_len + 1] for the given sample ids."""
        ...


class SyntheticSource:
    """Arithmetic progressions mod vocab_size; a pure function of (seed, sample id)."""

    def __init__(self, seq_len: int, vocab_size: int, seed: int) -> None:
        self.seq_len, self.vocab_size, self.seed = seq_len, vocab_size, seed
        self.num_samples = SYNTHETIC_NUM_SAMPLES

    def samples(self, ids: np.ndarray) -> np.ndarray:
        steps = np.arange(self.seq_len + 1, dtype=np.int64)
        rows = []
        for sample_id in ids.tolist():
            rng = np.random.default_rng([self.seed, int(sample_id), 0x7E4A])
            start = int(rng.integers(self.vocab_size))
            stride = int(rng.integers(1, SYNTHETIC_MAX_STRIDE))
            rows.append((start + stride * steps) % self.vocab_size)
        return np.stack(rows)


def check_rows(rows: np.ndarray, ids: np.ndarray, seq_len: int, vocab_size: int, uri: str,
               field: str) -> None:
    """Every row has S+1 tokens inside [0, vocab_size); errors name the sample, not the value."""
    if rows.shape[1] != seq_len + 1:
        raise ValueError(f"{field}: short read from {uri!r}: {rows.shape[1]} tokens per sample "
                         f"instead of {seq_len + 1}")
    bad = ((rows < 0) | (rows >= vocab_size)).any(axis=1)
    if bad.any():
        sample = int(ids[int(np.argmax(bad))])
        raise ValueError(f"{field}: a token id outside [0, model.vocab_size={vocab_size}) in "
                         f"sample {sample} of {uri!r}; was the data tokenized with a larger "
                         f"vocabulary (set model.vocab_size, or data.tokenizer and "
                         f"model.vocab_size: auto)?")


def _num_windows(n_tokens: int, seq_len: int, uri: str, field: str) -> int:
    if n_tokens < seq_len + 1:
        raise ValueError(f"{field}: {uri!r} holds {n_tokens} tokens, too short for one "
                         f"sample of model.seq_len={seq_len} (needs {seq_len + 1})")
    return (n_tokens - 1) // seq_len


class TokenFileSource:
    """A flat little-endian token file read by byte ranges through fsspec."""

    def __init__(self, uri: str, token_dtype: str, seq_len: int, vocab_size: int,
                 field: str = "data.source") -> None:
        self.uri, self.seq_len, self.vocab_size, self.field = uri, seq_len, vocab_size, field
        self.dtype = np.dtype(token_dtype).newbyteorder("<")
        self.fs, self.path = fsspec.core.url_to_fs(uri)
        if not self.fs.isfile(self.path):
            raise FileNotFoundError(f"{field}: token file {uri!r} does not exist")
        size = int(self.fs.size(self.path))
        if size % self.dtype.itemsize:
            raise ValueError(f"{field}: {uri!r} has {size} bytes, not a multiple of "
                             f"{self.dtype.itemsize} (data.token_dtype={token_dtype!r}); "
                             f"wrong dtype?")
        self.n_tokens = size // self.dtype.itemsize
        self.num_samples = _num_windows(self.n_tokens, seq_len, uri, field)
        logger.info("token file %s: %d tokens, %d samples of %d", uri, self.n_tokens,
                    self.num_samples, seq_len)

    def samples(self, ids: np.ndarray) -> np.ndarray:
        item, span = self.dtype.itemsize, self.seq_len + 1
        starts = [int(i) * self.seq_len * item for i in ids.tolist()]
        ends = [s + span * item for s in starts]
        # One ranged read per sample; async filesystems (s3, gcs) fetch them concurrently.
        blobs = self.fs.cat_ranges([self.path] * len(starts), starts, ends, on_error="raise")
        lengths = {len(blob) for blob in blobs}
        if lengths != {span * item}:
            raise ValueError(f"{self.field}: short read from {self.uri!r}: got "
                             f"{min(lengths) // item} tokens for a sample instead of {span}")
        rows = np.frombuffer(b"".join(blobs), dtype=self.dtype).reshape(len(blobs), span)
        rows = rows.astype(np.int64)
        check_rows(rows, ids, self.seq_len, self.vocab_size, self.uri, self.field)
        return rows


class IndexedSource:
    """An indexed dataset (`.bin` + `.idx` prefix): windows over its concatenated documents."""

    def __init__(self, uri: str, seq_len: int, vocab_size: int,
                 field: str = "data.source") -> None:
        from tenax.workers.data.indexed import IndexedDataset

        self.uri, self.seq_len, self.vocab_size, self.field = uri, seq_len, vocab_size, field
        self.dataset = IndexedDataset(uri)
        self.n_tokens = int(self.dataset.num_tokens)
        self.num_samples = _num_windows(self.n_tokens, seq_len, uri, field)
        self.read_document_ends()
        logger.info("indexed dataset %s: %d documents, %d tokens, %d samples of %d", uri,
                    self.dataset.num_docs, self.n_tokens, self.num_samples, seq_len)

    def read_document_ends(self) -> None:
        """The last tokens of the first documents (each an EOS, in prepared data) lie inside
        the vocabulary: data of a larger tokenizer (a byte-level set, EOS 256, under
        model.vocab_size=128) is refused on open, not at the first window that holds one of
        its ids after some steps have already trained on it. They are kept as `document_ends`
        (the document masks check them against the EOS without reading them again)."""
        last = self.document_ends = self.dataset.last_tokens(DOCUMENT_END_CHECKS)
        if ((last < 0) | (last >= self.vocab_size)).any():
            raise ValueError(f"{self.field}: a token id outside [0, model.vocab_size="
                             f"{self.vocab_size}) ends one of the first {DOCUMENT_END_CHECKS} "
                             f"documents of {self.uri!r}; was the data tokenized with a larger "
                             f"vocabulary (set model.vocab_size, or data.tokenizer and "
                             f"model.vocab_size: auto)?")

    def samples(self, ids: np.ndarray) -> np.ndarray:
        spans = [(int(i) * self.seq_len, int(i) * self.seq_len + self.seq_len + 1)
                 for i in ids.tolist()]
        parts = self.dataset.read_ranges(spans)
        if any(len(p) != self.seq_len + 1 for p in parts):
            raise ValueError(f"{self.field}: short read from {self.uri!r}")
        rows = np.stack([np.asarray(p) for p in parts]).astype(np.int64)
        check_rows(rows, ids, self.seq_len, self.vocab_size, self.uri, self.field)
        return rows


def open_uri(uri: str, token_dtype: str, seq_len: int, vocab_size: int, seed: int,
             field: str) -> TokenSource:
    """The source behind one URI: `synthetic`, an indexed dataset prefix, or a flat token file."""
    if uri == "synthetic":
        return SyntheticSource(seq_len, vocab_size, seed)
    from tenax.workers.data.indexed import is_indexed_dataset, strip_suffix

    if is_indexed_dataset(uri):
        return IndexedSource(uri, seq_len, vocab_size, field)
    fs, path = fsspec.core.url_to_fs(uri)
    if not fs.isfile(path):
        prefix = strip_suffix(path)
        halves = [s for s in (".idx", ".bin") if fs.isfile(prefix + s)]
        if halves:  # half an indexed dataset (a copy cut short) is not a flat token file
            missing = ".bin" if halves == [".idx"] else ".idx"
            raise FileNotFoundError(f"{field}: indexed dataset {uri!r} has its {halves[0]} "
                                    f"but no {strip_suffix(uri)}{missing}")
        if fs.isdir(path):
            raise FileNotFoundError(f"{field}: {uri!r} is a directory; give the prefix of an "
                                    f"indexed dataset (PREFIX.bin + PREFIX.idx) or a token file")
    return TokenFileSource(uri, token_dtype, seq_len, vocab_size, field)


def open_source(data_spec: DataSpec, seq_len: int, vocab_size: int, seed: int) -> TokenSource:
    """The single `data.source` of a spec (blends open their sources in blend.py)."""
    return open_uri(data_spec.source, data_spec.token_dtype, seq_len, vocab_size, seed,
                    "data.source")
