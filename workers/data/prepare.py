"""`prepare_dataset`: text corpora -> a Megatron indexed dataset, tokenized in parallel.

Pipeline: the corpus reader (corpus.py) yields batches of documents in input order; a pool of
worker processes tokenizes them (`encode_batch`, then EOS after each document; a document with
no tokens is left out and counted); the writer appends the results in the same order. At most
`2 x workers` batches are in flight, so memory stays bounded whatever the corpus size
(Pool.imap would read the whole input ahead).

Why ProcessPoolExecutor rather than multiprocessing.Pool: a Pool silently replaces a worker
that dies (the OOM killer, a segfault in a native tokenizer) and the result it owed never
comes, so the parent would wait forever; the executor fails the pending futures instead.
Workers ignore SIGINT: Ctrl-C reaches the whole process group, and the parent alone decides
to stop (and removes the partial output), without a traceback from every worker.

Workers are started with forkserver (spawn where it is missing), never fork: the parent may
already hold tokenizer thread pools, which do not survive a fork. Each worker tokenizes on one
thread; the worker count is the parallelism. Because batches depend only on the input, any
worker count writes byte-identical output.
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from itertools import chain
from multiprocessing.connection import wait
from typing import Any, Iterator

import numpy as np

from tenax.workers.data.corpus import DocumentBatch, document_batches, resolve_inputs
from tenax.workers.data.indexed import IndexedDatasetWriter, dtype_for_vocab
from tenax.workers.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

IN_FLIGHT_PER_WORKER = 2
START_METHOD = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
WORKER: dict[str, Any] = {}  # the tokenizer and dtype of this worker process


@dataclass
class Encoded:
    """A batch's written documents' tokens back to back (EOS included) and their lengths;
    `empty`: the indices in the batch of the documents with no tokens, which are not written;
    or, when a token does not fit the dtype, `bad` = (document index in the batch, token id)."""

    tokens: np.ndarray | None
    lengths: np.ndarray
    empty: np.ndarray
    bad: tuple[int, int] | None = None


def encode_bytes(texts: list[str], eos: int, dtype: np.dtype) -> Encoded:
    """The ByteTokenizer's encoding, packed with numpy: no Python list per byte."""
    raw = [t.encode("utf-8") for t in texts]
    sizes = np.fromiter(map(len, raw), dtype=np.int64, count=len(raw))
    lengths = sizes[sizes > 0] + 1
    ends = np.cumsum(lengths)
    flat = np.full(int(ends[-1]) if ends.size else 0, eos, dtype=dtype)
    body = np.ones(flat.size, dtype=bool)
    body[ends - 1] = False  # every position but the EOS after each document
    flat[body] = np.frombuffer(b"".join(raw), dtype=np.uint8)
    return Encoded(flat, lengths, np.flatnonzero(sizes == 0))


def encode_texts(tokenizer: Tokenizer, texts: list[str], dtype: np.dtype) -> Encoded:
    """Tokenize `texts`, append EOS to each, pack them into one array of `dtype`. A document
    with no tokens is left out (as Megatron's preprocessing does): its EOS alone would be a
    one-token document; `Encoded.empty` says which ones were."""
    eos = int(tokenizer.eos_id)
    if isinstance(tokenizer, ByteTokenizer):
        return encode_bytes(texts, eos, dtype)
    encoded = tokenizer.encode_batch(texts)
    sizes = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    kept = np.flatnonzero(sizes)
    empty = np.flatnonzero(sizes == 0)
    lengths = sizes[kept] + 1
    flat = np.fromiter(chain.from_iterable(chain(ids, (eos,)) for ids in encoded if len(ids)),
                       dtype=np.int64, count=int(lengths.sum()))
    top = int(np.iinfo(dtype).max)
    outside = (flat < 0) | (flat > top)
    if outside.any():
        pos = int(np.argmax(outside))
        doc = int(np.searchsorted(np.cumsum(lengths), pos, side="right"))
        # the index among the written documents, mapped back to the batch's own
        return Encoded(None, lengths, empty, (int(kept[doc]), int(flat[pos])))
    return Encoded(flat.astype(dtype), lengths, empty)


def exit_with_parent(sentinel: int) -> None:
    """Ends this worker when the parent dies (SIGKILL, OOM): an idle executor worker holds
    its own task queue open and would wait on it forever."""
    wait([sentinel])
    os._exit(1)


