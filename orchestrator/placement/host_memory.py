"""Do a job's in-memory snapshots fit its nodes' host memory? Decided before placement.

Host memory is planned, not discovered: `plan_snapshot_memory` compares the
per-node peak of the in-memory snapshots (parallel/host_memory.py: per rank 2 local buffers +
1 peer replica, all rewritten in place; 2 buffers on a single node) with
the smallest node's memory, as Ray reports it (the node's `memory` resource, in bytes).

SAFE_FRACTION = 0.5: the snapshots may use at most half of a node's Ray `memory`. Why half:
- Ray's `memory` resource is already what Ray offers to tasks and actors (the node's memory
  less the object store, by default 30%, and a reservation for the system), not free RAM.
- The same RAM holds the training processes themselves: on CPU their whole training state
  (weights, grads, optimizer, activations, data loader), on GPU hosts CUDA's pinned staging
  buffers and the async storage writer's copy of a checkpoint — about as large as the
  snapshots, so half of the memory for each is the even split.
- Ray's memory monitor kills workers at 95% of the node's memory, and the kernel's OOM killer
  takes the whole node: a too-tight figure costs a node, a too-loose one only costs the
  snapshots (storage checkpoints still run), so the fraction errs on the safe side and also
  absorbs the cost model's first-order error (even pipeline split, allocator slack).

A job whose snapshots do not fit is never refused and never risks an OOM-killed node: it runs
with in-memory snapshots off (storage checkpoints as before) and the controller says so once,
with this module's reason. The placer calls `plan_snapshot_memory` at placement (every
layout, since the state per rank changes with the layout) with `ray_node_memory_bytes` of the
placement's nodes. When node memory is unknown (Ray did not answer within the timeout, or no
node reports `memory`), nothing is checked and the snapshots stay on; the reason says so.

The snapshots live in tmpfs, which is often smaller than the node's memory (a container's
/dev/shm is 64 MiB by default): `snapshot_tmpfs_room` measures the free space of the snapshot
directory's filesystem (`TENAX_SNAPSHOT_DIR`, else /dev/shm) where the controller runs, plus
what this job's own buffers there already hold (they are rewritten in place), and the plan
turns the snapshots off when the per-node peak does not fit it. That figure is this host's;
on another node a full tmpfs is still caught when a buffer is allocated (ENOSPC: snapshots
off, checkpoint/memory/snapshot.py), never a SIGBUS.

The plan is the one place `checkpoint.memory_every_steps` is read: its `every_steps` (a
snapshot every N steps, 0: none) goes down to the ranks as it is (MemoryStart, RankRun,
MemoryOptions), and nothing below decides again.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Union

from tenax.checkpoint.memory import SNAPSHOT_ENV
from tenax.orchestrator.errors import RayNodesTimeout
from tenax.orchestrator.placement.nodes_reader import NodesReader
from tenax.parallel import ParallelLayout, SnapshotFootprint, human_bytes, snapshot_footprint
from tenax.workers import JobSpec

logger = logging.getLogger(__name__)

SAFE_FRACTION = 0.5
FIELD = "checkpoint.memory_every_steps"
RAY_TIMEOUT_S = 2.0
NodeMemory = Union[Mapping[str, float], float, None]  # node id -> bytes, one figure, unknown
TmpfsRoom = tuple[str, int]  # (directory measured, bytes the snapshots may take there)


@dataclass(frozen=True)
class SnapshotMemoryPlan:
    """enabled: take in-memory snapshots. per_rank_bytes: one rank's snapshot state (the size
    of one buffer). per_node_peak_bytes: the most host memory they take on one node. Both are
    what the snapshots need (0 when checkpoint.memory_every_steps=0), also when disabled.
    requested_every: checkpoint.memory_every_steps, what the job asks for."""
    enabled: bool
    per_node_peak_bytes: int
    per_rank_bytes: int
    reason: str
    requested_every: int = 0

    @property
    def every_steps(self) -> int:
        """The decision the ranks execute: a snapshot every N steps (0: none)."""
        return self.requested_every if self.enabled else 0

    def to_dict(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "per_node_peak_bytes": self.per_node_peak_bytes,
                "per_rank_bytes": self.per_rank_bytes, "reason": self.reason}


def _smallest(node_memory_bytes: NodeMemory) -> tuple[str, float] | None:
    """(where, bytes) of the smallest node; None when unknown. Bad figures are errors."""
    if node_memory_bytes is None:
        return None
    one = not isinstance(node_memory_bytes, Mapping)
    items = [("each node", node_memory_bytes)] if one else list(node_memory_bytes.items())
    for node, value in items:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"node_memory_bytes[{node!r}]: {value!r} must be a number > 0")
    if not items:
        return None
    name, value = min(items, key=lambda kv: kv[1])
    return ("each node" if one else f"node {name!r} (the smallest)"), float(value)


def snapshot_tmpfs_room(job_id: str) -> TmpfsRoom | None:
    """(directory, bytes) the job's snapshots may take in this host's snapshot tmpfs: its free
    space plus what the job's buffers there hold already; None when it cannot be measured."""
    from tenax.checkpoint.memory import free_space, job_dir, used_bytes

    path = job_dir(job_id)
    where, free = free_space(path)
    if free < 0:
        return None
    return where, free + (used_bytes(path) if os.path.isdir(path) else 0)


