"""Every bound a job's orchestration waits with, derived once from the spec.

Why one record: the spec has three timing fields, but the orchestrator uses them in several
roles (a failure threshold, a state's deadline, the timeout of a call to the agents, the poll
period). Deriving each role here, once per job, keeps the roles named and the rule that maps a
spec field to a role in one place; everything below receives a `Timeouts` (or one of its
figures) and never reads the spec's field by name.

- `heartbeat_interval_s`: how often the controller polls heartbeats (and node probes).
- `heartbeat_timeout_s`: a rank silent this long is gone; also bounds RECOVERING's node probes
  and the small calls to agents (`probe_s`).
- `hang_timeout_s`: a rank whose step does not advance this long is hung.
- `startup_s` = STARTUP_HANG_FACTOR × `hang_timeout_s`: a rank still starting (building the
  model, loading a large checkpoint legitimately takes longer than a step), and each call that
  places, starts or stops ranks (PLACING, the RESCALING stop).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["STARTUP_HANG_FACTOR", "Timeouts"]

STARTUP_HANG_FACTOR = 2.0
IDLE_MARGIN_S = 0.05  # an idle wait ends this much before the next poll is due


@dataclass(frozen=True)
class Timeouts:
    """The spec's `fault_tolerance` timing fields and the bounds derived from them."""
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 5.0
    hang_timeout_s: float = 60.0

    @classmethod
    def from_spec(cls, spec: Any) -> "Timeouts":
        ft = spec.fault_tolerance
        return cls(float(ft.heartbeat_interval_s), float(ft.heartbeat_timeout_s),
                   float(ft.hang_timeout_s))

    @property
    def startup_s(self) -> float:
        """A starting rank's hang limit, and the timeout of placing, starting, stopping ranks."""
        return STARTUP_HANG_FACTOR * self.hang_timeout_s

    @property
    def probe_s(self) -> float:
        """RECOVERING's node probes and the small calls to agents (dropping snapshots)."""
        return self.heartbeat_timeout_s

    @property
    def idle_s(self) -> float:
        """How long the loop may idle between two heartbeat polls."""
        return max(0.0, self.heartbeat_interval_s - IDLE_MARGIN_S)
