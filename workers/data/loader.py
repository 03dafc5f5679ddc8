"""Resumable data loader keyed by the global sample index.

Why: a job may be killed, re-planned onto a different layout and resumed, and must then
reproduce the losses of a clean run. So the data order is a pure function of
(seed, global sample index): step k consumes global samples [k*G, (k+1)*G) whatever the dp,
micro-batch or accumulation split, dp rank r takes the contiguous slice [r*G/dp, (r+1)*G/dp), and
the only state is one integer, `samples_consumed`, which means the same thing under any layout.

Order of one source (`data.source`): global index g lies in epoch e = g // num_samples; its
sample id is the seeded permutation (`permute`, sources.py) of range(num_samples) for (seed, e),
evaluated at g % num_samples. A blend (`data.sources`) first assigns each global index a source
and an index within that source (blend.py), then applies that source's own permutation.

Sources (sources.py): "synthetic", a flat token file, an indexed dataset prefix; sample i of a
source is tokens [i*S : i*S + S + 1] of its concatenated stream.

`prepare_token_file` writes a flat token file from text: byte-level tokens (UTF-8 bytes, values
0..255), each document followed by an end-of-document token (EOS_ID = 256 by default, which is
why uint8 files can only be written with eos_id=None).
"""
from __future__ import annotations

import codecs
import logging
from typing import Any, Iterator

import fsspec
import numpy as np
import torch

from tenax.workers.data.blend import BlendedSource, source_order
from tenax.workers.data.documents import check_document_ends
from tenax.workers.data.sources import TokenSource, open_source, open_uri
from tenax.workers.spec import DataSpec, JobSpec

logger = logging.getLogger(__name__)

EOS_ID = 256
READ_CHUNK_BYTES = 16 << 20
TOKEN_DTYPES = ("uint8", "uint16", "uint32", "int32", "int64")


def open_blend(data_spec: DataSpec, seq_len: int, vocab_size: int, seed: int) -> BlendedSource:
    """The sources of `data.sources`, each opened (and checked) before anything trains."""
    entries = data_spec.sources or []
    sources = [open_uri(e.uri, data_spec.token_dtype, seq_len, vocab_size, seed,
                        f"data.sources[{i}].uri") for i, e in enumerate(entries)]
    return BlendedSource(sources, [e.uri for e in entries], [e.weight for e in entries], seed)


class TokenDataLoader:
    """Global batches by step, sliced per dp rank; the cursor is `samples_consumed` (global)."""

    def __init__(self, data_spec: DataSpec, seq_len: int, vocab_size: int, seed: int,
                 global_batch_size: int) -> None:
        if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) \
                or global_batch_size < 1:
            raise ValueError(f"train.global_batch_size: must be a positive integer, "
                             f"got {global_batch_size!r}")
        self.seq_len, self.seed, self.global_batch_size = seq_len, seed, global_batch_size
        self.blend: BlendedSource | None = None
        self.source: TokenSource | None = None
        if data_spec.sources:
            self.blend = open_blend(data_spec, seq_len, vocab_size, seed)
        else:
            self.source = open_source(data_spec, seq_len, vocab_size, seed)
        # A wrong EOS would make document masks and EOS loss masking silent no-ops.
        check_document_ends(data_spec, self.blend.sources if self.blend is not None
                            else [self.source])
        self.samples_consumed = 0

    @classmethod
    def from_job_spec(cls, spec: JobSpec) -> "TokenDataLoader":
        return cls(spec.data, spec.model.seq_len, spec.model.vocab_size, spec.train.seed,
                   spec.train.global_batch_size)

    @property
    def num_samples(self) -> int:
        """Samples of one epoch (of a blend: of all its sources together)."""
        return self.blend.num_samples if self.blend is not None else self.source.num_samples

    def sample_ids(self, start: int, count: int) -> np.ndarray:
        """Sample ids of global indices [start, start + count) of a single `data.source`."""
        if self.source is None:
            raise ValueError("sample_ids: this loader reads a blend (data.sources); use "
                             "loader.blend.sample_ids, which also names the source")
        return source_order(np.arange(start, start + count, dtype=np.int64),
                            self.source.num_samples, self.seed)

    def rows(self, start: int, count: int) -> np.ndarray:
        """int64 [count, seq_len + 1]: the windows of global indices [start, start + count)."""
        if self.blend is not None:
            return self.blend.rows(np.arange(start, start + count, dtype=np.int64))
        return self.source.samples(self.sample_ids(start, count))

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
        tokens = torch.from_numpy(self.rows(first_sample + offset, count))
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
        raise ValueError(f"data.token_dtype: {token_dtype!r} is not one of "
                         f"{', '.join(TOKEN_DTYPES)}")
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
