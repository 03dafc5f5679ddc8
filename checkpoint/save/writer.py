"""The write phase of a save, wherever it runs: a forked process, a thread, or inline.

A `SaveJob` holds everything one rank must write after DCP planned the save: byte views of its
tensors at planned offsets, and on rank 0 the JSON `.metadata` plus what the manifest needs.
`run_job` writes the rank's shard, then a marker `rank-NNNNN.json` saying it finished (or why
it failed). Rank 0's job then waits for every rank's marker and only then commits through
`Catalog.commit` (manifest last) and applies retention. So the second phase of the two-phase
commit needs no process group: it survives a rank dying mid-write (its marker never appears,
rank 0 gives up at the deadline) and does not interleave with training collectives on gloo.

Runners (chosen by the manager; see its docstring for the measurements behind the choice):
- `start_thread` (the default for `checkpoint.async: true`): a thread whose OS priority is
  lowered (Linux lets a thread have its own nice value) writes from host copies; with a
  `stage` callback it also makes those copies first (the manager's fenced, shared staging).
- `start_fork` (fork_writer.py): fork a child at the same low priority that writes from a
  copy-on-write snapshot of the live tensors (staging costs a fork instead of a memcpy).
  Measured to lose more training time than the thread (every page the next step writes faults
  and is copied); kept as an option and for the benchmark. Local filesystems only: memory:// is
  per-process, and object-store clients hold event loops that do not survive a fork.
- `run_inline`: on the caller's thread (sync saves).

Fault injection for drills and tests (read at write time, never at import): environment
`TENAX_CKPT_FAULT=pause:DIR` makes a writer publish `DIR/writer-r<rank>-s<step>.pid` half-way
through its shard and wait until `DIR/release` exists; `TENAX_CKPT_FAULT=fail` makes it fail as
a full disk would; `TENAX_CKPT_FAULT=stage-late` makes the thread writer start its copy only
once training has reached its next optimizer step (so that step must wait: proves the fence).
`TENAX_CKPT_FAULT_RANKS=0,2` limits any of them to those ranks.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

from tenax.checkpoint.errors import CheckpointWriteError
from tenax.checkpoint.format.catalog import Catalog, version_name
from tenax.checkpoint.format.manifest import METADATA_NAME, CommitInfo, Manifest
from tenax.checkpoint.format.retention_policy import Retention
from tenax.checkpoint.format.storage import MIN_BYTES_PER_S, Storage
from tenax.checkpoint.save.background import WRITER_THREAD, as_background

logger = logging.getLogger(__name__)

WRITE_CHUNK = 8 << 20  # os.write releases the GIL per call; large calls keep Python out of it
WRITER_NICE = 19  # background writers yield the cores to training (the bench's ablation sets 0)
MARKER_FMT = "rank-{:05d}.json"
SYNC_KEY = "sync"  # manifest extra: every rank saved synchronously (blocked_s is then total_s)
FAULT_ENV, FAULT_RANKS_ENV = "TENAX_CKPT_FAULT", "TENAX_CKPT_FAULT_RANKS"


@dataclass
class SaveJob:
    storage: Storage
    step: int
    rank: int
    world: int
    started_at: float  # time.monotonic() when save() was called on this rank
    timeout_s: float  # deadline for writing, waiting for the other ranks and committing
    mode: str
    file: str | None = None
    pieces: list[tuple[int, np.ndarray]] = field(default_factory=list)
    nbytes: int = 0
    metadata_bytes: bytes | None = None
    commit: CommitInfo | None = None  # rank 0: the manifest's fields; timings are added here
    retention: Retention | None = None  # rank 0: what to keep once the commit is written
    blocked_s: float | None = None  # None: a sync save, blocked for its whole duration
    fence_wait_s: float = 0.0  # time training later waited at its optimizer step for staging
    abandoned: threading.Event = field(default_factory=threading.Event)
    # held from the manifest write through retention; abandoning takes it, so a writer given up
    # on can never commit (or run retention) while the next save is being written
    publish_gate: threading.Lock = field(default_factory=threading.Lock)
    started_wall: float = field(default_factory=time.time)  # to find the earliest rank

    @property
    def version(self) -> str:
        return version_name(self.step)

    def deadline(self) -> float:
        # a hang is no progress, not a large checkpoint: allow time for every rank's bytes
        return self.started_at + self.timeout_s + self.nbytes * self.world / MIN_BYTES_PER_S


def failed_event(step: int, cause: str, rank: int) -> dict[str, Any]:
    return {"event": "checkpoint_failed", "step": step, "rank": rank, "cause": cause}


def run_job(job: SaveJob) -> dict[str, Any]:
    """Write this rank's part; on rank 0 also wait for the others and commit. Never raises."""
    t0 = time.monotonic()
    try:
        files = _write_shard(job)
        _check_live(job)
        blocked = None if job.blocked_s is None else job.blocked_s + job.fence_wait_s
        _write_marker(job, {"ok": True, "files": files, "blocked_s": blocked,
                            "write_s": time.monotonic() - t0, "started_wall": job.started_wall})
        if job.commit is None:
            return {"event": "checkpoint_written", "step": job.step, "rank": job.rank,
                    "bytes": job.nbytes, "write_s": time.monotonic() - t0}
        return _commit(job)
    except Exception as exc:  # reported, never raised: a failed save must not stop training
        cause = f"{type(exc).__name__}: {exc}"
        logger.error("checkpoint step %d failed on rank %d: %s", job.step, job.rank, cause)
        write_failure_marker(job, cause)
        if job.commit is not None:
            remove_failed_version(job)
        return failed_event(job.step, cause, job.rank)


