"""Straggler detection: a slow rank must be visible (and optionally evicted) before it costs a day.

In synchronous training every rank's wall-clock step time equals the slowest rank's, so wall
time hides a straggler. Each rank therefore reports `rank_tokens_per_s`, computed from its own
busy time (forward, backward, optimizer; collective waits excluded), and this module compares
those throughputs across the job's ranks.

Windows. A window closes at the first heartbeat poll at which both hold:
- at least `WINDOW_HEARTBEATS` heartbeat intervals passed since it opened (so a window spans
  several polls and one noisy poll cannot decide), and
- at least `MIN_WINDOW_STEPS` steps were reported by every rank of the group (so jobs with
  long steps get windows of a few steps, never a score from a single step).
A step reported by only some ranks so far waits for the next window. The first step after
(re)start is skipped: it includes warm-up.

Score. Each step is scored on its own first: a rank's throughput ÷ the median of that step's
throughputs across ranks, taking the *high* median for an even count (with two ranks the
ordinary median is the mean of both, so a straggler would drag its own reference down; the
high median keeps the reference at the healthy rank). A rank's window score is the median of
its step scores. Why per step, then median: ranks step together, so whatever slows every rank
at once (a shared, loaded host; a slow data read) cancels within the step; and a step in
which one rank was descheduled is one outlier that the median ignores. On 4 ranks sharing 2
loaded cores a per-step score wanders by ±0.3-1.0, which sank the old window throughput
(tokens over busy seconds) score; bench/straggler_bench.py has the traces.

Decision. `StragglerPolicy` (pure) tests the recent windows together, not each on its own: a
rank is a straggler when the median of its last `WINDOWS` (3) scores is below
`straggler_threshold` *and* significantly below the healthy level, i.e. below
1 - z·1.25·σ/√k, where σ is one window's noise measured on the other ranks (a robust spread,
1.4826 × the median absolute deviation of their recent scores around their own medians, at
least `NOISE_FLOOR`) and 1.25/√k the spread of a median of k. So one noisy window can neither
break a detection ("below the threshold in 3 consecutive windows" broke on every noisy
window) nor raise one (a mean would follow it). False-alarm rate it is tuned for: z = 3.09,
so a healthy rank whose window scores scatter around 1 with the measured σ (Gaussian) crosses
the noise bound with probability 1e-3 per window; the threshold adds the user's margin on top.
A rank k× slower scores 1/k, so the threshold t detects slowdowns above 1/t (0.9 -> more than
1.11×); bench/straggler_bench.py measured detection and false flags per threshold on 4 ranks
sharing 2 cores (README, Stragglers). Its action comes from
`fault_tolerance.straggler_action`: `ignore` (score metric only), `alert` (a `straggler` event
and a warning; the default) or `evict` (the controller restarts the job without that rank's
node and re-plans the layout; `policies.EvictionPolicy` decides whether it may).
"""
from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

logger = logging.getLogger(__name__)

STRAGGLER_ACTIONS = ("ignore", "alert", "evict")
WINDOWS = 3  # the median of this many recent windows is tested
NOISE_WINDOWS = 10  # windows the noise estimate looks back over
NOISE_Z = 3.09  # one-sided 1e-3 false-alarm bound per rank and window under Gaussian noise
NOISE_FLOOR = 0.02  # scores are never trusted to be more exact than this
MAD_TO_SIGMA = 1.4826  # median absolute deviation -> σ for Gaussian noise
MEDIAN_SPREAD = 1.2533  # a median of k scores spreads 1.2533·σ/√k (a mean: σ/√k)
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
        """σ of one window's score, from the other ranks' recent windows (robust: MAD)."""
        deviations = []
        for other in {r for w in history for r in w} - {rank}:
            series = [w[other] for w in history if other in w]
            if len(series) >= 2:
                center = statistics.median(series)
                deviations += [abs(x - center) for x in series]
        sigma = MAD_TO_SIGMA * statistics.median(deviations) if deviations else 0.0
        return max(sigma, NOISE_FLOOR)

    def slow_ranks(self, history: Sequence[Mapping[int, float]]) -> dict[int, float]:
        """{rank: median of its last k scores} for the ranks the test flags."""
        recent = list(history)[-self.windows:]
        if len(recent) < self.windows:
            return {}
        out = {}
        for rank in recent[-1]:
            if not all(rank in w for w in recent):
                continue
            middle = statistics.median(w[rank] for w in recent)
            spread = MEDIAN_SPREAD * self.noise(list(history)[-NOISE_WINDOWS:], rank)
            if middle < min(self.threshold, 1.0 - self.z * spread / math.sqrt(len(recent))):
                out[rank] = middle
        return out

    def make_decision(self, history: Sequence[Mapping[int, float]]) -> StragglerDecision:
        """`history`: per-window {rank: score}, oldest first; only the recent windows matter."""
        if len(history) < self.windows:
            return StragglerDecision("none", reason=f"{len(history)} of {self.windows} windows")
        slow = self.slow_ranks(history)
        if not slow:
            return StragglerDecision("none", reason="every rank within the threshold and noise")
        found = tuple((rank, round(history[-1][rank], 4)) for rank in sorted(slow))
        listed = ", ".join(f"rank {r} (median {slow[r]:.2f})" for r, _ in found)
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
    rates: dict[int, dict[int, float]] = field(default_factory=dict)  # step -> rank -> tokens/s

    def complete(self, world_size: int) -> list[int]:
        return [step for step, ranks in self.rates.items() if len(ranks) >= world_size]


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
        complete = window.complete(world_size)
        if now - window.opened_at < self.window_s or len(complete) < self.min_steps:
            return []
        # steps some ranks have not reported yet are scored in the next window
        self._window = _Window(now, {s: r for s, r in window.rates.items() if s not in complete})
        return self._close([window.rates[s] for s in complete])

    def _recent(self, rank: int) -> float:
        recent = [w[rank] for w in list(self.history)[-self.policy.windows:] if rank in w]
        return statistics.median(recent) if recent else 1.0

    def _add(self, window: _Window, record: Mapping[str, Any]) -> None:
        if record.get("event") != "step" or "rank" not in record:
            return
        rank, rate = record["rank"], float(record.get("rank_tokens_per_s") or 0.0)
        if rank not in self._seen:
            self._seen.add(rank)  # the first step after a (re)start includes warm-up
            return
        if rate <= 0:
            return
        window.rates.setdefault(int(record.get("step", 0)), {})[rank] = rate

    def _close(self, steps: list[dict[int, float]]) -> list[StragglerFlag]:
        per_rank: dict[int, list[float]] = {}
        for rates in steps:
            for rank, score in window_scores(rates).items():
                per_rank.setdefault(rank, []).append(score)
        self.scores = {rank: statistics.median(scores) for rank, scores in per_rank.items()}
        self.windows_closed += 1
        self.history.append(dict(self.scores))
        decision = self.policy.make_decision(self.history)
        current = {rank for rank, _ in decision.stragglers}
        # An episode ends when the rank's recent median is back above the threshold, so one
        # fast window does not end it (and a second flag does not follow the next slow one).
        recovered = {r for r in self.flagged
                     if r not in self.scores or self._recent(r) >= self.policy.threshold}
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
