"""MemorySnapshotter: every step, this rank's training state into host memory its agent owns.

What a snapshot holds is exactly what a storage checkpoint of the same step would: the shard
file DCP planned for this rank (ZeRO-1/2 moments as the rank's own pieces), rank 0's JSON
`.metadata`, and what the manifest needs (layout, data cursor, seed, LR step). So recovery
assembles the pieces into an ordinary version directory and loads it through the same
resharding path as storage (checkpoint/memory/restore.py) — one implementation, not two.

Off the critical path: `snapshot(step)` only plans (the plan and its views of the live tensors
are reused while the state's identity holds, checkpoint/save/planning.py; one tiny all-reduce
confirms it on every rank, with the step and whether the last replica went) and hands the copy
to this rank's low-priority copying thread, which writes the live tensors into its kept
mapping of the tmpfs file (buffer_maps.py) and checksums them chunk by chunk. The state
changes only inside the next `optimizer.step()`, so a hook there (`fence_before_update`)
waits for the copy if it is still running; training otherwise never waits. A state in device
memory is first copied on a side stream into a pinned host buffer (device_staging.py): there
the fence makes the device, not the host, wait for that copy, and a snapshot whose
predecessor is still being written to tmpfs is skipped by every rank (its vote is part of
the plan's all-reduce) rather than waited for, since the buffer is reused. The
`.partial`/stamp protocol of snapshot_store.py makes a copy killed half-way
invisible. `on_done(event)` is called from the copying thread once the snapshot is complete
(the agent then replicates it to a peer).

A full tmpfs turns snapshots off, never kills training: buffers are allocated before they are
written (buffer_maps.reserve), so no space is an ENOSPC, not a SIGBUS. The rank that meets it
says so at its next snapshot, where every rank skips; one more tiny all-reduce, taken only
after a skipped snapshot, tells every rank, and from then on no rank takes any (local ones
included: the collective calls must stay the same on every rank). `on_done` is then given one
`snapshots_off` event naming the directory and its free bytes.
"""
from __future__ import annotations

import errno
import logging
import os
import queue
import shutil
import threading
import time
from typing import Any, Callable

import numpy as np
import torch

from tenax.checkpoint.config import CheckpointConfig
from tenax.checkpoint.format.manifest import METADATA_NAME
from tenax.checkpoint.memory.buffer_maps import BufferMaps
from tenax.checkpoint.memory.device_staging import DeviceStaging, on_device
from tenax.checkpoint.memory.snapshot_store import (SnapshotDir, SnapshotStamp, crc32c_of,
                                                    overwrite)
from tenax.checkpoint.memory.snapshot_base import few_inodes
from tenax.checkpoint.memory.tmpfs_tree import free_space, write_private
from tenax.checkpoint.save.background import SNAPSHOT_THREAD, as_background
from tenax.checkpoint.save.planning import SavePlans
from tenax.checkpoint.save.state import manifest_fields
from tenax.checkpoint.save.writer import WRITER_NICE
from tenax.checkpoint.tensor_bytes import byte_view
from tenax.parallel import human_bytes

logger = logging.getLogger(__name__)

FENCE_TIMEOUT_S = 120.0
# Each piece is copied and then checksummed in chunks that fit a core's cache, so the checksum
# reads them from cache instead of memory (18 MiB: 4.8 ms as two passes, 3.8 ms chunked).
COPY_CHUNK = 256 << 10
# A staged (device) state is copied from its pinned buffer in larger chunks: each chunk hands
# the GIL back and forth with the training thread, whose kernel launches wait for it (256 KiB
# chunks slowed a Python-bound thread by 7.5%, 8 MiB ones by 1%, on this project's CPU host),
# and a GPU node's idle cores do not need the cache-sized chunks' saving.
STAGED_COPY_CHUNK = 8 << 20


