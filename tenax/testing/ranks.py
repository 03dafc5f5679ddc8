"""Run a function on N gloo ranks in fresh processes on 127.0.0.1 and collect the results.

Used instead of mp.spawn so that a rank that dies or hangs fails the caller with the rank's
traceback instead of blocking: every wait has a deadline.
"""
from __future__ import annotations

import io
import logging
import os
import traceback
from multiprocessing.context import ForkServerContext, ForkServerProcess
from typing import Any, Callable

from tenax.workers.rendezvous import free_port, join_process_group, leave_process_group

logger = logging.getLogger(__name__)

# Imported once by the forkserver, then inherited by every rank it forks: a spawned rank spent
# 2-4 s of CPU importing torch, hundreds of times per test-suite run on 2 cores.
PRELOAD = ["torch", "torch.distributed", "tenax.testing.ranks", "tenax.workers.launch",
           "tenax.workers.trainer", "tenax.parallel.parallel_model", "tenax.checkpoint.manager"]


class CallerEnvProcess(ForkServerProcess):
    """A process forked by the forkserver inherits the forkserver's environment, taken when it
    started; a spawned one got its parent's at the call. Callers set variables per test, so
    carry the caller's environment at construction and restore it before the target runs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.caller_environ = dict(os.environ)

    def run(self) -> None:
        os.environ.clear()
        os.environ.update(self.caller_environ)
        super().run()


class RankContext(ForkServerContext):
    Process = CallerEnvProcess


_RANK_CONTEXT = RankContext()


def preload_in_ranks(*modules: str) -> None:
    """Have the forkserver import `modules` as well (the modules that define the functions the
    ranks run, and what those import). Call it before the first rank starts: a forkserver
    already running keeps what it preloaded."""
    PRELOAD.extend(m for m in modules if m not in PRELOAD)


def rank_context() -> RankContext:
    """Where ranks come from: a forkserver with torch preloaded (started on first use and kept
    for the whole process), whose processes run with their caller's environment."""
    _RANK_CONTEXT.set_forkserver_preload(PRELOAD)
    return _RANK_CONTEXT


def init_gloo(rank: int, world: int, port: int, timeout_s: float = 60.0) -> None:
    import torch

    torch.set_num_threads(1)
    join_process_group(rank, world, "127.0.0.1", port, timeout_s)


def shutdown_gloo() -> None:
    leave_process_group()


def _to_bytes(obj: Any) -> bytes:
    # Tensors through a Queue travel as shared-memory handles that die with the sender.
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _from_bytes(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple,
           queue: Any) -> None:
    try:
        init_gloo(rank, world, port)
        result = fn(rank, world, *args)
        shutdown_gloo()
        queue.put((rank, "ok", _to_bytes(result)))
    except BaseException:  # DCP raises BaseException subclasses; report them all
        queue.put((rank, "error", traceback.format_exc()))


def _collect(queue: Any, world: int, timeout_s: float) -> tuple[dict[int, Any], list[str]]:
    """Results by rank until every rank reported or one failed (then its traceback)."""
    results: dict[int, Any] = {}
    errors: list[str] = []
    for _ in range(world):
        rank, status, payload = queue.get(timeout=timeout_s)
        if status == "ok":
            results[rank] = _from_bytes(payload)
        else:
            errors.append(f"rank {rank}:\n{payload}")
            break
    return results, errors


def run_ranks(fn: Callable[..., Any], world: int, *args: Any,
              timeout_s: float = 240.0) -> list[Any]:
    """fn(rank, world, *args) on every rank; returns results by rank or raises with tracebacks.

    `fn` must be importable by name (a module-level function) from a module the ranks can
    import."""
    ctx = rank_context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args, queue), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    errors: list[str] = []
    try:
        results, errors = _collect(queue, world, timeout_s)
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 1)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world)]
