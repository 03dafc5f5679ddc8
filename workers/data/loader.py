"""Resumable data loader keyed by the global sample index.

Why: a job may be killed, re-planned onto a different layout and resumed, and must then
reproduce the losses of a clean run. So the data order is a pure function of
(seed, global sample index): step k consumes global samples [k*G, (k+1)*G) whatever the dp,
micro-batch or accumulation split, dp rank r takes the contiguous slice [r*G/dp, (r+1)*G/dp), and
the only state is one integer, `samples_consumed`, which means the same thing under any layout.

Order: global index g lies in epoch e = g // num_samples; its sample id is a pseudo-random
permutation of range(num_samples) seeded by (seed, e), evaluated at g % num_samples. The
permutation is a keyed Feistel network with cycle-walking, so it costs O(1) memory and time per
index even for a token file with billions of samples (no shuffled index array to build or store).

Sources:
- "synthetic": sample id i is an arithmetic progression mod vocab_size with a start and a small
  stride drawn from (seed, i): trivially learnable, so the loss visibly drops when training.
- a token-file URI (any fsspec URI): a flat little-endian array of `token_dtype`; sample i is
  tokens[i*S : i*S + S + 1] (inputs the first S, targets shifted by one). Only those byte ranges
  are read, never the whole file, because the file may be terabytes on object storage. Token
  values are checked against vocab_size as they are read.

`prepare_token_file` writes such a file from text: byte-level tokens (UTF-8 bytes, values
0..255), each document followed by an end-of-document token (EOS_ID = 256 by default, which is
why uint8 files can only be written with eos_id=None).
"""
from __future__ import annotations

import codecs
import hashlib
import logging
from typing import Any, Iterator, Protocol

import fsspec
import numpy as np
import torch

from tenax.workers.spec import DataSpec, JobSpec

logger = logging.getLogger(__name__)

SYNTHETIC_NUM_SAMPLES = 1 << 20
SYNTHETIC_MAX_STRIDE = 8
EOS_ID = 256
FEISTEL_ROUNDS = 4
READ_CHUNK_BYTES = 16 << 20
TOKEN_DTYPES = ("uint8", "uint16", "uint32", "int32", "int64")


