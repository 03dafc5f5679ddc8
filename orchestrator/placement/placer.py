"""Placer: PLACING's executor — place the ranks, choose where they resume from, start them.

Warm first: reuse the live agents (and their placement groups) and fork new training
processes; only slots whose actor or node died get new actors. Cold fallback: a new group.
Before anything is torn down, the recovery-source policy sees what every live agent holds
(orchestrator/placement/recovery.py), so a step kept in memory survives the re-placement. Every
placement is a new snapshot generation: pieces of one generation form one layout's step.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import ray

from tenax.orchestrator.placement.host_memory import plan_snapshot_memory, ray_node_memory_bytes
from tenax.orchestrator.placement.recovery import MemoryRecovery, MemoryStart, PreparedRestore
from tenax.orchestrator.placement.worker_group import PlacementError, WorkerGroup
from tenax.parallel.layout import ParallelLayout

logger = logging.getLogger(__name__)

PLACEMENT_ERRORS = (PlacementError, ray.exceptions.RayError, TimeoutError)


@dataclass
class Placed:
    group: WorkerGroup
    reuse: dict[str, Any]  # reused / created actors and mode (warm | cold)
    source: str  # where the ranks were told to resume from: memory | replica | storage
    notice: str = ""  # said once: why in-memory snapshots are off for this job


class Placer:
    def __init__(self, job_id: str, spec: Any, timeout_s: float) -> None:
        self.job_id, self.spec, self.timeout_s = job_id, spec, timeout_s
        self.gpus_per_node = spec.resources.gpus_per_node
        self.generation = 0
        self.wanted = spec.checkpoint.memory_every_steps > 0
        self.snapshots_on, self.told_off = self.wanted, False
        self.memory = MemoryRecovery(job_id, spec.checkpoint.uri,
                                     spec.fault_tolerance.heartbeat_timeout_s, timeout_s)

    def _plan_memory(self, layout: ParallelLayout) -> str:
        """Snapshots only where they fit the nodes' memory (never an OOM-killed node); the
        reason they are off is returned the first time only."""
        if not self.wanted:
            return ""
        plan = plan_snapshot_memory(self.spec, layout, ray_node_memory_bytes())
        self.snapshots_on = plan.enabled
        if plan.enabled or self.told_off:
            return ""
        self.told_off = True
        logger.warning("job %s: in-memory snapshots off: %s", self.job_id, plan.reason)
        return plan.reason

    def place(self, group: WorkerGroup | None, layout: ParallelLayout, faults: list[Any],
              ledger: Any, head_node: str) -> Placed:
        """Raises a PLACEMENT_ERRORS error (after releasing what it placed) when both fail."""
        if group is not None:  # survivors' processes go first: none may write a snapshot
            group.stop_training(self.timeout_s)  # while it is read, and the CPU is the recovery's
        prepared = self.memory.prepare(group.live_holders(), group.kept_nodes(layout)) \
            if group is not None and self.wanted else None
        notice = self._plan_memory(layout)
        self.generation += 1
        group = group or WorkerGroup(self.job_id, self.gpus_per_node)
        run = (layout, faults, ledger, head_node, prepared)
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
        group = WorkerGroup(self.job_id, self.gpus_per_node)
        try:
            reuse, source = self._create_and_start(group, *run)
        except PLACEMENT_ERRORS:
            group.shutdown()
            raise
        return Placed(group, {**reuse, "mode": "cold"}, source, notice)

    def _create_and_start(self, group: WorkerGroup, layout: ParallelLayout, faults: list[Any],
                          ledger: Any, head_node: str,
                          prepared: PreparedRestore | None) -> tuple[dict[str, Any], str]:
        reuse = group.create(layout, self.timeout_s)
        uris = self.memory.assemble(prepared, group.ranks)
        source = prepared.decision.source if prepared is not None and uris else "storage"
        memory = MemoryStart(self.job_id, self.generation, self.snapshots_on, uris)
        group.start(self.spec.to_dict(), faults, ledger, self.timeout_s, head_node, memory)
        return reuse, source
