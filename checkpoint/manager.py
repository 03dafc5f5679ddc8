"""CheckpointManager: save / load / wait / close for one rank, async by default.

Why this shape (see DESIGN.md "Checkpoint storage"):

- A save is planned on the training thread with DCP (`dcp.save` with `DeferredWriter`: the
  plan collectives and dedup of replicated tensors, milliseconds, no bytes written), then the
  bytes are written in the background from a snapshot. Training is blocked for the planning and
  the snapshot only. At most one save is in flight per rank: a new `save` first WAITS for the
  previous one (bounded by its deadline, and counted in the new save's blocked_s, so the
  timings stay true). Waiting rather than skipping keeps every rank's decision identical
  without an extra collective, and every requested step gets a checkpoint; a warning says when
  `checkpoint.every_steps` is shorter than a write.
- Two-phase commit without a process group: every rank writes its shard and then a marker
  file; rank 0's writer waits for all markers, then `Catalog.commit` writes manifest.json last.
  A save is committed iff manifest.json exists. Any failure (a rank raising, a writer killed,
  disk full, storage errors, a deadline) becomes a `checkpoint_failed` event and training goes
  on; the previous committed version stays valid. `checkpoint` events carry true timings:
  total_s is measured when the manifest is written.
- Loading: rank 0 picks `latest_committed()` (damaged versions skipped), broadcasts the
  manifest, every rank checks the model hash, and `dcp.load` with `RawReader` reshards into this
  rank's layout; the data cursor and step (hence the LR schedule) come from the manifest.

Async writer, measured by bench/checkpoint_bench.py (2 ranks on 2 CPU cores; see the table
there and in the issue note). The figure that matters is training time lost per save = blocked
time + extra time of the steps that run while the write is in flight:

    WRITER_MEASUREMENTS (filled from the benchmark run)

`fork` (the default for local filesystems) forks a nice-19 child that writes from a
copy-on-write snapshot: staging costs a fork (page-table copy) instead of a memcpy of the state,
and the low priority keeps the child off the cores the ranks use. `thread` (object stores and
memory://, whose clients do not survive a fork) stages into reused host buffers and writes from
a thread with a lowered OS priority. If the chosen writer cannot start, the save falls back to
thread, then sync, and logs why. memory:// is per-process, so it works with world size 1 only.

No module-level state and no cached process group: the manager uses whatever default group is
current, so after a group is destroyed and re-formed with another world size a new manager (or
a fresh process) works; a manager whose rank/world no longer match the group refuses clearly.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from fsspec.implementations.memory import MemoryFileSystem
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException

from checkpoint.catalog import Catalog, CatalogError, Manifest, spec_hash, version_name
from checkpoint.planning import PlanCache, plan_save, single_process_quiet
from checkpoint.shards import FORMAT, RawReader, ShardError, byte_view
from checkpoint.state import (Stager, StateProvider, StateProviderError, TrainerState,
                              as_state_provider, describe_error)
from checkpoint.storage import Storage, StorageError
from checkpoint.writer import (CommitInfo, Flight, SaveJob, failed_event, fault_for, run_inline,
                               start_fork, start_thread)

logger = logging.getLogger(__name__)

__all__ = ["CheckpointError", "CheckpointManager", "CheckpointTimeoutError", "ModelMismatchError",
           "StateProvider", "TrainerState", "WRITERS"]

WRITERS = ("auto", "fork", "thread", "sync")
_SAVE_ERRORS = (Exception, CheckpointException)  # DCP's exception is a BaseException


class CheckpointError(Exception):
    """A checkpoint cannot be saved or loaded as asked; the message names URI, step, field."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


class CheckpointTimeoutError(CheckpointError):
    """A save did not finish within its deadline."""


class ModelMismatchError(CheckpointError):
    """The checkpoint was written for a different model spec (hash mismatch)."""


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


