"""The preflight's data row, run in the calling process before any rank starts.

Every source opens (each `open_*` names its field and file on failure), the tokenizer loads
and its vocabulary fits model.vocab_size, the first global batches read (rows outside the
vocabulary fail naming the file), data.validation opens, holds the windows its evaluations read
and its first batch reads, and a prefix of every flat token file (validation included) is
scanned for an id >= model.vocab_size, so a bad file fails here and not hours into the run when
its first bad window (or the first evaluation) comes up.
"""
from __future__ import annotations

import logging
from typing import Any

from tenax.orchestrator.preflight.rows import Row

logger = logging.getLogger(__name__)

SCAN_BYTES = 64 << 20  # of each flat token file: bounded, so the check stays seconds
MAX_BATCHES = 64  # global batches read through the loader


def data_row(spec: Any, steps: int) -> Row:
    """The data row: pass, or fail naming the field and the file."""
    from tenax.workers.data import TokenDataLoader

    vocab = spec.model.vocab_size
    expected = f"ids in [0, {vocab})"
    try:
        tokenizer_size = check_tokenizer(spec)
        loader = TokenDataLoader.from_job_spec(spec)
        batches = min(steps, MAX_BATCHES)
        gbs = spec.train.global_batch_size
        for step in range(batches):
            loader.rows(step * gbs, gbs)
        windows = check_validation(spec)
        scanned = [scan_token_file(uri, spec.data.token_dtype, vocab, field)
                   for field, uri in file_sources(spec)]
    except (FileNotFoundError, OSError) as err:
        return Row("data", "unreadable", expected, "fail", str(err))
    except ValueError as err:  # it reads, but what it holds is wrong (ids, lengths, sizes)
        return Row("data", "invalid", expected, "fail", str(err))
    what = f"{batches} batches"
    if windows is not None:
        what += f", validation {windows} windows"
    if scanned:
        what += f", {sum(scanned)} tokens scanned in {len(scanned)} file(s)"
    if tokenizer_size is not None:
        what += f", tokenizer vocab {tokenizer_size}"
    return Row("data", what, expected, "pass", f"{loader.num_samples} samples")


def check_tokenizer(spec: Any) -> int | None:
    """The vocabulary size of data.tokenizer (None without one); ValueError naming both
    fields when it holds more tokens than the model's embedding has rows."""
    from tenax.workers.data import load_tokenizer

    uri, vocab = spec.data.tokenizer, spec.model.vocab_size
    if not uri:
        return None
    size = int(load_tokenizer(uri, spec.data.eos_id).vocab_size)
    if size > vocab:
        raise ValueError(f"data.tokenizer: {uri!r} has {size} tokens, more than "
                         f"model.vocab_size={vocab} (set model.vocab_size: auto)")
    return size


def check_validation(spec: Any) -> int | None:
    """data.validation's windows (None without it): it opens, holds the
    `steps * global_batch_size` windows every evaluation reads, and its first batch reads
    inside the vocabulary; ValueError naming data.validation.* otherwise."""
    import numpy as np

    from tenax.workers.data import open_uri

    val, gbs = spec.data.validation, spec.train.global_batch_size
    if val is None:
        return None
    source = open_uri(val.uri, spec.data.token_dtype, spec.model.seq_len, spec.model.vocab_size,
                      spec.train.seed, "data.validation.uri")
    needed = val.steps * gbs
    if source.num_samples < needed:
        raise ValueError(f"data.validation.uri: {val.uri!r} holds {source.num_samples} windows "
                         f"of model.seq_len+1={spec.model.seq_len + 1} tokens, fewer than "
                         f"data.validation.steps={val.steps} * train.global_batch_size={gbs} "
                         f"= {needed}")
    source.samples(np.arange(min(gbs, source.num_samples), dtype=np.int64))
    return int(source.num_samples)


def file_sources(spec: Any) -> list[tuple[str, str]]:
    """(field, URI) of the flat token files the job reads, validation included (not indexed
    datasets)."""
    from tenax.workers.data import is_indexed_dataset

    data = spec.data
    found = [(f"data.sources[{i}].uri", e.uri) for i, e in enumerate(data.sources or [])]
    if not data.sources and data.source != "synthetic":
        found.append(("data.source", data.source))
    if data.validation is not None:
        found.append(("data.validation.uri", data.validation.uri))
    return [(f, u) for f, u in found if u != "synthetic" and not is_indexed_dataset(u)]


def scan_token_file(uri: str, token_dtype: str, vocab_size: int, field: str) -> int:
    """Tokens scanned of the first SCAN_BYTES of `uri`; ValueError naming the file and the
    first offset whose id is outside [0, vocab_size)."""
    import fsspec
    import numpy as np

    dtype = np.dtype(token_dtype).newbyteorder("<")
    with fsspec.open(uri, "rb") as f:
        blob = f.read(SCAN_BYTES - SCAN_BYTES % dtype.itemsize)
    tokens = np.frombuffer(blob[:len(blob) - len(blob) % dtype.itemsize], dtype=dtype)
    bad = np.flatnonzero((tokens < 0) | (tokens >= vocab_size))
    if bad.size:
        at = int(bad[0])
        raise ValueError(f"{field}: token id {int(tokens[at])} at token {at} of {uri!r} is "
                         f"outside [0, model.vocab_size={vocab_size})")
    return int(tokens.size)