def init_worker(tokenizer: Tokenizer, dtype: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops the pool on Ctrl-C
    parent = mp.parent_process()
    if parent is not None:
        threading.Thread(target=exit_with_parent, args=(parent.sentinel,), daemon=True,
                         name="exit-with-parent").start()
    # One tokenizer thread per process: parallelism comes from the processes.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    WORKER["tokenizer"], WORKER["dtype"] = tokenizer, np.dtype(dtype)


def encode_in_worker(texts: list[str]) -> Encoded:
    return encode_texts(WORKER["tokenizer"], texts, WORKER["dtype"])


def take_result(window: deque[tuple[DocumentBatch, Future]]) -> tuple[DocumentBatch, Encoded]:
    batch, future = window.popleft()
    try:
        return batch, future.result()
    except BrokenProcessPool:
        raise BrokenProcessPool(
            f"data prepare: a tokenizer worker process died (killed, or out of memory?) while "
            f"tokenizing the documents from {batch.where[0]} on; try fewer --workers") from None


def encode_in_order(batches: Iterator[DocumentBatch], tokenizer: Tokenizer, dtype: np.dtype,
                    workers: int) -> Iterator[tuple[DocumentBatch, Encoded]]:
    """(batch, its tokens) in input order, tokenized by `workers` processes."""
    # The forkserver's preload list is process-wide (a test harness or trainer may own it),
    # so it is left alone: each worker imports this module as it starts.
    context = mp.get_context(START_METHOD)
    window: deque[tuple[DocumentBatch, Future]] = deque()
    with ProcessPoolExecutor(workers, mp_context=context, initializer=init_worker,
                             initargs=(tokenizer, dtype.str)) as pool:
        try:
            for batch in batches:
                window.append((batch, pool.submit(encode_in_worker, batch.texts)))
                if len(window) >= IN_FLIGHT_PER_WORKER * workers:
                    yield take_result(window)
            while window:
                yield take_result(window)
        finally:  # on an error or close(): drop queued batches, so shutdown waits on few
            pool.shutdown(wait=False, cancel_futures=True)


class Meter:
    """Documents, tokens and input MB/s; a rich progress line on stderr when enabled, erased
    when closed (the summary line, or an error, follows it)."""

    def __init__(self, enabled: bool, label: str) -> None:
        self.documents = self.tokens = self.nbytes = 0
        self.start = time.perf_counter()
        self.progress: Any = None
        if enabled:
            from rich.console import Console
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            console = Console(stderr=True)
            if not console.is_terminal:  # a log file would get only a blank line from it
                return
            self.progress = Progress(SpinnerColumn(), TextColumn(label),
                                     TextColumn("{task.description}"), TimeElapsedColumn(),
                                     console=console, transient=True)
            self.task = self.progress.add_task("starting", total=None)
            self.progress.start()

    def mb_per_s(self) -> float:
        return self.nbytes / 1e6 / max(time.perf_counter() - self.start, 1e-9)

    def add(self, documents: int, tokens: int, nbytes: int) -> None:
        self.documents += documents
        self.tokens += tokens
        self.nbytes += nbytes
        if self.progress is not None:
            self.progress.update(self.task, description=(
                f"{self.documents:,} documents, {self.tokens:,} tokens, "
                f"{self.mb_per_s():.1f} MB/s"))

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


@dataclass
class Skipped:
    """The documents left out for having no tokens: how many, and where the first one was."""

    count: int = 0
    first: str | None = None

    def add(self, batch: DocumentBatch, empty: np.ndarray) -> None:
        if empty.size and self.first is None:
            self.first = batch.where[int(empty[0])]
        self.count += int(empty.size)

    def counted(self) -> str:
        return f"{self.count:,} empty document{'s' if self.count != 1 else ''}"

    def __str__(self) -> str:
        return f"skipped {self.counted()} (no tokens; the first at {self.first})"


def write_batches(results: Iterator[tuple[DocumentBatch, Encoded]],
                  writer: IndexedDatasetWriter, dtype: np.dtype, meter: Meter) -> Skipped:
    """Append each batch's documents to `writer`, in order; returns what was skipped."""
    skipped = Skipped()
    for batch, encoded in results:
        if encoded.bad is not None:
            doc, token = encoded.bad
            raise ValueError(f"{batch.where[doc]}: token id {token} does not fit the "
                             f"dataset dtype {dtype.name} (max {np.iinfo(dtype).max})")
        skipped.add(batch, encoded.empty)
        writer.add_packed(encoded.tokens, encoded.lengths)
        meter.add(len(encoded.lengths), int(encoded.lengths.sum()), batch.nbytes)
    return skipped


def short_list(files: list[Any], shown: int = 3) -> str:
    names = [f.uri for f in files[:shown]]
    return ", ".join(names) + (f" and {len(files) - shown} more" if len(files) > shown else "")


def check_out(out: str) -> None:
    """`out` is a prefix: `dir/` would write `dir.bin` beside the directory, not inside it."""
    if not isinstance(out, str) or not out.strip() or out.endswith("/"):
        raise ValueError(f"--out: {out!r} is not a dataset prefix; name the files, e.g. "
                         f"{(out or 'data/').rstrip('/') + '/train'!r} writes train.bin and "
                         f"train.idx there")


def check_workers(workers: int | None) -> int:
    if workers is None:  # the CPUs this process may run on (taskset, Slurm), not the host's
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else os.cpu_count() or 1
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"--workers: must be a positive integer, got {workers!r}")
    return workers


