"""Straggler detection: a slow rank must be visible (and optionally evicted) before it costs a day.

In synchronous training every rank's wall-clock step time equals the slowest rank's, so wall
time hides a straggler. Each rank therefore reports `rank_tokens_per_s`, computed from its own
busy time (forward, backward, optimizer; collective waits excluded), and this module compares
those throughputs across the job's ranks.

Windows. A window closes at the first heartbeat poll at which both hold:
- at least `WINDOW_HEARTBEATS` heartbeat intervals passed since it opened (so a window spans
  several polls and one noisy poll cannot decide), and
- every rank of the group reported at least `MIN_WINDOW_STEPS` new steps in it (so jobs with
  long steps get windows of a few steps, never a score from a single step).
A rank's window throughput is tokens over busy seconds summed over the window (the harmonic
mean of its per-step `rank_tokens_per_s`, since a rank processes the same tokens every step),
which damps per-step jitter. The first step after (re)start is skipped: it includes warm-up.

Score. score = window throughput ÷ the median of the job's ranks' window throughputs, taking
the *high* median for an even count. With two ranks the ordinary median is the mean of both,
so a straggler would drag its own reference down (1.5× slower would score 0.8, not 0.67); the
high median keeps the reference at the healthy rank.

Decision. `StragglerPolicy` (pure) flags a rank whose score is below `straggler_threshold` in
each of the last 3 windows. Its action comes from `fault_tolerance.straggler_action`: `ignore`
(score metric only), `alert` (a `straggler` event and a warning; the default) or `evict` (the
controller restarts the job without that rank's node and re-plans the layout). Note the
arithmetic: a rank k× slower scores 1/k, so the threshold t detects slowdowns above 1/t
(0.8 -> more than 1.25×, 0.85 -> more than 1.18×).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

logger = logging.getLogger(__name__)

STRAGGLER_ACTIONS = ("ignore", "alert", "evict")
CONSECUTIVE_WINDOWS = 3
WINDOW_HEARTBEATS = 2
MIN_WINDOW_STEPS = 5


def high_median(values: Iterable[float]) -> float:
    """The median; for an even count the larger of the two middle values (see module doc)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("median of no values")
    return ordered[len(ordered) // 2]


def window_scores(throughputs: Mapping[int, float]) -> dict[int, float]:
    """Each rank's throughput divided by the high median of all ranks' throughputs."""
    usable = {rank: t for rank, t in throughputs.items() if t > 0}
    if len(usable) < 2:
        return {rank: 1.0 for rank in usable}  # nobody to compare with
    reference = high_median(usable.values())
    return {rank: t / reference for rank, t in usable.items()}


@dataclass(frozen=True)
class StragglerDecision:
    action: str  # none | ignore | alert | evict
    stragglers: tuple[tuple[int, float], ...] = ()  # (rank, score of the latest window)
    reason: str = ""


class StragglerPolicy:
    """Pure: from the recent windows' scores, which ranks are stragglers and what to do."""

    def __init__(self, threshold: float = 0.8, action: str = "alert",
                 consecutive: int = CONSECUTIVE_WINDOWS) -> None:
        if action not in STRAGGLER_ACTIONS:
            raise ValueError(f"straggler action {action!r} must be one of {STRAGGLER_ACTIONS}")
        if not 0 < threshold < 1 or consecutive < 1:
            raise ValueError(f"straggler threshold {threshold} must be in (0, 1), "
                             f"consecutive windows {consecutive} >= 1")
        self.threshold, self.action, self.consecutive = threshold, action, consecutive

    def make_decision(self, history: Sequence[Mapping[int, float]]) -> StragglerDecision:
        """`history`: per-window {rank: score}, oldest first; only the last windows matter."""
        recent = list(history)[-self.consecutive:]
        if len(recent) < self.consecutive:
            return StragglerDecision("none", reason=f"{len(recent)} of {self.consecutive} windows")
        slow = sorted(rank for rank in recent[-1]
                      if all(rank in w and w[rank] < self.threshold for w in recent))
        if not slow:
            return StragglerDecision("none", reason="every rank within the threshold")
        found = tuple((rank, round(recent[-1][rank], 4)) for rank in slow)
        listed = ", ".join(f"rank {r} ({s:.2f})" for r, s in found)
        return StragglerDecision(self.action, found, f"{listed} below {self.threshold} × median "
                                 f"for {self.consecutive} consecutive windows")


@dataclass(frozen=True)
class StragglerFlag:
    """A rank newly found to be a straggler, with what the policy wants done."""
    rank: int
    score: float
    action: str  # alert | evict


def eviction_plan(flag: StragglerFlag, node_ids: Sequence[str],
                  gpus_per_node: int) -> tuple[str, tuple[int, ...], str]:
    """What `evict` removes: the straggler's node-sized block of ranks (placement packs ranks
    [k*g, (k+1)*g) on one node). Returns (node id, the block's ranks with the straggler first,
    reason)."""
    block = flag.rank // gpus_per_node
    peers = range(block * gpus_per_node, min((block + 1) * gpus_per_node, len(node_ids)))
    ranks = (flag.rank,) + tuple(r for r in peers if r != flag.rank)
    node = node_ids[flag.rank]
    return node, ranks, (f"rank {flag.rank} is a straggler (score {flag.score:.2f}): "
                         f"evicting its node {node[:8]}")


@dataclass
class _Window:
    opened_at: float
    busy_per_token: dict[int, float] = field(default_factory=dict)  # sum of 1/tokens_per_s
    steps: dict[int, int] = field(default_factory=dict)


class StragglerTracker:
    """Feeds per-rank step records into windows, keeps the latest scores, applies the policy.

    Stateful companion of the pure policy; the controller calls `observe` after each heartbeat
    poll and `reset` when it places a new group (rank numbers then mean other processes).
    """

    def __init__(self, threshold: float = 0.8, action: str = "alert",
                 heartbeat_interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 min_steps: int = MIN_WINDOW_STEPS) -> None:
        self.policy = StragglerPolicy(threshold, action)
        self.window_s = WINDOW_HEARTBEATS * heartbeat_interval_s
        self.min_steps, self.clock = min_steps, clock
        self.scores: dict[int, float] = {}  # latest window's score per rank (the metric)
        self.flagged: set[int] = set()
        self.windows_closed = 0
        self.history: deque[dict[int, float]] = deque(maxlen=self.policy.consecutive)
        self._window: _Window | None = None
        self._seen: set[int] = set()  # ranks whose warm-up step was skipped

    @classmethod
    def from_spec(cls, fault_tolerance: Any) -> "StragglerTracker":
        return cls(fault_tolerance.straggler_threshold,
                   getattr(fault_tolerance, "straggler_action", "alert"),
                   fault_tolerance.heartbeat_interval_s)

    def reset(self) -> None:
        self.scores, self.flagged, self._window, self._seen = {}, set(), None, set()
        self.history.clear()

    def observe(self, records: Iterable[Mapping[str, Any]], world_size: int,
                now: float | None = None) -> list[StragglerFlag]:
        """Absorb new records; returns the ranks that just became stragglers (not ignored)."""
        now = self.clock() if now is None else now
        window = self._window or _Window(opened_at=now)
        self._window = window
        for record in records:
            self._add(window, record)
        if now - window.opened_at < self.window_s or len(window.steps) < world_size or \
                min(window.steps.values()) < self.min_steps:
            return []
        self._window = _Window(opened_at=now)
        return self._close(window)

    def _add(self, window: _Window, record: Mapping[str, Any]) -> None:
        if record.get("event") != "step" or "rank" not in record:
            return
        rank, rate = record["rank"], float(record.get("rank_tokens_per_s") or 0.0)
        if rank not in self._seen:
            self._seen.add(rank)  # the first step after a (re)start includes warm-up
            return
        if rate <= 0:
            return
        window.busy_per_token[rank] = window.busy_per_token.get(rank, 0.0) + 1.0 / rate
        window.steps[rank] = window.steps.get(rank, 0) + 1

    def _close(self, window: _Window) -> list[StragglerFlag]:
        throughputs = {rank: window.steps[rank] / busy
                       for rank, busy in window.busy_per_token.items() if busy > 0}
        self.scores = window_scores(throughputs)
        self.windows_closed += 1
        self.history.append(dict(self.scores))
        decision = self.policy.make_decision(self.history)
        current = {rank for rank, _ in decision.stragglers}
        recovered = self.flagged - {r for r, s in self.scores.items()
                                    if s < self.policy.threshold}
        if recovered:
            logger.info("ranks %s are no longer stragglers", sorted(recovered))
        self.flagged -= recovered
        new = [(rank, score) for rank, score in decision.stragglers if rank not in self.flagged]
        self.flagged |= current
        if not new:
            return []
        logger.warning("straggler: %s (action %s)", decision.reason, decision.action)
        if decision.action == "ignore":
            return []
        return [StragglerFlag(rank, score, decision.action) for rank, score in new]
