"""The preflight's data row, run in the calling process before any rank starts.

Every source opens (each `open_*` names its field and file on failure), the tokenizer loads,
the first global batches read (rows outside the vocabulary fail naming the file), and a
prefix of every flat token file is scanned for an id >= model.vocab_size, so a bad file fails
here and not hours into the run when its first bad window comes up.
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
    from tenax.workers.data import TokenDataLoader, load_tokenizer

    vocab = spec.model.vocab_size
    expected = f"ids in [0, {vocab})"
    try:
        tokenizer = load_tokenizer(spec.data.tokenizer, spec.data.eos_id) \
            if spec.data.tokenizer else None
        loader = TokenDataLoader.from_job_spec(spec)
        batches = min(steps, MAX_BATCHES)
        gbs = spec.train.global_batch_size
        for step in range(batches):
            loader.rows(step * gbs, gbs)
        scanned = [scan_token_file(uri, spec.data.token_dtype, vocab, field)
                   for field, uri in file_sources(spec)]
    except (ValueError, FileNotFoundError, OSError) as err:
        return Row("data", "unreadable", expected, "fail", str(err))
    what = f"{batches} batches"
    if scanned:
        what += f", {sum(scanned)} tokens scanned in {len(scanned)} file(s)"
    if tokenizer is not None:
        what += f", tokenizer vocab {tokenizer.vocab_size}"
    return Row("data", what, expected, "pass", f"{loader.num_samples} samples")


def file_sources(spec: Any) -> list[tuple[str, str]]:
    """(field, URI) of the flat token files the job reads (not indexed datasets)."""
    from tenax.workers.data import is_indexed_dataset

    data = spec.data
    found = [(f"data.sources[{i}].uri", e.uri) for i, e in enumerate(data.sources or [])]
    if not data.sources and data.source != "synthetic":
        found.append(("data.source", data.source))
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
