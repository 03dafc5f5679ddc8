"""The facts the controller keeps between loop iterations while it recovers or re-plans.

Kept as two small records (not loose controller attributes) so that what RECOVERING and
RESCALING decide from is visible in one place and reset in one assignment.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tenax.orchestrator.job.job_policy import JobDecision
from tenax.orchestrator.placement.capacity import NodeProbes
from tenax.parallel import ParallelLayout


@dataclass
class Recovery:
    """What RECOVERING decides from: the failure, rank health when it was decided (heartbeat
    ages must not keep growing while nobody polls), node-lost reports, node probes."""
    failure: JobDecision | None = None
    health: tuple[Any, ...] = ()
    failed_at: float | None = None  # the first failure since the last resumed step
    reported_lost: set[int] = field(default_factory=set)
    probes: NodeProbes = field(default_factory=NodeProbes)
    source: str = "storage"  # where the next start resumes from: memory | replica | storage
    # (step, error) of the latest failure that was a rank's own error: the same one again
    # at the same step is deterministic (job_policy.replayed_error), not worth a restart
    last_error: tuple[int, str] | None = None


@dataclass
class Rescaling:
    """A planned re-plan in flight: the layout it leaves and when it began."""
    old: ParallelLayout | None = None
    since: float = 0.0
    stopped: bool = False  # every rank stopped at the boundary: the next start is `scaled`