def _stable_u64(*parts: object) -> int:
    """A 64-bit key from `parts`; hashlib so it is identical in every process (hash() is salted)."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _mix(x: np.ndarray, key: int) -> np.ndarray:
    """splitmix64 finaliser of x ^ key; uint64 arrays wrap on overflow, which is intended."""
    z = x ^ np.uint64(key)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def permute(index: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """Apply the (seed, epoch) pseudo-random permutation of range(n) to `index` (values < n)."""
    if n == 1:
        return np.zeros_like(index, dtype=np.int64)
    bits = max(2, (n - 1).bit_length())
    bits += bits % 2  # balanced Feistel halves
    half, mask = np.uint64(bits // 2), np.uint64((1 << (bits // 2)) - 1)
    keys = [_stable_u64("tenax-order", seed, epoch, r) for r in range(FEISTEL_ROUNDS)]

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


class TokenFileSource:
    """A flat token file read by byte ranges through fsspec."""

    def __init__(self, uri: str, token_dtype: str, seq_len: int, vocab_size: int) -> None:
        self.uri, self.seq_len, self.vocab_size = uri, seq_len, vocab_size
        self.dtype = np.dtype(token_dtype).newbyteorder("<")
        self.fs, self.path = fsspec.core.url_to_fs(uri)
        if not self.fs.isfile(self.path):
            raise FileNotFoundError(f"data.source: token file {uri!r} does not exist")
        size = int(self.fs.size(self.path))
        if size % self.dtype.itemsize:
            raise ValueError(f"data.source: {uri!r} has {size} bytes, not a multiple of "
                             f"{self.dtype.itemsize} (data.token_dtype={token_dtype!r}); wrong dtype?")
        self.n_tokens = size // self.dtype.itemsize
        if self.n_tokens < seq_len + 1:
            raise ValueError(f"data.source: {uri!r} holds {self.n_tokens} tokens, too short for one "
                             f"sample of model.seq_len={seq_len} (needs {seq_len + 1})")
        self.num_samples = (self.n_tokens - 1) // seq_len
        logger.info("token file %s: %d tokens, %d samples of %d", uri, self.n_tokens,
                    self.num_samples, seq_len)

    def samples(self, ids: np.ndarray) -> np.ndarray:
        item, span = self.dtype.itemsize, self.seq_len + 1
        starts = [int(i) * self.seq_len * item for i in ids.tolist()]
        ends = [s + span * item for s in starts]
        # One ranged read per sample; async filesystems (s3, gcs) fetch them concurrently.
        blobs = self.fs.cat_ranges([self.path] * len(starts), starts, ends, on_error="raise")
        rows = [np.frombuffer(blob, dtype=self.dtype).astype(np.int64) for blob in blobs]
        for sample_id, row in zip(ids.tolist(), rows):
            self._check(int(sample_id), row)
        return np.stack(rows)

    def _check(self, sample_id: int, row: np.ndarray) -> None:
        if row.shape[0] != self.seq_len + 1:
            raise ValueError(f"data.source: short read from {self.uri!r} for sample {sample_id}: "
                             f"{row.shape[0]} tokens instead of {self.seq_len + 1}")
        bad = (row < 0) | (row >= self.vocab_size)
        if bad.any():
            pos = int(np.argmax(bad))
            raise ValueError(
                f"data.source: {self.uri!r} token {row[pos]} at index "
                f"{sample_id * self.seq_len + pos} is outside [0, model.vocab_size={self.vocab_size})")


def open_source(data_spec: DataSpec, seq_len: int, vocab_size: int, seed: int) -> TokenSource:
    if data_spec.source == "synthetic":
        return SyntheticSource(seq_len, vocab_size, seed)
    return TokenFileSource(data_spec.source, data_spec.token_dtype, seq_len, vocab_size)


class TokenDataLoader:
    """Global batches by step, sliced per dp rank; the cursor is `samples_consumed` (global)."""

    def __init__(self, data_spec: DataSpec, seq_len: int, vocab_size: int, seed: int,
                 global_batch_size: int) -> None:
        if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) \
                or global_batch_size < 1:
            raise ValueError(f"train.global_batch_size: must be a positive integer, "
                             f"got {global_batch_size!r}")
        self.seq_len, self.seed, self.global_batch_size = seq_len, seed, global_batch_size
        self.source = open_source(data_spec, seq_len, vocab_size, seed)
        self.samples_consumed = 0

    @classmethod
    def from_job_spec(cls, spec: JobSpec) -> "TokenDataLoader":
        return cls(spec.data, spec.model.seq_len, spec.model.vocab_size, spec.train.seed,
                   spec.train.global_batch_size)

    @property
    def num_samples(self) -> int:
        return self.source.num_samples

    def sample_ids(self, start: int, count: int) -> np.ndarray:
        """Sample ids of global indices [start, start + count): a pure function of (seed, index)."""
        n = self.source.num_samples
        index = np.arange(start, start + count, dtype=np.int64)
        epochs, offsets = index // n, index % n
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs).tolist():
            sel = epochs == epoch
            out[sel] = permute(offsets[sel], n, self.seed, int(epoch))
        return out

    def _slice(self, dp_rank: int, dp_size: int) -> tuple[int, int]:
        g = self.global_batch_size
        if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
            raise ValueError(f"dp_size: must be a positive integer, got {dp_size!r}")
        if g % dp_size:
            raise ValueError(f"dp_size: {dp_size} does not divide train.global_batch_size={g}")
        if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank: {dp_rank!r} is outside [0, dp_size={dp_size})")
        per_rank = g // dp_size
        return dp_rank * per_rank, per_rank

    def batch_at(self, first_sample: int, dp_rank: int,
                 dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of the global batch starting at global sample `first_sample`."""
        if first_sample < 0:
            raise ValueError(f"first_sample: must be >= 0, got {first_sample}")
        offset, count = self._slice(dp_rank, dp_size)
        rows = self.source.samples(self.sample_ids(first_sample + offset, count))
        tokens = torch.from_numpy(rows)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def batch(self, step: int, dp_rank: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each LongTensor [G/dp, S], for global samples [step*G, (step+1)*G)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step: must be a non-negative integer, got {step!r}")
        return self.batch_at(step * self.global_batch_size, dp_rank, dp_size)

    def next_batch(self, dp_rank: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch at the cursor; advances the cursor by one global batch (all ranks alike)."""
        out = self.batch_at(self.samples_consumed, dp_rank, dp_size)
        self.samples_consumed += self.global_batch_size
        return out

    def state_dict(self) -> dict[str, int]:
        return {"samples_consumed": self.samples_consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the cursor; valid under any dp size since it counts global samples."""
        value = state.get("samples_consumed") if isinstance(state, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"loader state samples_consumed: expected a non-negative integer, "
                             f"got {value!r}")
        self.samples_consumed = int(value)


def _text_chunks(fs: Any, path: str, uri: str) -> Iterator[bytes]:
    """Yield the raw bytes of a UTF-8 text file in chunks, failing clearly on invalid UTF-8."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(READ_CHUNK_BYTES):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as err:
                raise ValueError(f"prepare_token_file: {uri!r} is not valid UTF-8 near byte "
                                 f"{offset + err.start}") from None
            offset += len(chunk)
            yield chunk
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise ValueError(f"prepare_token_file: {uri!r} ends inside a UTF-8 character") from None


def _open_texts(text_uris: list[str]) -> list[tuple[Any, str, str]]:
    """Resolve every input before writing anything, so a typo fails fast with no partial output."""
    if not text_uris:
        raise ValueError("prepare_token_file: text_uris is empty; give at least one text file")
    resolved = []
    for uri in text_uris:
        fs, path = fsspec.core.url_to_fs(uri)
        if not fs.isfile(path):
            raise FileNotFoundError(f"prepare_token_file: text file {uri!r} does not exist")
        resolved.append((fs, path, uri))
    return resolved


def _check_token_dtype(token_dtype: str, eos_id: int | None) -> np.dtype:
    if token_dtype not in TOKEN_DTYPES:
        raise ValueError(f"data.token_dtype: {token_dtype!r} is not one of {', '.join(TOKEN_DTYPES)}")
    top = int(np.iinfo(np.dtype(token_dtype)).max)
    if eos_id is not None and not 0 <= eos_id <= top:
        raise ValueError(f"prepare_token_file: eos_id {eos_id} does not fit token_dtype "
                         f"{token_dtype!r} (max {top}); use uint16 or eos_id=None")
    return np.dtype(token_dtype).newbyteorder("<")


def prepare_token_file(text_uris: list[str], out_uri: str, token_dtype: str = "uint16",
                       eos_id: int | None = EOS_ID) -> dict[str, Any]:
    """Write a byte-level token file: each text's UTF-8 bytes (tokens 0..255), then `eos_id`.

    Each URI is one document; `eos_id=None` concatenates documents without a separator. The
    file is little-endian `token_dtype`, the format `TokenFileSource` reads, written in chunks
    so input size is not bounded by memory; on any error the partial output is removed.
    Returns {"uri", "token_dtype", "n_tokens", "n_docs", "bytes"} (bytes = output file size).
    """
    dtype = _check_token_dtype(token_dtype, eos_id)
    texts = _open_texts(text_uris)
    eos = None if eos_id is None else np.array([eos_id], dtype=dtype).tobytes()
    fs, path = fsspec.core.url_to_fs(out_uri)
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    if "file" in protocols:
        fs.makedirs(fs._parent(path), exist_ok=True)
    n_tokens = 0
    try:
        with fs.open(path, "wb") as out:
            for text_fs, text_path, uri in texts:
                for chunk in _text_chunks(text_fs, text_path, uri):
                    out.write(np.frombuffer(chunk, dtype=np.uint8).astype(dtype).tobytes())
                    n_tokens += len(chunk)
                if eos is not None:
                    out.write(eos)
                    n_tokens += 1
    except BaseException:
        if fs.exists(path):
            fs.rm(path)
        raise
    logger.info("prepared token file %s: %d docs, %d tokens", out_uri, len(texts), n_tokens)
    return {"uri": out_uri, "token_dtype": token_dtype, "n_tokens": n_tokens,
            "n_docs": len(texts), "bytes": n_tokens * dtype.itemsize}
