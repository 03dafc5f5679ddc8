"""CheckpointManager: save / load / wait / close for one rank, async by default.

Why this shape (DESIGN.md "Checkpoint storage"; USERS.md: stalls, killed runs, false timings):

- save(): DCP plans the save on the training thread (`DeferredWriter` records offsets, writes
  nothing; the plan is reused while shapes do not change; ZeRO-1/2 moments are saved as each
  rank's own pieces instead of being all-gathered — see planning.py, pieces.py). The bytes are
  copied and written in the background. At most one save is in flight per rank: a new save
  first WAITS for the previous one (bounded, and counted in its blocked_s so timings stay true).
  Waiting rather than skipping keeps every rank's decision identical without a collective and
  gives every requested step a checkpoint; a warning says when every_steps is shorter than a
  write.
- Two-phase commit without a process group: each rank writes its shard, then a marker file;
  rank 0's writer waits for all markers, then `Catalog.commit` writes manifest.json last. A
  save is committed iff manifest.json exists. Any failure (a rank raising, a writer killed, disk
  full, storage errors, a deadline) becomes a `checkpoint_failed` event and training goes on;
  the previous committed version stays valid. `checkpoint` events carry true timings: total_s
  ends when the manifest is written; blocked_s is the longest any rank's training was held.
- Events leave when they happen: with a listener (`listen`, what the rank loop uses) a save's
  event is handed over by its writer's thread the moment the commit is written. Polled only
  between steps, a commit that ended while training was blocked in a collective (a peer was
  killed or hangs) or just before this process was killed was never told, though the version
  is on storage. A rank killed between the manifest and the hand-over is the controller's to
  tell: it reports commits it was not told of from the catalog (orchestrator/job/progress.py).
- load(): rank 0 picks `latest_committed()` (damaged versions skipped), broadcasts the
  manifest, every rank checks the model hash, and `dcp.load` with `RawReader` reshards into this
  rank's layout; the data cursor and step (hence the LR schedule) come from the manifest.

Which writer writes a planned save, and how its copy is fenced against training, is
write_launcher.py (chosen by measurement; its docstring has the numbers). memory:// is
per-process (world size 1 only). A writer given up on cannot commit afterwards (writer.py).

No module-level state and no cached process group: the manager uses whatever default group is
current, so after a group is destroyed and re-formed with another world size a new manager works
(a manager whose rank/world no longer match the group refuses clearly). Note: DTensor's dispatch
caches outlive destroy_process_group (tests/ckpt_jobs.py: forget_dtensor_caches).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import torch.distributed as dist
from fsspec.implementations.memory import MemoryFileSystem
from torch.distributed.checkpoint.api import CheckpointException

from tenax.checkpoint.collectives import all_ranks_agree, dist_on
from tenax.checkpoint.config import CheckpointConfig
from tenax.checkpoint.errors import (CatalogError, CheckpointError, CheckpointTimeoutError,
                                     StorageError)
from tenax.checkpoint.format.catalog import Catalog, version_name
from tenax.checkpoint.format.manifest import CommitInfo
from tenax.checkpoint.format.retention_policy import Retention
from tenax.checkpoint.format.storage import Storage
from tenax.checkpoint.load.loading import (check_layout, check_manifest, choose_version, load_into,
                                          load_while_checking, newest_unverified)
from tenax.checkpoint.save.planning import SavePlans
from tenax.checkpoint.save.state import (StateProvider, TrainerState, as_state_provider,
                                         describe_error, manifest_fields)
from tenax.checkpoint.save.writer import Flight, SaveJob, failed_event
from tenax.checkpoint.write_launcher import WRITERS, WriteLauncher, pick_writer

logger = logging.getLogger(__name__)

__all__ = ["CheckpointManager", "StateProvider", "TrainerState", "WRITERS"]

_SAVE_ERRORS = (Exception, CheckpointException)  # DCP's exception is a BaseException


class CheckpointManager:
    """Save and load one job's checkpoints on one rank (every rank makes its own).

    `config` is the job's `CheckpointConfig`; `state` is a Trainer or a StateProvider.
    `timeout_s` (default config.timeout_s) bounds every wait; `writer` overrides the async
    choice ("auto", "fork", "thread", "sync"); `storage_options` go to fsspec (s3 endpoint,
    keys: per run, never part of the config).
    """

    def __init__(self, config: CheckpointConfig, state: Any, rank: int, world: int, *,
                 timeout_s: float | None = None, writer: str = "auto",
                 storage_options: dict[str, Any] | None = None) -> None:
        if writer not in WRITERS:
            raise CheckpointError(f"writer: {writer!r} must be one of {WRITERS}")
        if not 0 <= rank < world:
            raise CheckpointError(f"rank {rank} is outside world size {world}")
        self.config, self.rank, self.world = config, rank, world
        self.state = as_state_provider(state)
        self.timeout_s = float(timeout_s or config.timeout_s)
        self.storage = Storage(config.uri, timeout_s=self.timeout_s,
                               storage_options=storage_options)
        self.catalog = Catalog(self.storage)
        if isinstance(self.storage.fs, MemoryFileSystem) and world > 1:
            raise CheckpointError(f"{self.storage.uri}: memory:// lives in one process and "
                                  f"cannot hold a checkpoint of {world} ranks; use file:// or "
                                  f"an object store")
        self.model_hash = config.model_hash
        self.mode = pick_writer(writer, config, self.storage)
        self.launcher = WriteLauncher(self.mode, self.state, rank, self.timeout_s)
        self._flight: Flight | None = None
        self.plans = SavePlans()  # shared with this rank's in-memory snapshots
        self._last_attempt: int | None = None
        self._protect: set[int] = set()
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._listener: Callable[[dict[str, Any]], None] | None = None
        self._emitting = threading.Lock()  # one listener call at a time, in recording order
        self._closed = False

    # ---- events --------------------------------------------------------------------------
    def _record(self, event: dict[str, Any] | None) -> None:
        if event is None or event.get("event") == "checkpoint_written":
            return  # a non-zero rank's own write: rank 0's commit event reports the save
        log = logger.warning if event["event"] == "checkpoint_failed" else logger.info
        log("rank %d: %s", self.rank, event)
        with self._emitting:
            with self._lock:
                listener = self._listener
                if listener is None:
                    self._events.append(event)
            if listener is not None:
                listener(event)

    def listen(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Hand every event to `listener` as it is recorded, from then on instead of
        `drain_events` (the events recorded before go first). A save's own event comes from
        its writer's thread the moment the save ends: the training thread may be blocked in a
        collective by then, or killed, and would never pass it on (module docstring)."""
        with self._emitting:
            with self._lock:
                self._listener, pending, self._events = listener, self._events, []
            for event in pending:
                listener(event)

    def _collect(self, flight: Flight, instead: dict[str, Any] | None = None) -> None:
        """Record a finished save's event once, whoever sees the end first: its writer's
        thread (`Flight.when_done`), `wait`, `drain_events` or a timed-out wait (`instead`:
        the failure recorded for a save given up on; should it still commit, the commit is
        recorded too, since the version then exists)."""
        with self._lock:
            event = flight.event if flight.done() else None
            if flight.told == "event" or (flight.told == "instead" and (
                    event is None or event.get("event") != "checkpoint")):
                return
            flight.told = "event" if event is not None else "instead"
        self._record(event if event is not None else instead)

    def drain_events(self) -> list[dict[str, Any]]:
        """Events recorded since the last call (finished saves are collected first); always
        empty once a listener takes them (`listen`)."""
        flight = self._flight
        if flight is not None and flight.done():
            self._flight = None
            self._collect(flight)
        with self._lock:
            out, self._events = self._events, []
        return out

    # ---- checks --------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._closed:
            raise CheckpointError(f"checkpoint manager for {self.storage.uri} is closed")
        if dist_on():
            if dist.get_world_size() != self.world or dist.get_rank() != self.rank:
                raise CheckpointError(
                    f"process group is rank {dist.get_rank()} of {dist.get_world_size()}, this "
                    f"manager was made for rank {self.rank} of {self.world}; make a new one")
        elif self.world != 1:
            raise CheckpointError(f"world size {self.world} needs an initialized process group")

    def _agree(self, ok: bool) -> bool:
        return all_ranks_agree(ok)

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
        self.launcher.drop_fences()
        if not self._agree(self._begin(step)):
            if self.rank != 0:
                self._record(failed_event(step, "rank 0 could not start the version", self.rank))
            return
        planned = self._plan(step, started, started_wall)
        if planned is not None:
            self._flight = self.launcher.launch(*planned)  # a sync save's is already done
            self._flight.when_done(self._collect)

    def _finish_previous(self, warn: bool = True) -> None:
        if self._flight is None:
            return
        t0 = time.monotonic()
        try:
            self.wait()
        except CheckpointTimeoutError as exc:
            flight = self._flight
            if not flight.abandon(self.timeout_s):  # it is publishing: let it finish
                flight.wait(self.timeout_s)
            self._collect(flight, failed_event(flight.step, str(exc), self.rank))
            self._flight = None
            self.launcher.renew_stager()  # a late writer must not share our buffers
        waited = time.monotonic() - t0
        if warn and waited > 0.01:
            logger.warning("save waited %.2fs for the previous one: checkpoint.every_steps=%d "
                           "is shorter than a write", waited, self.config.every_steps)

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
            planned = self.plans.plan(self.state, self.rank, self._agree)
        except _SAVE_ERRORS as exc:
            self._record(failed_event(step, f"planning failed: {describe_error(exc)}",
                                      self.rank))
            return None
        job = SaveJob(self.storage, step, self.rank, self.world, started, self.timeout_s,
                      self.mode, file=planned.file, nbytes=planned.nbytes,
                      metadata_bytes=planned.metadata_bytes, started_wall=started_wall)
        if self.rank == 0:  # the save's coordinator commits it and applies retention
            job.commit = CommitInfo(step=step, world_size=self.world, **manifest_fields(
                self.state, self.config.job, self.model_hash))
            job.retention = Retention(self.config.keep_last, self.config.keep_every,
                                      tuple(sorted(self._protect)))
        return job, planned.tensors

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
        self._collect(flight)
        return flight.event

    def close(self) -> None:
        """Wait for the in-flight save (failures are recorded, not raised); idempotent."""
        if self._closed:
            return
        try:
            self._finish_previous(warn=False)
        finally:
            self.launcher.close()
            self._closed = True

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- load ----------------------------------------------------------------------------
    def load(self, layout: Any = None, source_uri: str | None = None) -> int | None:
        """Load the newest intact committed version into this rank's layout (collective).

        Returns its step, or None when nothing is committed. `layout`, if given, must be the
        layout the trainer was built for (a reminder that resharding happens here).
        `source_uri`: read there instead of checkpoint.uri (an assembled in-memory snapshot,
        the only version there: its check runs beside the load, and when it fails the state
        is partly overwritten and must be loaded again from elsewhere).
        """
        self._check_usable()
        check_layout(layout, self.state.describe().get("parallel", {}))
        self._finish_previous(warn=False)
        t0 = time.monotonic()
        catalog = self.catalog if source_uri is None else \
            Catalog(Storage(source_uri, timeout_s=self.timeout_s))
        manifest = choose_version(catalog, self.rank, self.world) if source_uri is None else \
            newest_unverified(catalog, self.rank, self.world)
        if manifest is None:
            return None
        check_manifest(manifest, catalog.storage.url(version_name(manifest.step)), self.model_hash,
                       self.state.describe()["seed"])
        state = self.state.state_for_load()
        if source_uri is None:
            load_into(catalog, manifest, state)
        else:
            load_while_checking(catalog, manifest, state, self.rank, self.world)
        self.state.apply_loaded(state, step=manifest.lr_step, data_cursor=manifest.data_cursor)
        if source_uri is None:  # a snapshot's step may still be missing from storage
            self._protect.add(manifest.step)
        self._record({"event": "checkpoint_loaded", "step": manifest.step,
                      "seconds": round(time.monotonic() - t0, 6), "from_layout": manifest.layout,
                      "layout": self.state.describe()["layout"], "world_size": self.world,
                      "from_world_size": manifest.world_size,
                      "source": "storage" if source_uri is None else "memory"})
        return manifest.step