class MemorySnapshotter:
    """One rank's per-step snapshots into `SnapshotDir(root)` (series g<generation>-r<rank>)."""

    def __init__(self, config: CheckpointConfig, state: Any, rank: int, world: int, root: str,
                 generation: int, agree: Callable[[bool], bool],
                 on_done: Callable[[dict[str, Any]], None] | None = None,
                 replicated: bool = False, plans: SavePlans | None = None,
                 off: str | None = None) -> None:
        """`plans`: the storage checkpoints' plan of the same state (the manager's `plans`),
        so that whichever of the two saves first after a (re)start plans for both. `off`:
        why this rank can take no snapshot from the start (its agent could not make its
        directory); it still takes part in each snapshot's agreement, which stops every rank."""
        self.config, self.state, self.rank, self.world = config, state, rank, world
        self.store, self.generation = SnapshotDir(root), generation
        self.agree, self.on_done, self.replicated = agree, on_done, replicated
        self.model_hash = config.model_hash
        self.skipped = 0
        self.plans = plans or SavePlans()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._worker: threading.Thread | None = None  # one copying thread, started once
        self._finished: threading.Event | None = None  # the snapshot in flight is done
        self._fence: Any = None
        self.failed = 0
        self._newest: int | None = None  # the last step this process published
        self.off: str | None = off  # why this rank can take no more snapshots (no space)
        self.stopped = False  # every rank agreed that snapshots are off: none is taken
        # The double buffer's mappings, kept between snapshots (checkpoint/memory/buffer_maps.py)
        self._maps = BufferMaps(limit=self.store.keep + 1)
        self.staging = DeviceStaging()  # used once a plan holds device tensors

    def _copy_busy(self) -> bool:
        """Whether a device state's last snapshot is still being copied (then this one is
        skipped instead of waited for: the staging buffer is still being read)."""
        return (self.staging.active and self._finished is not None
                and not self._finished.is_set())

    def snapshot(self, step: int) -> None:
        """Start the snapshot of the current state as `step` (collective: every rank calls it)."""
        busy = self._copy_busy()
        if not busy:  # a busy copy keeps its fence: the state must not change before it lands
            self.wait()
            self._drop_fence()
        if self.stopped:
            return
        # Whether the replica caught up, whether this rank still has room and whether its last
        # copy is done is agreed in the plan's own all-reduce (one per step)
        caught_up = self._replica_caught_up() if self.replicated else True
        ready = caught_up and self.off is None and not busy
        try:
            planned = self.plans.plan(self.state, self.rank, self.agree, ready)
        except Exception as exc:  # a snapshot is an optimisation: never stop training for it
            self.failed += 1
            logger.warning("rank %d: snapshot of step %d not planned: %s", self.rank, step, exc)
            return
        if planned is None:
            if not self._agreed_off(step):
                self._skipped(step, busy, caught_up)
            return
        staged = on_device(planned.tensors)
        try:
            tensors = self.staging.stage(planned.tensors) if staged else planned.tensors
        except Exception as exc:  # e.g. no pinned memory for the buffer: training goes on
            self.failed += 1
            logger.warning("rank %d: snapshot of step %d not staged: %s", self.rank, step, exc)
            return
        commit = manifest_fields(self.state, self.config.job, self.model_hash)
        try:
            partial = self.store.begin(self.generation, self.rank, step)
        except OSError as exc:  # a tmpfs out of inodes fails mkdir, not the copy: ENOSPC too
            self._not_begun(step, exc)
            return
        done, self._finished = threading.Event(), threading.Event()
        if hasattr(self.state, "fence_before_update"):
            at_fence = self.staging.fence if staged else lambda: self._at_fence(done)
            self._fence = self.state.fence_before_update(at_fence)
        if self._worker is None:  # starting a thread per step cost 1-15 ms of this thread
            self._worker = threading.Thread(target=self._serve, daemon=True,
                                            name=SNAPSHOT_THREAD)
            self._worker.start()
        self._jobs.put((step, partial, planned.file, tensors, planned.metadata_bytes, commit,
                        staged, done, self._finished))

    def _skipped(self, step: int, busy: bool, caught_up: bool) -> None:
        self.skipped += 1  # every rank skips alike: their newest steps stay the same
        why = ("this rank's last snapshot is still being copied" if busy else
               "its replica is still on its way" if not caught_up else
               "another rank is not ready (a copy or a replica still on its way)")
        logger.info("rank %d: snapshot of step %d skipped: %s", self.rank, step, why)

    def _agreed_off(self, step: int) -> bool:
        """After a skipped snapshot (every rank skipped alike, so every rank asks): whether
        any rank is out of space. If so every rank stops taking snapshots from now on."""
        if self.agree(self.off is None):
            return False
        self.stopped = True
        where, free = free_space(self.store.root)
        reason = (f"{self.off or 'another rank found no space for its snapshot'}; "
                  f"{where or self.store.root} has {human_bytes(max(free, 0))} free; "
                  f"in-memory snapshots off from step {step} (storage checkpoints only)")
        logger.warning("rank %d: %s", self.rank, reason)
        if self.on_done is not None:
            self.on_done({"event": "snapshots_off", "step": step, "reason": reason,
                          "dir": where or self.store.root, "free_bytes": free})
        return True

    def _not_begun(self, step: int, exc: OSError) -> None:
        """No directory for this snapshot: like a failed copy, never an error of training
        (the plan's all-reduce is behind every rank; nothing collective follows the copy)."""
        self.failed += 1
        if exc.errno == errno.ENOSPC:
            partial = os.path.join(self.store.series(self.generation, self.rank),
                                   f"s{step}.partial")
            self._out_of_space(partial, exc)
        logger.warning("rank %d: snapshot of step %d not begun: %s", self.rank, step, exc)

    def _out_of_space(self, partial: str, exc: OSError) -> None:
        """A buffer found no space: free what this snapshot took; no more are taken."""
        shutil.rmtree(partial, ignore_errors=True)
        self._maps.forget_deleted()
        where, free = free_space(self.store.root)
        self.off = (f"no space for rank {self.rank}'s snapshot buffer in {where} "
                    f"({human_bytes(max(free, 0))}{few_inodes(where)} free): {exc}")

    def _serve(self) -> None:
        """The copying thread: low priority, one snapshot at a time, until close()."""
        as_background(SNAPSHOT_THREAD, WRITER_NICE)
        while (job := self._jobs.get()) is not None:
            *args, finished = job
            try:
                self._copy(*args)
            finally:
                finished.set()

    def _replica_caught_up(self) -> bool:
        """Whether the agent has sent (or given up on) this rank's newest snapshot.

        Why wait for it: with 2 local buffers and 1 replica, a step is complete across nodes
        only if the replica's step is still held locally by every other rank; taking a new
        snapshot only once the last one reached the peer keeps that true however slow the
        network is (a slow link then costs snapshot frequency, never consistency)."""
        if self._newest is None:  # this process published nothing yet
            return True
        sent = self.store.sent_step(self.generation, self.rank)
        return sent is not None and sent >= self._newest

    def _copy(self, step: int, partial: str, file: str | None,
              tensors: list[tuple[int, torch.Tensor]], metadata: bytes | None,
              commit: dict[str, Any], staged: bool, done: threading.Event) -> None:
        t0 = time.monotonic()
        try:
            if staged:
                self.staging.wait()  # the device's copy has landed in the pinned buffer
            files: dict[str, list[int]] = {}
            if file is not None:
                chunk = STAGED_COPY_CHUNK if staged else COPY_CHUNK
                files[file] = _write_pieces(self._maps, os.path.join(partial, file), tensors,
                                            chunk)
            done.set()  # the live tensors are copied: the optimizer may change them now
            if metadata is not None:
                write_private(os.path.join(partial, METADATA_NAME), metadata)
                files[METADATA_NAME] = [len(metadata), crc32c_of([metadata])]
            stamp = SnapshotStamp(self.generation, self.rank, self.world, step, files, commit)
            self.store.publish(partial, stamp)
            first, self._newest = self._newest is None, step
        except Exception as exc:
            self.failed += 1
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                self._out_of_space(partial, exc)
            logger.warning("rank %d: snapshot of step %d failed: %s", self.rank, step, exc)
            return
        finally:
            done.set()
        if self.on_done is not None:
            self.on_done({"event": "snapshot", "step": step, "generation": self.generation,
                          "bytes": stamp.nbytes, "seconds": round(time.monotonic() - t0, 6),
                          "first": first})  # this process's first: the controller tells it

    def _at_fence(self, done: threading.Event) -> None:
        if not done.wait(FENCE_TIMEOUT_S):
            logger.error("rank %d: snapshot copy still running after %.0fs at the optimizer "
                         "step", self.rank, FENCE_TIMEOUT_S)

    def _drop_fence(self) -> None:
        if self._fence is not None:
            self._fence.remove()
            self._fence = None

    def wait(self, timeout_s: float = FENCE_TIMEOUT_S) -> None:
        """Until the snapshot in flight (if any) is published or failed."""
        if self._finished is not None:
            if not self._finished.wait(timeout_s):
                logger.error("rank %d: snapshot copy still running after %.0fs", self.rank,
                             timeout_s)
            self._finished = None

    def close(self) -> None:
        self.wait()
        self._drop_fence()
        if self._worker is not None:
            self._jobs.put(None)
            self._worker.join(FENCE_TIMEOUT_S)
            self._worker = None
        self._maps.close()
        self.staging.close()


def _write_pieces(maps: BufferMaps, path: str, tensors: list[tuple[int, torch.Tensor]],
                  chunk_bytes: int = COPY_CHUNK) -> list[int]:
    """Copy the tensors' bytes at their planned offsets into the buffer's mapping; returns
    [bytes, crc32c]."""
    sources, size = [], 0
    for offset, tensor in tensors:
        if offset != size:
            raise OSError(f"{path}: piece at {offset}, expected {size}")
        sources.append(byte_view(tensor))
        size += sources[-1].nbytes
    if not size:
        return [overwrite(path, []), 0]
    buffer = np.frombuffer(maps.mapping(path, size), dtype=np.uint8)
    crc, offset = 0, 0
    for source in sources:
        for start in range(0, len(source), chunk_bytes):
            chunk = source[start:start + chunk_bytes]
            target = buffer[offset + start:offset + start + len(chunk)]
            np.copyto(target, chunk)  # releases the GIL, as crc32c does
            crc = crc32c_of([target], crc)
        offset += len(source)
    return [size, crc]
