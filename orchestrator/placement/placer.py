"""Placer: PLACING's executor — place the ranks, choose where they resume from, start them.

Warm first: reuse the live agents (and their placement groups) and fork new training
processes; only slots whose actor or node died get new actors. Cold fallback: a new group.
Before anything is torn down, the recovery-source policy sees what every live agent holds
(orchestrator/placement/recovery.py), so a step kept in memory survives the re-placement. Every
placement is a new snapshot generation: pieces of one generation form one layout's step.
Whether the ranks take in-memory snapshots, and every how many steps, is decided here once per
placement (orchestrator/placement/host_memory.py) and handed down as it is. A drill's
rank-side faults (`RankChaos`, None in production) ride along to every agent.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Callable

import ray

from tenax.orchestrator.errors import PlacementError
from tenax.orchestrator.placement.host_memory import (SnapshotMemoryPlan, plan_snapshot_memory,
                                                      ray_node_memory_bytes,
                                                      snapshot_tmpfs_room)
from tenax.orchestrator.placement.recovery import MemoryRecovery, MemoryStart, PreparedRestore
from tenax.orchestrator.placement.worker_group import PhaseMarks, WorkerGroup
from tenax.orchestrator.spec import spec_for_ranks
from tenax.orchestrator.timeouts import Timeouts
from tenax.parallel import ParallelLayout
from tenax.workers import RankChaos, new_job_secret
from tenax.workers.tracking import TrackingStart

logger = logging.getLogger(__name__)

PLACEMENT_ERRORS = (PlacementError, ray.exceptions.RayError, TimeoutError)


@dataclass
class Placed:
    group: WorkerGroup
    reuse: dict[str, Any]  # reused / created actors and mode (warm | cold)
    source: str  # where the ranks were told to resume from: memory | replica | storage
    notice: str = ""  # said once: why in-memory snapshots are off for this job


class Placer:
    def __init__(self, job_id: str, spec: Any, timeout_s: float,
                 marks: PhaseMarks | None = None, forkserver: dict[str, Any] | None = None,
                 tracking: Callable[[], TrackingStart] | None = None) -> None:
        self.job_id, self.spec, self.timeout_s = job_id, spec, timeout_s
        self.forkserver = forkserver  # one the launcher started (ControllerOptions.forkserver)
        self.tracking = tracking  # rank 0's W&B run id and the restart totals, at each start
        self.marks = marks  # the cold start's placement phases go here (None: not measured)
        self.gpus_per_node = spec.resources.gpus_per_node
        self.generation = 0
        self.snapshots: SnapshotMemoryPlan | None = None  # the newest placement's decision
        self.recompute = "auto"  # the newest placement's plan: its activation recompute level
        self.told_off = False
        self.off_reason = ""  # why the ranks turned snapshots off while running (said once)
        self.secret = new_job_secret()  # the job's replica secret: to its agents, never logged
        self.memory = MemoryRecovery(job_id, spec.checkpoint.uri,
                                     Timeouts.from_spec(spec).probe_s, timeout_s)

    def _plan_memory(self, layout: ParallelLayout) -> str:
        """Decide this placement's snapshots: only where they fit the nodes' memory (never an
        OOM-killed node); the reason they are off is returned the first time only."""
        plan = plan_snapshot_memory(self.spec, layout, ray_node_memory_bytes,
                                    lambda: snapshot_tmpfs_room(self.job_id))
        if self.off_reason:  # the ranks found no room at run time: never again for this job
            plan = replace(plan, enabled=False, reason=self.off_reason)
        self.snapshots = plan
        if plan.enabled or not plan.requested_every or self.told_off:
            return ""
        self.told_off = True
        logger.warning("job %s: in-memory snapshots off: %s", self.job_id, plan.reason)
        return plan.reason

    def turn_off_snapshots(self, reason: str) -> None:
        """The ranks turned their snapshots off (no tmpfs space) and said so: every later
        placement of this job runs without them, and says nothing more."""
        self.off_reason, self.told_off = reason or "in-memory snapshots turned off", True

    def place(self, group: WorkerGroup | None, layout: ParallelLayout,
              chaos: RankChaos | None = None, recompute: str = "auto") -> Placed:
        """Raises a PLACEMENT_ERRORS error (after releasing what it placed) when both fail.
        `chaos`: a drill's rank-side faults for every rank (None in production). `recompute`:
        the level the plan chose for `layout`, handed to the ranks in place of the spec's."""
        self.recompute = recompute
        if group is not None:  # survivors' processes go first: none may write a snapshot
            group.stop_training(self.timeout_s)  # while it is read, and the CPU is the recovery's
        # Whether the job asks for snapshots does not change with the layout: the last
        # placement's plan says (a group exists only after a placement)
        requested = self.snapshots is not None and self.snapshots.requested_every > 0
        prepared = self.memory.prepare(group.live_holders(), group.kept_nodes(layout)) \
            if group is not None and requested else None
        notice = self._plan_memory(layout)
        self.generation += 1
        group = group or WorkerGroup(self.job_id, self.gpus_per_node, marks=self.marks,
                                     forkserver=self.forkserver)
        run = (layout, chaos, prepared)
        try:
            reuse, source = self._create_and_start(group, *run)
            return Placed(group, {**reuse, "mode": "warm" if reuse["reused"] else "cold"}, source,
                          notice)
        except PLACEMENT_ERRORS as err:
            if not group.blocks and not group.ranks:
                group.shutdown()
                raise
            logger.warning("job %s: warm re-join failed (%s); falling back to a cold start",
                           self.job_id, err)
        group.shutdown()
        group = WorkerGroup(self.job_id, self.gpus_per_node, marks=self.marks,
                                     forkserver=self.forkserver)
        try:
            reuse, source = self._create_and_start(group, *run)
        except PLACEMENT_ERRORS:
            group.shutdown()
            raise
        return Placed(group, {**reuse, "mode": "cold"}, source, notice)

    def _create_and_start(self, group: WorkerGroup, layout: ParallelLayout,
                          chaos: RankChaos | None,
                          prepared: PreparedRestore | None) -> tuple[dict[str, Any], str]:
        reuse = group.create(layout, self.timeout_s)
        uris = self.memory.assemble(prepared, group.ranks)
        source = prepared.decision.source if prepared is not None and uris else "storage"
        every = self.snapshots.every_steps if self.snapshots is not None else 0
        rank_bytes = self.snapshots.per_rank_bytes if self.snapshots is not None else 0
        memory = MemoryStart(self.job_id, self.generation, every, uris, self.secret, rank_bytes,
                             self.spec.train.steps)
        group.start(spec_for_ranks(self.spec, self.recompute), self.timeout_s, memory, chaos,
                    self.tracking() if self.tracking is not None else None)
        return reuse, source
