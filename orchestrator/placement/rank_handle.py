"""The controller's view of one rank: its agent's handle, the health the policies read, and
what counts as progress.

Why apart from the worker group: the policies (orchestrator/job/job_policy.py) and tests read
`RankHealth` and `progressed` as plain data and a pure function; here they come without Ray.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

logger = logging.getLogger(__name__)

__all__ = ["PhaseMarks", "RankHandle", "RankHealth", "progressed"]


class PhaseMarks(Protocol):
    """Where placement reports the cold start's phases as they complete (the job's goodput;
    orchestrator/job/goodput_cold_start.py names them)."""

    def mark(self, phase: str, at: float | None = None) -> None: ...


@dataclass
class RankHandle:
    rank: int
    actor: Any
    node_id: str = ""
    ip: str = ""
    pid: int = 0
    pending: Any = None  # in-flight heartbeat ObjectRef
    pending_since: float = 0.0
    last_reply: float = field(default_factory=time.monotonic)
    n_events: int = 0
    attempt: int = 0  # the training process this handle listens to (older replies are dropped)
    step_seen_at: float = field(default_factory=time.monotonic)  # controller clock, no skew
    status: dict[str, Any] = field(default_factory=dict)
    dead: str | None = None  # why Ray says this actor is gone
    watching: int = 0  # the attempt a `wait_ended` call is in flight for (0: none)
    ended: int = 0  # the newest attempt seen ended through such a call


@dataclass
class RankHealth:
    """What the policies see of one rank (pure data)."""
    rank: int
    node_id: str
    dead: str | None
    heartbeat_age_s: float
    state: str
    step: int
    step_age_s: float  # since its step, state or progress last changed (`progressed`)
    error: str | None


def progressed(before: Mapping[str, Any], reply: Mapping[str, Any]) -> bool:
    """A heartbeat shows work since the previous one: the step or the state changed, or the
    agent noted more progress records (a validation run takes no step yet is no hang). The
    rank's hang clock (`RankHealth.step_age_s`) restarts then."""
    return any(reply.get(key) != before.get(key) for key in ("step", "state", "progress"))
