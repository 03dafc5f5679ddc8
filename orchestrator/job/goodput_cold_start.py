"""Cold-start breakdown: where the time from launch to a job's first step went.

Why: a cold start is paid by every `tenax run`, every service job and every test, and its parts
(Ray, placement, agents, their forkservers, rendezvous, model build) move independently; a user
must see which one grew. The figures travel in the `done` event (`cold_start`) and, as the
total `cold_start_s`, in the goodput figures.

Each phase of `COLD_START_PHASES` is a moment, reported as seconds since launch, at which that
phase was complete for every rank. Launch is the process start for `tenax run` (the runner
hands it over), else the controller's construction (a service job: its admission). The values
are cumulative, so never decreasing: a phase that finished before an earlier one (an agent's
forkserver warm before the controller heard from every agent) counts as reached when the
earlier one was. Moments measured in other processes (the ranks') are wall-clock times, so on a
multi-node cluster they carry the nodes' clock skew.

Only the first time through counts: marks after a phase was reached, and everything after the
first step, are ignored, so a recovery never rewrites the cold start.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

COLD_START_PHASES = ("ray_started", "placement_groups_ready", "agents_started",
                     "forkservers_ready", "ranks_forked", "rendezvous", "trainer_built",
                     "ranks_started", "first_step")
# The rank-side moments carried in each rank's "started" record (workers/rank.py)
RANK_FIELDS = {"rendezvous": "joined_at", "trainer_built": "built_at", "ranks_started": "time"}


def process_started_at() -> float | None:
    """Wall time this process started (Linux /proc; None elsewhere): `tenax run`'s launch.

    Why not /proc/stat's boot time: it has whole-second resolution; the uptime clock has 10 ms."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        started_ticks = int(fields[19])  # field 22 of stat; the split starts at field 3
        return time.time() - (uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError) as err:
        logger.debug("process start time not readable: %s", err)
        return None


@dataclass
class ColdStart:
    """Moments (wall clock) of the cold start's phases; `summary()` is the `cold_start` field."""
    launched_at: float | None = None  # wall time; None: now
    marks: dict[str, float] = field(default_factory=dict)
    ranks: dict[str, dict[int, float]] = field(default_factory=dict)  # rank-side, per rank

    def __post_init__(self) -> None:
        now = time.time()
        if self.launched_at is None or self.launched_at > now:
            self.launched_at = now
        self.mark("ray_started", now)  # the controller exists: Ray is up

    @property
    def done(self) -> bool:
        return "first_step" in self.marks

    def mark(self, phase: str, at: float | None = None) -> None:
        """`phase` is complete now (or at wall time `at`); the first mark of a phase wins."""
        if phase not in COLD_START_PHASES:
            raise ValueError(f"cold start phase: {phase!r} is not one of {COLD_START_PHASES}")
        if not self.done:
            self.marks.setdefault(phase, time.time() if at is None else at)

    def observe(self, records: list[dict[str, Any]]) -> None:
        """The ranks' records: each rank's first "started" moments, rank 0's first step."""
        for record in records:
            if self.done:
                return
            kind = record.get("event")
            if kind == "started":
                rank = int(record.get("rank", 0))
                for phase, key in RANK_FIELDS.items():
                    value = record.get(key)
                    if isinstance(value, (int, float)) and value > 0:  # 0: not measured
                        self.ranks.setdefault(phase, {}).setdefault(rank, float(value))
            elif kind == "step" and record.get("rank") == 0 and "time" in record:
                for phase, per_rank in self.ranks.items():  # every rank has started by now
                    self.marks.setdefault(phase, max(per_rank.values()))
                self.mark("first_step", float(record["time"]))

    def summary(self) -> dict[str, float]:
        """Phase -> seconds since launch, in phase order, for the phases reached."""
        out: dict[str, float] = {}
        reached = 0.0
        for phase in COLD_START_PHASES:
            if phase in self.marks:
                reached = max(reached, self.marks[phase] - self.launched_at)
                out[phase] = round(reached, 3)
        return out

    def total_s(self) -> float | None:
        """Launch -> first step, once reached."""
        return self.summary().get("first_step")


def durations(since_launch: dict[str, float]) -> dict[str, float]:
    """A `cold_start` field as each phase's own share (they add up to its last value)."""
    out, previous = {}, 0.0
    for phase, at in since_launch.items():
        out[phase] = round(at - previous, 3)
        previous = at
    return out
