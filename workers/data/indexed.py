"""Megatron-LM's indexed dataset (MMIDIDX): `PREFIX.bin` holds tokens, `PREFIX.idx` the index.

Why this format: corpora prepared for Megatron-LM (and NeMo, GPT-NeoX, ...) train here
unchanged, and what `tenax data prepare` writes trains there.

Layout of `.idx`, all little-endian:
    9 bytes   magic b"MMIDIDX\\x00\\x00"
    <Q        version, 1
    <B        dtype code of the tokens in .bin (DTYPE_CODES)
    <Q        S, the number of sequences
    <Q        D, the number of entries of document_indices (documents + 1)
    S x int32 sequence_lengths, in tokens
    S x int64 sequence_pointers, byte offsets of each sequence in .bin
    D x int64 document_indices: document d is sequences [di[d], di[d+1]); di[0] = 0, di[-1] = S
`.bin` is the sequences' tokens back to back, nothing else. A prepared document is one
sequence (its tokens, then EOS). Multimodal Megatron indices may end with S int8 sequence
modes; they are accepted and ignored.

The `.idx` is read whole (it is small); `.bin` only by byte ranges, because it may be terabytes
on object storage.
"""
from __future__ import annotations

import logging
import posixpath
import struct
import uuid
from typing import Any, Iterable

import fsspec
import numpy as np

logger = logging.getLogger(__name__)

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32),
    5: np.dtype(np.int64), 6: np.dtype(np.float64), 7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
