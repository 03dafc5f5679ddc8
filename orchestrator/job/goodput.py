"""Goodput: how much of the wall time since submit went into training that survived.

Wall time is split into phases, measured by the controller as they happen:
- placement: PLACING (planning, placement groups, actors, forking training processes);
- startup: from RUNNING until rank 0 started (rendezvous, model build, checkpoint load and
  reshard), by the time on its `started` record, not when the controller heard of it: a short
  job's steps may all arrive in the poll that brings it;
- recovery: RECOVERING and RESCALING (detection to re-plan, planned checkpoint-and-stop);
- lost: the wall time of steps that were computed and then lost to a failure (they are
  redone from the last committed checkpoint);
- checkpoint: time training was blocked by checkpoint saves (the `blocked_s` of each save).
Productive time is what remains; goodput = productive / wall.
`cold_start_s` is launch -> first step (its breakdown: orchestrator/job/goodput_cold_start.py).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from tenax.orchestrator.job.goodput_cold_start import ColdStart

logger = logging.getLogger(__name__)

PHASES = ("placement", "startup", "recovery", "lost", "checkpoint")


@dataclass
class Goodput:
    submitted_at: float = field(default_factory=time.monotonic)
    phases: dict[str, float] = field(default_factory=lambda: {p: 0.0 for p in PHASES})
    _open: tuple[str, float] | None = None
    _step_s: list[float] = field(default_factory=list)
    launched_at: float | None = None  # wall time the cold start counts from (None: now)
    cold_start: ColdStart = field(init=False)

    def __post_init__(self) -> None:
        self.cold_start = ColdStart(self.launched_at)

    def begin(self, phase: str) -> None:
        """Close the open phase (if any) and open `phase` now."""
        self.end()
        self._open = (phase, time.monotonic())

    def end(self, ago_s: float = 0.0) -> None:
        """Close the open phase now, or `ago_s` seconds ago: the moment a rank's record says it
        ended, which the controller hears of a poll later (never before the phase opened)."""
        if self._open is not None:
            phase, since = self._open
            self.phases[phase] += max(0.0, time.monotonic() - since - max(0.0, ago_s))
            self._open = None

    def step(self, step_s: float) -> None:
        self._step_s.append(step_s)
        del self._step_s[:-100]  # a recent mean is what a lost step cost

    def lost_steps(self, n: int) -> None:
        if n and self._step_s:
            self.phases["lost"] += n * sum(self._step_s) / len(self._step_s)

    def checkpoint_blocked(self, seconds: float) -> None:
        self.phases["checkpoint"] += max(0.0, seconds)

    def summary(self) -> dict[str, float]:
        wall = max(time.monotonic() - self.submitted_at, 1e-9)
        spent = dict(self.phases)
        if self._open is not None:
            spent[self._open[0]] += time.monotonic() - self._open[1]
        productive = max(0.0, wall - sum(spent.values()))
        cold = self.cold_start.total_s()
        return {"wall_s": round(wall, 3), "productive_s": round(productive, 3),
                "goodput": round(productive / wall, 4),
                **{f"{p}_s": round(v, 3) for p, v in spent.items()},
                **({"cold_start_s": cold} if cold is not None else {})}