class CheckpointManager:
    """Save and load one job's checkpoints on one rank (every rank makes its own).

    `state` is a Trainer or a StateProvider. `timeout_s` (default
    fault_tolerance.hang_timeout_s) bounds every wait; `writer` overrides the async choice
    ("auto", "fork", "thread", "sync"); `storage_options` go to fsspec (s3 endpoint, keys).
    """

    def __init__(self, spec: Any, state: Any, rank: int, world: int, *,
                 timeout_s: float | None = None, writer: str = "auto",
                 storage_options: dict[str, Any] | None = None) -> None:
        if writer not in WRITERS:
            raise CheckpointError(f"writer: {writer!r} must be one of {WRITERS}")
        if not 0 <= rank < world:
            raise CheckpointError(f"rank {rank} is outside world size {world}")
        self.spec, self.rank, self.world = spec, rank, world
        try:
            self.state = as_state_provider(state)
        except StateProviderError as exc:
            raise CheckpointError(str(exc)) from None
        self.timeout_s = float(timeout_s or spec.fault_tolerance.hang_timeout_s)
        self.storage = Storage(spec.checkpoint.uri, timeout_s=self.timeout_s,
                               storage_options=storage_options)
        self.catalog = Catalog(self.storage)
        if isinstance(self.storage.fs, MemoryFileSystem) and world > 1:
            raise CheckpointError(f"{self.storage.uri}: memory:// lives in one process and "
                                  f"cannot hold a checkpoint of {world} ranks; use file:// or "
                                  f"an object store")
        self.model_hash = spec_hash(spec.model)
        self.mode = self._pick_writer(writer)
        self._flight: Flight | None = None
        self._plan_cache: PlanCache | None = None
        self._last_attempt: int | None = None
        self._protect: set[int] = set()
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stager = Stager()
        self._fences: list[Any] = []
        self._closed = False

    def _pick_writer(self, writer: str) -> str:
        if writer == "auto":  # thread: measured to lose the least training time (docstring)
            writer = "thread" if self.spec.checkpoint.async_ else "sync"
        if writer == "fork" and not (self.storage.is_local and hasattr(os, "fork")):
            logger.info("%s: fork writer needs a local filesystem; using the thread writer",
                        self.storage.uri)
            writer = "thread"
        return writer

    # ---- events --------------------------------------------------------------------------
    def _record(self, event: dict[str, Any] | None) -> None:
        if event is None or event.get("event") == "checkpoint_written":
            return  # a non-zero rank's own write: rank 0's commit event reports the save
        with self._lock:
            self._events.append(event)
        log = logger.warning if event["event"] == "checkpoint_failed" else logger.info
        log("rank %d: %s", self.rank, event)

    def drain_events(self) -> list[dict[str, Any]]:
        """Events recorded since the last call (finished saves are collected first)."""
        flight = self._flight
        if flight is not None and flight.done():
            self._flight = None
            self._record(flight.event)
        with self._lock:
            out, self._events = self._events, []
        return out

    # ---- checks --------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._closed:
            raise CheckpointError(f"checkpoint manager for {self.storage.uri} is closed")
        if _dist_on():
            if dist.get_world_size() != self.world or dist.get_rank() != self.rank:
                raise CheckpointError(
                    f"process group is rank {dist.get_rank()} of {dist.get_world_size()}, this "
                    f"manager was made for rank {self.rank} of {self.world}; make a new one")
        elif self.world != 1:
            raise CheckpointError(f"world size {self.world} needs an initialized process group")

    def _agree(self, ok: bool) -> bool:
        """True only if every rank says ok (one tiny all-reduce)."""
        if not _dist_on():
            return ok
        device = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend() == "nccl" else torch.device("cpu")
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    # ---- save ----------------------------------------------------------------------------
    def save(self, step: int) -> None:
        """Checkpoint the current state as `step` (collective: every rank calls it).

        Returns once the state is snapshotted; failures become `checkpoint_failed` events.
        """
        self._check_usable()
        if step != self.state.step:
            raise CheckpointError(f"save(step={step}) but the trainer has taken "
                                  f"{self.state.step} optimizer steps; they must match")
        if step in self._protect or step == self._last_attempt:
            # every rank decides alike: the same steps were attempted/resumed everywhere
            logger.info("step %d was already saved or resumed from; not saving it again", step)
            return
        self._last_attempt = step
        started, started_wall = time.monotonic(), time.time()
        self._finish_previous()
        self._drop_fences()
        if not self._agree(self._begin(step)):
            if self.rank != 0:
                self._record(failed_event(step, "rank 0 could not start the version", self.rank))
            return
        planned = self._plan(step, started, started_wall)
        if planned is not None:
            self._flight = self._launch(*planned)  # a sync save's flight is already done

    def _finish_previous(self, warn: bool = True) -> None:
        if self._flight is None:
            return
        t0 = time.monotonic()
        try:
            self.wait()
        except CheckpointTimeoutError as exc:
            self._record(failed_event(self._flight.step, str(exc), self.rank))
            self._flight.abandon()  # a late writer must not commit, nor share our buffers
            self._flight = None
            self._stager = Stager()
        waited = time.monotonic() - t0
        if warn and waited > 0.01:
            logger.warning("save waited %.2fs for the previous one: checkpoint.every_steps=%d "
                           "is shorter than a write", waited, self.spec.checkpoint.every_steps)

    def _begin(self, step: int) -> bool:
        if self.rank != 0:
            return True
        try:
            self.catalog.begin(step, replace_committed=True)
            return True
        except (StorageError, CatalogError) as exc:
            self._record(failed_event(step, f"{type(exc).__name__}: {exc}", self.rank))
            return False

    def _plan(self, step: int, started: float,
              started_wall: float) -> tuple[SaveJob, list] | None:
        try:
            planned, self._plan_cache = plan_save(self.state, self.rank, self._plan_cache,
                                                  self._agree)
        except _SAVE_ERRORS as exc:
            self._plan_cache = None
            self._record(failed_event(step, f"planning failed: {describe_error(exc)}",
                                      self.rank))
            return None
        job = SaveJob(self.storage, step, self.rank, self.world, started, self.timeout_s,
                      self.mode, file=planned.file, nbytes=planned.nbytes,
                      metadata_bytes=planned.metadata_bytes,
                      commit=self._commit_info() if self.rank == 0 else None,
                      started_wall=started_wall)
        return job, planned.tensors

    def _commit_info(self) -> CommitInfo:
        d, ck = self.state.describe(), self.spec.checkpoint
        return CommitInfo(layout=d["layout"], model_hash=self.model_hash,
                          data_cursor=d["data_cursor"], seed=d["seed"], lr_step=self.state.step,
                          keep_last=ck.keep_last, keep_every=ck.keep_every,
                          protect=tuple(sorted(self._protect)),
                          extra={"format": FORMAT, "parallel": d.get("parallel", {}),
                                 "job": self.spec.name})

    def _launch(self, job: SaveJob, tensors: list[tuple[int, torch.Tensor]]) -> Flight:
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
                job.pieces = self._stager.stage(tensors) if copy else \
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
        staging, reached = self._stager.shared(tensors), threading.Event()
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
                self._stager = Stager()  # a late copy keeps the old buffers to itself
            job.fence_wait_s = time.monotonic() - t0

        self._fences.append(self.state.fence_before_update(fence))
        job.blocked_s = time.monotonic() - job.started_at
        return start_thread(job, stage)

    def _drop_fences(self) -> None:
        # outside optimizer.step(): removing a hook while it runs would mutate its dict
        for handle in self._fences:
            handle.remove()
        self._fences = []

    def in_flight(self) -> bool:
        """True while this rank's last save is still being written (or committed, on rank 0)."""
        return self._flight is not None and not self._flight.done()

    def wait(self, timeout_s: float | None = None) -> dict[str, Any] | None:
        """Block until the in-flight save is committed (rank 0) / written, or failed.

        Returns its event (None when nothing was in flight); raises CheckpointTimeoutError
        after `timeout_s` (default: the save's own deadline plus a grace period).
        """
        flight = self._flight
        if flight is None:
            return None
        limit = time.monotonic() + timeout_s if timeout_s is not None \
            else flight.deadline + min(self.timeout_s, 30.0)
        if not flight.wait(limit - time.monotonic()):
            raise CheckpointTimeoutError(
                f"save of step {flight.step} to {self.storage.uri} ({flight.mode} writer) did "
                f"not finish in time on rank {self.rank}")
        self._flight = None
        self._record(flight.event)
        return flight.event

    def close(self) -> None:
        """Wait for the in-flight save (failures are recorded, not raised); idempotent."""
        if self._closed:
            return
        try:
            self._finish_previous(warn=False)
        finally:
            self._drop_fences()
            self._stager.clear()
            self._closed = True

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- load ----------------------------------------------------------------------------
    def load(self, layout: Any = None) -> int | None:
        """Load the newest intact committed version into this rank's layout (collective).

        Returns its step, or None when nothing is committed. `layout`, if given, must be the
        layout the trainer was built for (a reminder that resharding happens here).
        """
        self._check_usable()
        self._check_layout(layout)
        self._finish_previous(warn=False)
        t0 = time.monotonic()
        manifest = self._choose_version()
        if manifest is None:
            return None
        self._check_manifest(manifest)
        state = self.state.state_for_load()
        version = version_name(manifest.step)
        try:
            with single_process_quiet():
                dcp.load(state, storage_reader=RawReader(self.storage, version),
                         planner=DefaultLoadPlanner(), no_dist=not _dist_on())
        except (CheckpointException, ShardError, StorageError) as exc:
            raise CheckpointError(f"loading {self.storage.url(version)} failed: "
                                  f"{describe_error(exc)}") from None
        self.state.apply_loaded(state, step=manifest.lr_step, data_cursor=manifest.data_cursor)
        self._protect.add(manifest.step)
        self._record({"event": "checkpoint_loaded", "step": manifest.step,
                      "seconds": round(time.monotonic() - t0, 6), "from_layout": manifest.layout,
                      "layout": self.state.describe()["layout"], "world_size": self.world,
                      "from_world_size": manifest.world_size})
        return manifest.step

    def _check_layout(self, layout: Any) -> None:
        if layout is None:
            return
        want = layout.to_dict() if hasattr(layout, "to_dict") else dict(layout)
        have = self.state.describe().get("parallel", {})
        diff = {k: (v, have.get(k)) for k, v in want.items() if k in have and have[k] != v}
        if diff:
            raise CheckpointError(f"load(layout=...) differs from the trainer's layout in "
                                  f"{diff} (asked, built); build the trainer for the new layout")

    def _choose_version(self) -> Manifest | None:
        """Rank 0 picks the newest intact version; every rank gets the same answer or error."""
        payload: list[Any] = [None]
        if self.rank == 0:
            try:
                payload[0] = self.catalog.latest_committed(verify=True)
            except (StorageError, CatalogError) as exc:
                payload[0] = f"cannot list {self.storage.uri}: {type(exc).__name__}: {exc}"
        if _dist_on() and self.world > 1:
            dist.broadcast_object_list(payload, src=0)
        if isinstance(payload[0], str):
            raise CheckpointError(payload[0])
        return payload[0]

    def _check_manifest(self, manifest: Manifest) -> None:
        url = self.storage.url(version_name(manifest.step))
        if manifest.model_hash != self.model_hash:
            raise ModelMismatchError(
                f"checkpoint {url} (step {manifest.step}) was saved for another model: manifest "
                f"model_hash {manifest.model_hash[:16]}..., this job's model spec hashes to "
                f"{self.model_hash[:16]}...; refusing to load (check the job's model section "
                f"or checkpoint.uri)")
        if manifest.extra.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint {url} has format {manifest.extra.get('format')!r}"
                                  f", this Tenax reads {FORMAT!r}")
        if manifest.seed != self.state.describe()["seed"]:
            logger.warning("checkpoint %s was trained with seed %d, this job uses %d: the data "
                           "order will differ from the original run", url, manifest.seed,
                           self.state.describe()["seed"])