def resolve_tokenizer(tokenizer: str | Tokenizer | None, eos_id: int | None) -> Tokenizer:
    if tokenizer is None or isinstance(tokenizer, str):
        return load_tokenizer(tokenizer, eos_id)
    if eos_id is not None:
        raise ValueError("prepare_dataset: eos_id goes with a tokenizer file; a tokenizer "
                         "object brings its own eos_id")
    return tokenizer


def no_documents(files: list[Any], skipped: Skipped) -> str:
    """The error for inputs that give no document to write."""
    if not skipped.count:
        return (f"data prepare: the inputs ({short_list(files)}) hold no documents (blank "
                f"jsonl lines are skipped); nothing was written")
    return (f"data prepare: the inputs ({short_list(files)}) hold no documents with tokens: "
            f"{skipped.counted()} skipped (the first at {skipped.first}); nothing was written")


def report(stats: dict[str, Any], skipped: Skipped, mb_per_s: float, progress: bool) -> None:
    """Log the summary line (also on stderr with `progress`), and a warning naming where the
    first empty document was, when some were skipped."""
    if skipped.count:  # once per run, naming a place to look at
        logger.warning("data prepare: %s", skipped)
    summary = (f"prepared {stats['documents']:,} documents, {stats['tokens']:,} tokens "
               f"({stats['dtype']}) into {stats['prefix']}.bin/.idx in {stats['seconds']:.1f} s "
               f"({mb_per_s:.1f} MB/s of input)")
    if skipped.count:
        summary += f"; skipped {skipped.counted()}"
    logger.info(summary)
    if progress:
        print(summary, file=sys.stderr)


def prepare_dataset(inputs: list[str], out: str, tokenizer: str | Tokenizer | None = None,
                    text_field: str = "text", workers: int | None = None,
                    progress: bool = True, eos_id: int | None = None) -> dict[str, Any]:
    """Tokenize `inputs` (.txt, .jsonl, .jsonl.gz, .parquet; paths or fsspec URIs, globs) into
    the indexed dataset `out` (a prefix: `out.bin` + `out.idx`), EOS after every document.

    `tokenizer`: a tokenizer file (see `load_tokenizer`) or object; None -> byte-level tokens.
    `eos_id` (`--eos-id`): the id appended after each document instead of the tokenizer's own
    EOS, for a tokenizer file that names none (not with a tokenizer object).
    Tokens are uint16 when the vocabulary fits, else int32. On any error nothing is left at
    `out`. A document with no tokens (empty text) is not written, only counted. Returns
    {"prefix", "documents", "tokens", "dtype", "bytes" (.bin + .idx), "empty_documents",
    "seconds"}.
    """
    start = time.perf_counter()
    tok = resolve_tokenizer(tokenizer, eos_id)
    check_out(out)
    files = resolve_inputs(inputs)
    count = check_workers(workers)
    dtype = dtype_for_vocab(tok.vocab_size)
    meter = Meter(progress, f"tokenizing with {count} worker{'s' if count > 1 else ''}")
    writer = IndexedDatasetWriter(out, dtype)
    try:
        results = encode_in_order(document_batches(files, text_field), tok, dtype, count)
        with contextlib.closing(results):  # on an error, stops the pool at once
            skipped = write_batches(results, writer, dtype, meter)
        if writer.num_docs == 0:  # an empty dataset is always a mistake (wrong file, glob)
            raise ValueError(no_documents(files, skipped))
        stats = writer.finalize()
    except BaseException:
        writer.abort()
        raise
    finally:
        meter.close()
    stats["empty_documents"] = skipped.count
    stats["seconds"] = time.perf_counter() - start
    report(stats, skipped, meter.mb_per_s(), progress)
    return stats
