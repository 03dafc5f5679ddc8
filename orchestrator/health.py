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

Decision. `StragglerPolicy` (pure) tests the recent windows, not each window on its own: a rank
is a straggler when the mean of its last `WINDOWS` (3) scores is below `straggler_threshold`
*and* significantly below the healthy level, i.e. below 1 - z·σ/√k, where σ is the window
noise measured on the other ranks (the pooled spread of their recent scores around their own
means, at least `NOISE_FLOOR`). One noisy window can no longer break a detection ("below the
threshold in 3 consecutive windows" did, on every noisy window), and one noisy window cannot
raise one either. False-alarm rate it is tuned for: z = 3.09, so a healthy rank whose window
scores are Gaussian around 1 with the measured σ crosses the noise bound with probability
1e-3 per window; the threshold then adds the user's margin (with σ = 0.03 a healthy mean of 3
windows sits 5.8 σ above 0.9). A rank k× slower scores 1/k, so the threshold t detects
slowdowns above 1/t (0.9 -> more than 1.11×); bench/straggler_bench.py measured the default on
4 ranks sharing 2 cores (README's Performance table). Its action comes from
`fault_tolerance.straggler_action`: `ignore` (score metric only), `alert` (a `straggler` event
and a warning; the default) or `evict` (the controller restarts the job without that rank's
node and re-plans the layout; `policies.EvictionPolicy` decides whether it may).
"""
from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

logger = logging.getLogger(__name__)

STRAGGLER_ACTIONS = ("ignore", "alert", "evict")
WINDOWS = 3  # the mean of this many recent windows is tested
NOISE_WINDOWS = 10  # windows the noise estimate looks back over
NOISE_Z = 3.09  # one-sided 1e-3 false-alarm bound per rank and window under Gaussian noise
NOISE_FLOOR = 0.02  # scores are never trusted to be more exact than this
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

    def __init__(self, threshold: float = 0.8, action: str = "alert", windows: int = WINDOWS,
                 z: float = NOISE_Z) -> None:
        if action not in STRAGGLER_ACTIONS:
            raise ValueError(f"straggler_action: {action!r} must be one of {STRAGGLER_ACTIONS}")
        if not 0 < threshold < 1 or windows < 1:
            raise ValueError(f"straggler_threshold: {threshold} must be in (0, 1), "
                             f"windows {windows} >= 1")
        self.threshold, self.action, self.windows, self.z = threshold, action, windows, z

    def noise(self, history: Sequence[Mapping[int, float]], rank: int) -> float:
        """σ of one window's score, pooled over the other ranks' recent windows."""
        deviations = []
        for other in {r for w in history for r in w} - {rank}:
            series = [w[other] for w in history if other in w]
            if len(series) >= 2:
                mean = sum(series) / len(series)
                deviations += [(x - mean) ** 2 for x in series]
        sigma = math.sqrt(sum(deviations) / len(deviations)) if deviations else 0.0
        return max(sigma, NOISE_FLOOR)

    def slow_ranks(self, history: Sequence[Mapping[int, float]]) -> dict[int, float]:
        """{rank: mean of its last k scores} for the ranks the test flags."""
        recent = list(history)[-self.windows:]
        if len(recent) < self.windows:
            return {}
        out = {}
        for rank in recent[-1]:
            if not all(rank in w for w in recent):
                continue
            mean = sum(w[rank] for w in recent) / len(recent)
            bound = 1.0 - self.z * self.noise(list(history)[-NOISE_WINDOWS:], rank) / math.sqrt(len(recent))
            if mean < min(self.threshold, bound):
                out[rank] = mean
        return out

    def make_decision(self, history: Sequence[Mapping[int, float]]) -> StragglerDecision:
        """`history`: per-window {rank: score}, oldest first; only the recent windows matter."""
        if len(history) < self.windows:
            return StragglerDecision("none", reason=f"{len(history)} of {self.windows} windows")
        slow = self.slow_ranks(history)
        if not slow:
            return StragglerDecision("none", reason="every rank within the threshold and noise")
        found = tuple((rank, round(history[-1][rank], 4)) for rank in sorted(slow))
        listed = ", ".join(f"rank {r} (mean {slow[r]:.2f})" for r, _ in found)
        return StragglerDecision(self.action, found, f"{listed} below {self.threshold} × median "
                                 f"over the last {self.windows} windows, beyond the noise")


@dataclass(frozen=True)
class StragglerFlag:
    """A rank newly found to be a straggler, with what the policy wants done."""
    rank: int
    score: float
    action: str  # alert | evict


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
        self.history: deque[dict[int, float]] = deque(maxlen=NOISE_WINDOWS)
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

    def _mean(self, rank: int) -> float:
        recent = [w[rank] for w in list(self.history)[-self.policy.windows:] if rank in w]
        return sum(recent) / len(recent) if recent else 1.0

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
        # An episode ends when the rank's recent mean is back above the threshold, so one
        # fast window does not end it (and a second flag does not follow the next slow one).
        recovered = {r for r in self.flagged
                     if r not in self.scores or self._mean(r) >= self.policy.threshold}
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