def _need(total: int, per_rank: int, foot: SnapshotFootprint, layout: ParallelLayout) -> str:
    """'<total> peak per node: <ranks> rank(s) x <copies> x <S> rank state (<layout>)'."""
    state = foot.rank_state_bytes
    copies = per_rank // state if state else 0
    return (f"{human_bytes(total)} ({total} B) peak per node: {foot.ranks_per_node} rank(s) x "
            f"{copies} x {human_bytes(state)} rank state ({layout.describe()})")


def _tmpfs_verdict(every: int, need: str, peak: int, room: TmpfsRoom | None) -> str:
    """The reason the snapshots do not fit the tmpfs; "" when they do or it is unknown."""
    if room is None or peak <= room[1]:
        return ""
    return (f"{FIELD}={every}: in-memory snapshots need {need} > {human_bytes(room[1])} "
            f"({room[1]} B) free in {room[0]} (the snapshot tmpfs); running with in-memory "
            f"snapshots off (storage checkpoints only). Enlarge it, point {SNAPSHOT_ENV} at a "
            f"larger tmpfs, or set {FIELD}=0")


def plan_snapshot_memory(spec: JobSpec, layout: ParallelLayout,
                         node_memory_bytes: NodeMemory | Callable[[], NodeMemory],
                         tmpfs_room: TmpfsRoom | Callable[[], TmpfsRoom | None] | None = None
                         ) -> SnapshotMemoryPlan:
    """Whether `layout`'s in-memory snapshots fit the smallest node (<= SAFE_FRACTION of its
    memory), and every how many steps to take them. node_memory_bytes: node id -> Ray `memory`
    bytes, one figure for every node, or None (unknown: not checked); or a function returning
    one, called only when the job asks for snapshots (reading Ray's figures is a GCS call).
    tmpfs_room: what the snapshot tmpfs can take (`snapshot_tmpfs_room`), or a function
    returning it, or None (not checked). Pure: no Ray of its own."""
    every = spec.checkpoint.memory_every_steps
    if every == 0:
        return SnapshotMemoryPlan(False, 0, 0, f"{FIELD}=0")
    gpn = spec.resources.gpus_per_node
    # A device state adds a pinned staging buffer per rank; "auto" is planned as the host path
    # (the controller cannot tell the ranks' devices before they start)
    foot = snapshot_footprint(spec.model.args(), layout, gpn, every, spec.train.dtype,
                              device=spec.resources.device == "cuda")
    peak, state = foot.per_node_peak_bytes, foot.rank_state_bytes
    if callable(node_memory_bytes):
        node_memory_bytes = node_memory_bytes()
    need = _need(peak, foot.per_rank_peak_bytes, foot, layout)
    in_tmpfs = foot.per_node_tmpfs_bytes
    tmpfs = _tmpfs_verdict(every, _need(in_tmpfs, foot.per_rank_peak_bytes - foot.staging_bytes,
                                        foot, layout),
                           in_tmpfs, tmpfs_room() if callable(tmpfs_room) else tmpfs_room)
    if tmpfs:
        logger.info("%s", tmpfs)
        return SnapshotMemoryPlan(False, peak, state, tmpfs, every)
    smallest = _smallest(node_memory_bytes)
    if smallest is None:
        return SnapshotMemoryPlan(True, peak, state, f"{FIELD}={every}: node memory unknown "
                                  f"(Ray reported none); {human_bytes(peak)} peak per node "
                                  f"not checked", every)
    where, memory = smallest
    limit = SAFE_FRACTION * memory
    have = (f"{SAFE_FRACTION} x {human_bytes(memory)} = {human_bytes(limit)} ({int(limit)} B) "
            f"of {where}")
    if peak > limit:
        reason = (f"{FIELD}={every}: in-memory snapshots need {need} > {have}; running with "
                  f"in-memory snapshots off (storage checkpoints only). Add host memory or "
                  f"nodes, raise parallel.zero, or set {FIELD}=0")
        logger.info("%s", reason)  # the controller publishes it once, as a warning event
        return SnapshotMemoryPlan(False, peak, state, reason, every)
    return SnapshotMemoryPlan(True, peak, state,
                              f"{FIELD}={every}: in-memory snapshots fit: {need} <= {have}", every)


def _alive_memory(nodes: Iterable[Mapping[str, Any]], wanted: set[str] | None
                  ) -> dict[str, float]:
    out: dict[str, float] = {}
    for node in nodes:
        node_id = str(node.get("NodeID", ""))
        memory = (node.get("Resources") or {}).get("memory")
        if node.get("Alive", True) and memory and (wanted is None or node_id in wanted):
            out[node_id] = float(memory)
    return out


_NODES = NodesReader()  # its own reader: capacity.py's imports Ray at module load


def ray_node_memory_bytes(node_ids: Iterable[str] | None = None,
                          timeout_s: float = RAY_TIMEOUT_S) -> dict[str, float] | None:
    """Ray's `memory` resource (bytes) of the alive nodes, or of `node_ids` among them.

    ray.nodes() is a GCS call with no deadline of its own: it runs on a daemon thread (one at
    a time, shared by every caller) and this returns None (unknown) if it has not answered
    within `timeout_s`, fails, or no node reports `memory`. Needs Ray initialised by the
    caller."""
    wanted = None if node_ids is None else {str(n) for n in node_ids}
    try:
        nodes = _NODES.nodes(timeout_s)
    except RayNodesTimeout:
        logger.warning("node memory unknown: ray.nodes() did not answer within %s s", timeout_s)
        return None
    except Exception as err:  # noqa: BLE001 - any failure means "unknown", said here
        logger.warning("node memory unknown: ray.nodes() failed: %r", err)
        return None
    return _alive_memory(nodes, wanted) or None