def remove_failed_version(job: SaveJob) -> None:
    """Rank 0: delete the failed save's uncommitted directory (best effort).

    Why here: retention removes leftovers only after a successful commit, so a disk that
    stays full would collect one partial version per attempt and never free the space."""
    try:
        if not Catalog(job.storage).delete_uncommitted(job.step):
            return
        logger.warning("removed the partial directory of failed checkpoint step %d at %s",
                       job.step, job.storage.url(job.version))
    except Exception as exc:  # cleanup of a failure must not raise over the failure
        logger.error("could not remove the partial checkpoint step %d at %s: %s", job.step,
                     job.storage.url(job.version), exc)


def _check_live(job: SaveJob) -> None:
    if job.abandoned.is_set():
        raise CheckpointWriteError(f"save of step {job.step} was abandoned (staging or writing "
                                   f"exceeded its deadline); it must not be committed")


def fault_for(job: SaveJob) -> str:
    spec = os.environ.get(FAULT_ENV, "")
    ranks = os.environ.get(FAULT_RANKS_ENV, "")
    if ranks and str(job.rank) not in ranks.split(","):
        return ""
    return spec


def _pause_here(job: SaveJob, spec: str) -> None:
    folder = spec.partition(":")[2]
    marker = os.path.join(folder, f"writer-r{job.rank}-s{job.step}.pid")
    with open(marker + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(marker + ".tmp", marker)
    release = os.path.join(folder, "release")
    while not os.path.exists(release):  # a test kills us here, or releases us
        if time.monotonic() > job.deadline():
            raise CheckpointWriteError(f"paused writer of step {job.step} was never released")
        time.sleep(0.02)


def _write_shard(job: SaveJob) -> dict[str, int]:
    """Write the rank's shard (and rank 0's .metadata); returns {file: size}."""
    fault = fault_for(job)
    if fault == "fail":
        raise OSError(errno.ENOSPC, f"No space left on device (injected by {FAULT_ENV}=fail)")
    files: dict[str, int] = {}
    if job.file is not None:
        rel = f"{job.version}/{job.file}"
        pause = (lambda: _pause_here(job, fault)) if fault.startswith("pause:") else None
        if job.storage.is_local:
            _write_local(job.storage.local_path(rel), job.pieces, job.nbytes, pause)
        else:
            if pause:
                pause()
            job.storage.write_bytes(rel, _assemble(job.pieces, job.nbytes))
        files[job.file] = job.nbytes
    elif fault.startswith("pause:"):
        _pause_here(job, fault)
    if job.metadata_bytes is not None:
        job.storage.write_bytes(f"{job.version}/{METADATA_NAME}", job.metadata_bytes)
        files[METADATA_NAME] = len(job.metadata_bytes)
    return files


def _write_local(path: str, pieces: list[tuple[int, np.ndarray]], nbytes: int,
                 pause: Any) -> None:
    """Plain os.write in large chunks (releases the GIL), then fsync before the marker."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        written = 0
        for offset, view in pieces:
            if offset != written:
                raise CheckpointWriteError(f"{path}: piece at {offset}, expected {written}")
            mv = memoryview(view)
            for start in range(0, len(mv), WRITE_CHUNK):
                if pause is not None and written >= nbytes // 2:
                    pause()
                    pause = None
                written += write_all(fd, mv[start:start + WRITE_CHUNK])
        if pause is not None:
            pause()
        os.fsync(fd)  # shard bytes must be durable before the commit marker names them
    finally:
        os.close(fd)


def write_all(fd: int, data: memoryview) -> int:
    done = 0
    while done < len(data):
        done += os.write(fd, data[done:])
    return done


def _assemble(pieces: list[tuple[int, np.ndarray]], nbytes: int) -> bytes:
    out = bytearray(nbytes)
    for offset, view in pieces:
        out[offset:offset + len(view)] = memoryview(view)
    return bytes(out)


def _write_marker(job: SaveJob, doc: dict[str, Any]) -> None:
    body = json.dumps({"rank": job.rank, "step": job.step, **doc}).encode()
    job.storage.write_bytes(f"{job.version}/{MARKER_FMT.format(job.rank)}", body)


def write_failure_marker(job: SaveJob, cause: str) -> None:
    """Best effort: tell rank 0 now instead of letting it wait out the deadline."""
    try:
        _write_marker(job, {"ok": False, "cause": cause})
    except Exception as exc:
        logger.warning("could not record the failure of step %d on rank %d: %s",
                       job.step, job.rank, exc)


def _wait_for_ranks(job: SaveJob) -> tuple[list[str], float, float]:
    """Poll until every rank's marker is there: (files, max blocked_s, earliest start).

    The earliest start is rank 0's monotonic start moved back by how much earlier (wall
    clock) the first rank entered the save, so total_s covers every rank's part.
    """
    names = {MARKER_FMT.format(r): r for r in range(job.world)}
    seen: dict[int, dict[str, Any]] = {}
    delay = 0.005
    while len(seen) < job.world:
        listed = job.storage.list_files(job.version)
        for name, rank in names.items():
            if rank not in seen and name in listed:
                doc = json.loads(job.storage.read_bytes(f"{job.version}/{name}"))
                if not doc.get("ok"):
                    raise CheckpointWriteError(f"rank {rank} failed: {doc.get('cause')}")
                seen[rank] = doc
        if len(seen) == job.world:
            break
        if time.monotonic() > job.deadline():
            missing = sorted(set(range(job.world)) - set(seen))
            raise CheckpointWriteError(
                f"ranks {missing} did not finish writing {job.storage.url(job.version)} "
                f"within the deadline ({job.timeout_s:.0f}s + size allowance)")
        time.sleep(delay)
        delay = min(delay * 2, 0.25)
    files = [f for doc in seen.values() for f in doc["files"]] + list(names)
    blocked = [doc.get("blocked_s") for doc in seen.values()]
    first = min(doc.get("started_wall", job.started_wall) for doc in seen.values())
    earliest = job.started_at - max(0.0, job.started_wall - first)
    return files, max((b for b in blocked if b is not None), default=-1.0), earliest


def _commit(job: SaveJob) -> dict[str, Any]:
    files, blocked, earliest = _wait_for_ranks(job)
    _check_live(job)
    catalog = Catalog(job.storage)
    sync = blocked < 0  # sync saves block training for their whole duration
    held: list[bool] = []

    def enter_gate() -> None:  # right before the manifest: checksums ran outside the gate
        job.publish_gate.acquire()
        held.append(True)
        _check_live(job)

    info = replace(job.commit, blocked_s=0.0 if sync else blocked, started_at=earliest,
                   extra={**job.commit.extra, "writer": job.mode, SYNC_KEY: sync},
                   expected_files=tuple(files))
    try:
        manifest = catalog.commit(info, before_publish=enter_gate)
        keep = job.retention
        try:
            if keep is not None:
                catalog.apply_retention(keep.keep_last, keep.keep_every, protect=keep.protect,
                                        head=job.step)
        except Exception as exc:  # retention is a chore; its failure is logged, never fatal
            logger.error("retention after step %d failed: %s", job.step, exc)
    finally:
        if held:
            job.publish_gate.release()
    return commit_event(manifest)


def commit_event(manifest: Manifest) -> dict[str, Any]:
    """The `checkpoint` event of a committed version, from its manifest alone: what its writer
    reports and what a controller that learns of the commit from the catalog reports.
    `created_at` names the commit: a step saved again after a recovery is another commit."""
    # every rank saved synchronously: training was blocked for the whole save
    blocked_s = manifest.total_s if manifest.extra.get(SYNC_KEY) else manifest.blocked_s
    return {"event": "checkpoint", "step": manifest.step, "blocked_s": round(blocked_s, 6),
            "total_s": round(manifest.total_s, 6), "bytes": manifest.total_bytes,
            "mode": str(manifest.extra.get("writer", "")), "world_size": manifest.world_size,
            "created_at": manifest.created_at}


# ---- runners -----------------------------------------------------------------------------
class Flight:
    """One save in flight on this rank; `wait` returns its event."""

    def __init__(self, job: SaveJob) -> None:
        self.step, self.mode, self.deadline = job.step, job.mode, job.deadline()
        self._job = job
        self._done = threading.Event()
        self.event: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self._on_done: Callable[["Flight"], None] | None = None
        self.told = ""  # what its manager recorded for it: "", "event" or "instead"

    def abandon(self, timeout_s: float) -> bool:
        """The caller gave up waiting: a writer that wakes up later must not commit.

        False when the writer is publishing its manifest right now (it holds the gate for
        longer than `timeout_s`): the save may still commit, so the caller must wait for it.
        """
        if not self._job.publish_gate.acquire(timeout=max(0.0, timeout_s)):
            return False
        try:
            self._job.abandoned.set()
        finally:
            self._job.publish_gate.release()
        return True

    def finish(self, event: dict[str, Any]) -> None:
        with self._lock:
            self.event = event
            self._done.set()
            call = self._on_done
        if call is None:
            return
        try:  # on the writer's thread, the moment the save ended
            call(self)
        except Exception as exc:  # whoever listens is gone (the rank is ending): log it
            logger.error("checkpoint step %d: telling its end failed: %s: %s", self.step,
                         type(exc).__name__, exc)

    def when_done(self, callback: Callable[["Flight"], None]) -> None:
        """Call `callback(flight)` once the save ended: now if it has, else from `finish`.

        Why: a rank that polls for the end only between its steps never hears of it once it
        is blocked in a collective (a peer died or hangs) or is killed first, though the
        version is committed; told at once, the event leaves the rank right after the commit.
        """
        with self._lock:
            self._on_done = callback
            done = self._done.is_set()
        if done:
            callback(self)

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float) -> bool:
        return self._done.wait(max(0.0, timeout))


def run_inline(job: SaveJob) -> Flight:
    flight = Flight(job)
    flight.finish(run_job(job))
    return flight


def start_thread(job: SaveJob, stage: Callable[[], list] | None = None) -> Flight:
    """Write from a thread at WRITER_NICE; with `stage`, it first fills job.pieces itself."""
    flight = Flight(job)

    def body() -> None:
        as_background(WRITER_THREAD, WRITER_NICE)
        if stage is not None:
            try:
                job.pieces = stage()
            except Exception as exc:
                cause = f"staging failed: {type(exc).__name__}: {exc}"
                write_failure_marker(job, cause)
                flight.finish(failed_event(job.step, cause, job.rank))
                return
        flight.finish(run_job(job))

    threading.Thread(target=body, name=f"ckpt-writer-{job.step}", daemon=True).start()
    return flight