CODE_OF = {dtype: code for code, dtype in DTYPE_CODES.items()}
UINT16_VOCAB = 1 << 16
MAX_SEQUENCE_TOKENS = (1 << 31) - 1


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else int32."""
    return np.dtype(np.uint16) if vocab_size <= UINT16_VOCAB else np.dtype(np.int32)


def strip_suffix(prefix: str) -> str:
    """A prefix given with its `.bin` or `.idx` suffix means the dataset itself."""
    for suffix in (".bin", ".idx"):
        if prefix.endswith(suffix):
            return prefix[: -len(suffix)]
    return prefix


def is_indexed_dataset(uri: str) -> bool:
    """True when both `uri.idx` and `uri.bin` exist (`uri` is the prefix)."""
    fs, path = fsspec.core.url_to_fs(strip_suffix(uri))
    return bool(fs.isfile(path + ".idx") and fs.isfile(path + ".bin"))


class IndexedDataset:
    """A Megatron indexed dataset opened for reading; validated against its files on open."""

    def __init__(self, prefix: str) -> None:
        self.prefix = strip_suffix(prefix)
        self.fs, path = fsspec.core.url_to_fs(self.prefix)
        self.idx_path, self.bin_path = path + ".idx", path + ".bin"
        self.idx_uri, self.bin_uri = self.prefix + ".idx", self.prefix + ".bin"
        for p, uri in ((self.idx_path, self.idx_uri), (self.bin_path, self.bin_uri)):
            if not self.fs.isfile(p):
                raise FileNotFoundError(f"indexed dataset {self.prefix!r}: {uri!r} does not exist")
        self.parse_index(self.fs.cat_file(self.idx_path))
        self.check_bin_size()
        logger.info("indexed dataset %s: %d documents, %d sequences, %d tokens (%s)",
                    self.prefix, self.num_docs, self.num_sequences, self.num_tokens, self.dtype)

    def parse_index(self, raw: bytes) -> None:
        where = self.idx_uri
        if len(raw) < HEADER.size:
            raise ValueError(f"{where!r}: truncated index, {len(raw)} bytes, shorter than the "
                             f"{HEADER.size}-byte header")
        magic, version, code, n_seq, n_doc = HEADER.unpack_from(raw)
        if magic != MAGIC:
            raise ValueError(f"{where!r}: not a Megatron indexed dataset index (magic {magic!r}, "
                             f"expected {MAGIC!r})")
        if version != VERSION:
            raise ValueError(f"{where!r}: index version {version}, only {VERSION} is supported")
        dtype = DTYPE_CODES.get(code)
        if dtype is None or dtype.kind not in "iu":
            raise ValueError(f"{where!r}: dtype code {code} is not an integer token type "
                             f"(integer codes: 1-5, 8)")
        want = HEADER.size + n_seq * (4 + 8) + n_doc * 8
        if len(raw) not in (want, want + n_seq):
            raise ValueError(f"{where!r}: index has {len(raw)} bytes but its header "
                             f"({n_seq} sequences, {n_doc} document indices) needs {want}"
                             f"{'; truncated' if len(raw) < want else ''}")
        off = HEADER.size
        self.sequence_lengths = np.frombuffer(raw, "<i4", n_seq, off).astype(np.int32)
        off += 4 * n_seq
        pointers = np.frombuffer(raw, "<i8", n_seq, off).astype(np.int64)
        off += 8 * n_seq
        self.document_indices = np.frombuffer(raw, "<i8", n_doc, off).astype(np.int64)
        self.dtype = dtype.newbyteorder("<")
        self.itemsize = self.dtype.itemsize
        self.check_index(pointers)
        self.sequence_offsets = pointers // self.itemsize
        self.num_sequences, self.num_docs = int(n_seq), int(n_doc) - 1
        self.num_tokens = int(self.sequence_lengths.sum(dtype=np.int64))

    def check_index(self, pointers: np.ndarray) -> None:
        where, lengths = self.idx_uri, self.sequence_lengths
        if (lengths < 0).any():
            i = int(np.argmax(lengths < 0))
            raise ValueError(f"{where!r}: sequence {i} has negative length {lengths[i]}")
        expected = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.itemsize, out=expected[1:])
        if (pointers != expected).any():
            i = int(np.argmax(pointers != expected))
            raise ValueError(f"{where!r}: sequence {i} starts at byte {pointers[i]} but the "
                             f"lengths before it put it at byte {expected[i]}")
        docs = self.document_indices
        if len(docs) < 1 or docs[0] != 0 or docs[-1] != len(lengths) \
                or (np.diff(docs) < 0).any():
            first = int(docs[0]) if len(docs) else None
            last = int(docs[-1]) if len(docs) else None
            raise ValueError(f"{where!r}: document indices must rise from 0 to the sequence "
                             f"count {len(lengths)}, got first {first} and last {last}")

    def check_bin_size(self) -> None:
        size = int(self.fs.size(self.bin_path))
        want = self.num_tokens * self.itemsize
        if size != want:
            what = "shorter" if size < want else "longer"
            raise ValueError(f"{self.bin_uri!r} has {size} bytes, {what} than its index "
                             f"{self.idx_uri!r} says ({self.num_tokens} tokens x "
                             f"{self.itemsize} bytes = {want})")

    def __len__(self) -> int:
        return self.num_sequences

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.prefix!r}, documents={self.num_docs}, "
                f"tokens={self.num_tokens}, dtype={self.dtype.name})")

    @property
    def document_token_offsets(self) -> np.ndarray:
        """Token offset where each document starts, plus the total: int64 [num_docs + 1]."""
        starts = np.append(self.sequence_offsets, np.int64(self.num_tokens))
        return starts[self.document_indices]

    def check_span(self, start: int, stop: int) -> None:
        if not 0 <= start <= stop <= self.num_tokens:
            raise ValueError(f"indexed dataset {self.prefix!r}: token range [{start}, {stop}) is "
                             f"outside [0, {self.num_tokens})")

    def read_ranges(self, spans: list[tuple[int, int]]) -> list[np.ndarray]:
        """int64 tokens of each [start, stop) of the concatenated stream, in one batched read."""
        if not spans:
            return []
        for start, stop in spans:
            self.check_span(int(start), int(stop))
        starts = [int(a) * self.itemsize for a, _ in spans]
        ends = [int(b) * self.itemsize for _, b in spans]
        # Async filesystems (s3, gcs) fetch all ranges concurrently.
        blobs = self.fs.cat_ranges([self.bin_path] * len(spans), starts, ends, on_error="raise")
        out = []
        for (start, stop), blob in zip(spans, blobs):
            if len(blob) != (stop - start) * self.itemsize:
                raise ValueError(f"{self.bin_uri!r}: short read of tokens [{start}, {stop}): "
                                 f"{len(blob)} bytes")
            out.append(np.frombuffer(blob, dtype=self.dtype).astype(np.int64))
        return out

    def last_tokens(self, documents: int) -> np.ndarray:
        """int64 last token of each of the first `documents` non-empty documents (their EOS,
        in data `tenax data prepare` wrote), in one batched read."""
        offsets = self.document_token_offsets[: documents + 1]
        ends = [int(end) for start, end in zip(offsets[:-1], offsets[1:]) if end > start]
        parts = self.read_ranges([(end - 1, end) for end in ends])
        return np.array([int(p[0]) for p in parts], dtype=np.int64)

    def read_tokens(self, start: int, stop: int) -> np.ndarray:
        """int64 tokens [start, stop) of the concatenated stream (may span sequences)."""
        return self.read_ranges([(start, stop)])[0]

    def sequence(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_sequences:
            raise IndexError(f"sequence {i} is outside [0, {self.num_sequences})")
        start = int(self.sequence_offsets[i])
        return self.read_tokens(start, start + int(self.sequence_lengths[i]))

    def document(self, d: int) -> np.ndarray:
        """int64 tokens of document d (all its sequences)."""
        if not 0 <= d < self.num_docs:
            raise IndexError(f"document {d} is outside [0, {self.num_docs})")
        offsets = self.document_token_offsets
        return self.read_tokens(int(offsets[d]), int(offsets[d + 1]))


def write_index(f: Any, dtype: np.dtype, lengths: np.ndarray, doc_indices: np.ndarray) -> None:
    """The `.idx` bytes for `lengths` (int32 per sequence) and `doc_indices` (int64, D + 1)."""
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(lengths), dtype="<i8")
    np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=pointers[1:])
    f.write(HEADER.pack(MAGIC, VERSION, CODE_OF[np.dtype(dtype)], len(lengths), len(doc_indices)))
    f.write(np.asarray(lengths, dtype="<i4").tobytes())
    f.write(pointers.tobytes())
    f.write(np.asarray(doc_indices, dtype="<i8").tobytes())


def missing_dirs(fs: Any, directory: str) -> list[str]:
    """`directory` and those of its parents that do not exist yet, deepest first."""
    out = []
    while directory and directory != posixpath.dirname(directory) and not fs.exists(directory):
        out.append(directory)
        directory = posixpath.dirname(directory)
    return out


class IndexedDatasetWriter:
    """Write `prefix.bin` / `prefix.idx`; one sequence per document.

    Output goes to temporary names that `finalize` renames into place, so a reader never sees a
    half-written dataset; `abort` (or leaving the `with` block on an exception) removes it.
    """

    def __init__(self, prefix: str, dtype: Any) -> None:
        self.prefix = strip_suffix(prefix)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        if np.dtype(dtype) not in CODE_OF or self.dtype.kind not in "iu":
            raise ValueError(f"indexed dataset dtype {np.dtype(dtype).name!r} is not an integer "
                             f"type of the format")
        self.max_id = int(np.iinfo(self.dtype).max)
        self.fs, self.path = fsspec.core.url_to_fs(self.prefix)
        tag = uuid.uuid4().hex[:8]
        self.tmp_bin, self.tmp_idx = f"{self.path}.bin.tmp-{tag}", f"{self.path}.idx.tmp-{tag}"
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self.made_dirs: list[str] = []  # directories this writer created, deepest first
        self.bin: Any = None
        self.lengths: list[np.ndarray] = []
        self.num_docs = self.num_tokens = 0
        self.closed = False
        self.stats: dict[str, Any] = {}
        try:  # an interrupt (Ctrl-C, SIGTERM) landing here has no writer to abort yet
            if "file" in protocols:
                self.made_dirs = missing_dirs(self.fs, posixpath.dirname(self.path))
                self.fs.makedirs(posixpath.dirname(self.path), exist_ok=True)
            self.bin = self.fs.open(self.tmp_bin, "wb")
        except BaseException:
            self.abort()
            raise

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()
        elif not self.closed:
            self.finalize()

    def check_ids(self, tokens: np.ndarray) -> None:
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > self.max_id):
            bad = int(tokens.min()) if int(tokens.min()) < 0 else int(tokens.max())
            raise ValueError(f"indexed dataset {self.prefix!r}: token id {bad} does not fit "
                             f"dtype {self.dtype.name} (ids 0..{self.max_id})")

    def add_packed(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents given back to back: `tokens` split by `lengths` (one per doc)."""
        if self.closed:
            raise ValueError(f"indexed dataset {self.prefix!r}: writer is already closed")
        tokens, lengths = np.asarray(tokens), np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != tokens.size:
            raise ValueError(f"add_packed: lengths sum to {int(lengths.sum())} but {tokens.size} "
                             f"tokens were given")
        if lengths.size and int(lengths.max()) > MAX_SEQUENCE_TOKENS:
            raise ValueError(f"indexed dataset {self.prefix!r}: a document of "
                             f"{int(lengths.max())} tokens exceeds the format's int32 length")
        if tokens.dtype != self.dtype:
            self.check_ids(tokens)
            tokens = tokens.astype(self.dtype)
        self.bin.write(tokens.tobytes())
        self.lengths.append(lengths.astype(np.int32))
        self.num_docs += int(lengths.size)
        self.num_tokens += int(tokens.size)

    def add_document(self, ids: Iterable[int]) -> None:
        tokens = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, dtype=np.int64)
        self.add_packed(tokens, np.array([tokens.size], dtype=np.int64))

    def add_documents(self, docs: Iterable[Iterable[int]]) -> None:
        for ids in docs:
            self.add_document(ids)

    def finalize(self) -> dict[str, Any]:
        """Write the index, rename both files into place; returns {prefix, documents, tokens,
        dtype, bytes} (bytes: .bin plus .idx)."""
        try:
            self.bin.close()
            lengths = (np.concatenate(self.lengths) if self.lengths
                       else np.zeros(0, dtype=np.int32))
            docs = np.arange(len(lengths) + 1, dtype=np.int64)
            with self.fs.open(self.tmp_idx, "wb") as f:
                write_index(f, self.dtype, lengths, docs)
            self.fs.mv(self.tmp_bin, self.path + ".bin")
            self.fs.mv(self.tmp_idx, self.path + ".idx")
        except BaseException:
            self.abort()
            raise
        self.closed = True
        idx_bytes = HEADER.size + 12 * len(lengths) + 8 * (len(lengths) + 1)
        self.stats = {"prefix": self.prefix, "documents": self.num_docs,
                      "tokens": self.num_tokens, "dtype": self.dtype.name,
                      "bytes": self.num_tokens * self.dtype.itemsize + idx_bytes}
        return dict(self.stats)

    def abort(self) -> None:
        """Remove whatever this writer wrote; the final names are never touched."""
        self.closed = True
        try:
            if self.bin is not None:
                self.bin.close()
        except Exception:  # closing a broken stream must not hide the original error
            logger.debug("closing %s failed during abort", self.tmp_bin, exc_info=True)
        for path in (self.tmp_bin, self.tmp_idx):
            try:
                if self.fs.exists(path):
                    self.fs.rm(path)
            except OSError:
                logger.warning("could not remove partial output %s", path)
        for directory in self.made_dirs:  # --out into a new directory leaves none behind
            try:
                self.fs.rmdir(directory)
            except OSError:  # not empty: someone else wrote there meanwhile
                break
