"""WriteLauncher: how one rank's save is written once planned — which writer, started how.

Separate from the manager (manager.py), which decides when a save happens, plans it and
commits or loads versions: this module holds the writer choice and what a write in flight
shares with training (the reused staging buffers and the fence hook on the optimizer), the
part of a save that was chosen by measurement and that differs per writer.

The async writer was chosen by measurement (bench/checkpoint_bench.py: 310 MB of model+AdamW
state, dp2 ZeRO-1, 2 ranks on 2 CPU cores shared with other jobs (load 4-8), medians of 5 saves
per writer, interleaved; lost = blocked + extra time of the steps that ran during the write):

    writer                            blocked s  ÷ sync  step ÷ steady  lost s/save  ÷ sync
    sync                                  0.450   1.000          -            0.450   1.00
    thread, shared copy (default)         0.019   0.041        1.05           0.094   0.21
    thread, copy on training thread       0.052   0.117        1.00           0.089   0.20
    thread, shared copy, not niced        0.011   0.024        1.38           0.188   0.42
    fork, copy-on-write snapshot          0.071   0.158        1.50           0.516   1.15
    DCP async_save (thread executor)      0.464   1.031        1.38           0.744   1.66

Single saves vary up to 10x on this host; an 11-save A/B of the first two thread rows gave
lost median/mean 0.019/0.22 s (shared copy) vs 0.38/0.31 s (copy on the training thread),
sync 0.36/0.37 s. What the numbers say:
- A write that competes for the cores slows every rank, since synchronous training waits for
  the slowest: the writer thread runs at nice 19 (Linux nice is per thread), which halves the
  loss. DCP's thread pickles tensors under the GIL at full priority.
- fork looked cheap (no memcpy), but every page the next step writes then faults and is copied
  (1.5x steps): it loses more than sync here. It stays available as writer="fork".
- The copy (155 MB per rank, 40-100 ms here) is what a blocking stage costs. The default
  starts it in the low-priority writer thread, which mostly gets idle cycles (ranks waiting in
  collectives); the state cannot change before the next optimizer.step(), so a hook there
  makes the training thread finish whatever is left at full speed, then wait for copies in
  flight (`TrainerState.fence_before_update`). Training is rarely blocked at all; at worst it
  finishes the copy itself at the fence, as a blocking stage would. A fence wait counts in
  blocked_s.
- GPU tensors are staged to reused pinned buffers on the training thread (not measured here).
If a writer cannot start the save falls back to thread, then sync, and logs why.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import torch

from tenax.checkpoint.config import CheckpointConfig
from tenax.checkpoint.errors import CheckpointTimeoutError
from tenax.checkpoint.format.storage import Storage
from tenax.checkpoint.save.fork_writer import start_fork
from tenax.checkpoint.save.state import Stager, StateProvider, describe_error
from tenax.checkpoint.save.writer import (Flight, SaveJob, failed_event, fault_for, run_inline,
                                          start_thread)
from tenax.checkpoint.tensor_bytes import byte_view

logger = logging.getLogger(__name__)

__all__ = ["WRITERS", "WriteLauncher", "pick_writer"]

WRITERS = ("auto", "fork", "thread", "sync")


def pick_writer(writer: str, config: CheckpointConfig, storage: Storage) -> str:
    """The writer a save uses: `writer` ("auto" resolved by config.async_save), or thread where
    fork cannot serve `storage`."""
    if writer == "auto":  # thread: measured to lose the least training time (docstring)
        writer = "thread" if config.async_save else "sync"
    if writer == "fork" and not (storage.is_local and hasattr(os, "fork")):
        logger.info("%s: fork writer needs a local filesystem; using the thread writer",
                    storage.uri)
        writer = "thread"
    return writer


class WriteLauncher:
    """Starts one rank's planned saves with writer `mode` (one of `WRITERS` but "auto").

    It owns what a write shares with training: `stager`, the reused staging buffers, and the
    fence hooks put on `state` (removed by `drop_fences`, outside optimizer.step()).
    """

    def __init__(self, mode: str, state: StateProvider, rank: int, timeout_s: float) -> None:
        self.mode, self.state, self.rank, self.timeout_s = mode, state, rank, timeout_s
        self.stager = Stager()
        self._fences: list[Any] = []

    def renew_stager(self) -> None:
        """Fresh staging buffers: a write given up on keeps the old ones to itself."""
        self.stager = Stager()

    def launch(self, job: SaveJob, tensors: list[tuple[int, torch.Tensor]]) -> Flight:
        """Start the write with the chosen writer, falling back to thread, then sync."""
        order = [self.mode] + [m for m in ("thread", "sync") if m != self.mode]
        cause = ""
        for mode in order[order.index(self.mode):]:
            job.mode = mode
            try:
                # thread: a copy the writer owns; fork: the child's copy-on-write view; GPU
                # tensors always go through (pinned) host buffers first
                on_gpu = any(t.is_cuda for _, t in tensors)
                if mode == "thread" and not on_gpu and hasattr(self.state,
                                                               "fence_before_update"):
                    return self._start_fenced(job, tensors)
                copy = mode == "thread" or on_gpu
                job.pieces = self.stager.stage(tensors) if copy else \
                    [(o, byte_view(t)) for o, t in tensors]
                if mode == "sync":
                    job.blocked_s = None
                    return run_inline(job)
                if mode == "thread":
                    job.blocked_s = time.monotonic() - job.started_at
                    return start_thread(job)
                return start_fork(job)
            except Exception as exc:
                cause = describe_error(exc)
                logger.warning("checkpoint step %d: %s writer could not start (%s); "
                               "falling back", job.step, mode, cause)
        flight = Flight(job)
        flight.finish(failed_event(job.step, f"no writer could start: {cause}", self.rank))
        return flight

    def _start_fenced(self, job: SaveJob, tensors: list[tuple[int, torch.Tensor]]) -> Flight:
        """Copy the state for the writer without blocking training for the copy.

        The low-priority writer thread copies while the next step runs; at that step's
        optimizer call (the first moment the state changes) the training thread copies
        whatever is left itself and waits for copies in progress. That wait is added to the
        save's blocked_s. If it exceeds timeout_s the save is abandoned (never committed) and
        training goes on.
        """
        staging, reached = self.stager.shared(tensors), threading.Event()
        late = fault_for(job) == "stage-late"  # drills: copy only once training is at the fence

        def stage() -> list:
            if late:
                reached.wait(self.timeout_s)
            staging.help()
            if not staging.wait(self.timeout_s):
                raise CheckpointTimeoutError(f"staging step {job.step} did not finish")
            return staging.pieces()

        def fence() -> None:
            if reached.is_set():  # one wait per save; the hook is removed at the next save
                return
            reached.set()
            t0 = time.monotonic()
            staging.help()
            if not staging.wait(self.timeout_s) or staging.error:
                logger.error("staging step %d failed or took over %.0fs (%s); abandoning that "
                             "save", job.step, self.timeout_s, staging.error or "timeout")
                job.abandoned.set()
                self.renew_stager()  # a late copy keeps the old buffers to itself
            job.fence_wait_s = time.monotonic() - t0

        self._fences.append(self.state.fence_before_update(fence))
        job.blocked_s = time.monotonic() - job.started_at
        return start_thread(job, stage)

    def drop_fences(self) -> None:
        # outside optimizer.step(): removing a hook while it runs would mutate its dict
        for handle in self._fences:
            handle.remove()
        self._fences = []

    def close(self) -> None:
        """Remove the fence hooks and free the staging buffers."""
        self.drop_fences()
        self.stager.clear()
