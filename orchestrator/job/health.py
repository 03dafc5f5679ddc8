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

Score. Each step is scored on its own first: log(a rank's throughput ÷ the median of the
*other* ranks' throughputs that step). Per step, because ranks step together, so whatever
slows every rank at once (a shared, loaded host; a slow data read) cancels within the step.
Leave-one-out, so a straggler never drags its own reference down (with two ranks each is
compared with the other); the median of the others, so one rank's odd step (a rank that was
briefly *faster*, as a sleeping rank is on an overloaded host) does not make every other rank
look slow. A rank's window score (`scores`, the metric) is the geometric mean of its step
scores, each winsorised to the window's median ± `STEP_CLIP`: on 4 ranks sharing 2 loaded
cores a step's score scatters by σ ≈ 0.2 in log with a heavy tail (a descheduled step scores
0.3), so outliers are capped, yet, unlike a median, every step still counts.

Decision. `StragglerPolicy` (pure) pools the steps of the last k windows, k = 2 and k =
`WINDOWS` (3), and scores them the same way; a rank is a straggler when for either k that
score is below `straggler_threshold` *and* below the noise bound e^(-z·σ/√k), σ being one
window's log-score noise measured on the other ranks as the larger of two robust estimates
(1.4826 × a median absolute deviation): the scatter of their window scores across the last
`NOISE_WINDOWS` windows (slow drifts, correlated noise) and the scatter of their step scores
within a window ÷ √steps (available from the first window, so a fresh tracker is not
trigger-happy). k = 2 reacts to a slowdown within 2 windows; k = 3 catches one that began
inside the older window. No single window decides (at least 2 are pooled), so one noisy
window can neither raise a flag nor, pooled with the others, break one.

False-alarm rate it is tuned for: z = 3.29, a one-sided 5e-4 per test under Gaussian noise of
known σ, so at most 1e-3 per rank and window from the noise bound (two tests per window),
about one false flag per 17 rank-minutes of 1-second windows wherever the noise bound, not
the threshold, binds (on 4 ranks sharing 2 busy cores it sits near 0.9). With σ estimated
from the other ranks the rate roughly doubles: 2e-3 on synthetic noise as heavy as this
host's (tests/test_health.py). Measured on the bench's recordings, the noise bound alone
(threshold 0.999) was crossed in 1 of 3198 healthy rank-window tests at ordinary load, but in
27 of 2682 (1e-2) where other jobs overloaded the 2 cores (load average 17-23): there a
rank's busy time measures CPU starvation, not its speed, and no threshold helps (README).
z = 3.09 flagged a healthy rank in 1 of 80 trials recorded at load 10-13, hence 3.29. The
threshold adds the user's margin on top: a rank k× slower scores 1/k, so threshold t flags
slowdowns above 1/t (0.9: above 1.11×); docs/operations.md, Stragglers, has the bench's table,
the load it was measured under and why the default is 0.9.
Its action comes from `fault_tolerance.straggler_action`: `ignore` (score metric only),
`alert` (a `straggler` event and a warning; the default) or `evict` (the controller restarts
the job without that rank's node and re-plans the layout; `job_policy.EvictionPolicy` decides
whether it may).
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
WINDOWS = 3  # the longest run of recent windows tested together
MIN_WINDOWS = 2  # the shortest: one window alone is never enough
NOISE_WINDOWS = 10  # windows the noise estimate looks back over
NOISE_Z = 3.29  # one-sided 5e-4 per test, so <= 1e-3 per rank and window (2 tests), Gaussian
NOISE_FLOOR = 0.02  # log scores are never trusted to be more exact than this
MAD_TO_SIGMA = 1.4826  # median absolute deviation -> σ for Gaussian noise
STEP_CLIP = 0.3  # a step counts at most ×1.35 or ÷1.35 off its window median (winsorised)
WINDOW_HEARTBEATS = 2
MIN_WINDOW_STEPS = 5


def step_scores(throughputs: Mapping[int, float]) -> dict[int, float]:
    """Each rank's log(throughput ÷ the median of the other ranks' throughputs)."""
    logs = {rank: math.log(t) for rank, t in throughputs.items() if t > 0}
    if len(logs) < 2:
        return {rank: 0.0 for rank in logs}  # nobody to compare with
    return {rank: x - statistics.median(y for r, y in logs.items() if r != rank)
            for rank, x in logs.items()}


def window_score(log_scores: Iterable[float]) -> float:
    """Geometric mean of step scores, each winsorised to their median ± STEP_CLIP (in log)."""
    values = list(log_scores)
    center = statistics.median(values)
    return math.exp(statistics.fmean(min(max(x, center - STEP_CLIP), center + STEP_CLIP)
                                     for x in values))


Window = Mapping[int, Sequence[float]]  # rank -> log scores of the window's steps


@dataclass(frozen=True)
class StragglerDecision:
    action: str  # none | ignore | alert | evict
    stragglers: tuple[tuple[int, float], ...] = ()  # (rank, score of the latest window)
    reason: str = ""


class StragglerPolicy:
    """Pure: from the recent windows' step scores, which ranks are stragglers and what to do."""

    def __init__(self, threshold: float = 0.9, action: str = "alert", windows: int = WINDOWS,
                 z: float = NOISE_Z) -> None:
        if action not in STRAGGLER_ACTIONS:
            raise ValueError(f"straggler_action: {action!r} must be one of {STRAGGLER_ACTIONS}")
        if not 0 < threshold < 1 or windows < MIN_WINDOWS:
            raise ValueError(f"straggler_threshold: {threshold} must be in (0, 1), "
                             f"windows {windows} >= {MIN_WINDOWS}")
        self.threshold, self.action, self.windows, self.z = threshold, action, windows, z

    @staticmethod
    def noise_terms(history: Sequence[Window]) -> dict[int, list[list[float]]]:
        """Per rank: deviations of its window scores from their median, and its step scores'
        spread within each window ÷ √steps (all in log); computed once per decision."""
        terms: dict[int, list[list[float]]] = {}
        for rank in {r for w in history for r in w}:
            series = [math.log(window_score(w[rank])) for w in history if rank in w]
            center = statistics.median(series)
            between = [abs(x - center) for x in series] if len(series) >= 2 else []
            within = []
            for steps in (w[rank] for w in history if len(w.get(rank, ())) >= 2):
                middle = statistics.median(steps)
                within.append(statistics.median(abs(x - middle) for x in steps)
                              / math.sqrt(len(steps)))
            terms[rank] = [between, within]
        return terms

    def noise(self, history: Sequence[Window], rank: int,
              terms: Mapping[int, list[list[float]]] | None = None) -> float:
        """σ of one window's log score, from the other ranks' recent windows (see module doc)."""
        terms = self.noise_terms(history) if terms is None else terms
        sigmas = []
        for part in (0, 1):
            pooled = [x for other, t in terms.items() if other != rank for x in t[part]]
            if pooled:
                sigmas.append(MAD_TO_SIGMA * statistics.median(pooled))
        return max(sigmas + [NOISE_FLOOR])

    def slow_ranks(self, history: Sequence[Window]) -> dict[int, float]:
        """{rank: score of the steps of the k windows that flagged it}."""
        recent = list(history)[-self.windows:]
        if len(recent) < MIN_WINDOWS:
            return {}
        terms = self.noise_terms(list(history)[-NOISE_WINDOWS:])
        out = {}
        for rank in recent[-1]:
            sigma = self.noise(history, rank, terms)
            for k in range(MIN_WINDOWS, len(recent) + 1):
                if not all(rank in w for w in recent[-k:]):
                    break
                level = window_score(x for w in recent[-k:] for x in w[rank])
                if math.log(level) < min(math.log(self.threshold), -self.z * sigma / math.sqrt(k)):
                    out[rank] = level
                    break
        return out

    def make_decision(self, history: Sequence[Window]) -> StragglerDecision:
        """`history`: per window {rank: step log scores}, oldest first; the recent ones matter."""
        if len(history) < MIN_WINDOWS:
            return StragglerDecision("none", reason=f"{len(history)} of {MIN_WINDOWS} windows")
        slow = self.slow_ranks(history)
        if not slow:
            return StragglerDecision("none", reason="every rank within the threshold and noise")
        found = tuple((r, round(window_score(history[-1][r]), 4)) for r in sorted(slow))
        listed = ", ".join(f"rank {r} ({slow[r]:.2f})" for r, _ in found)
        return StragglerDecision(self.action, found, f"{listed} below {self.threshold} × the "
                                 f"others over the last {MIN_WINDOWS}-{self.windows} windows, "
                                 "beyond the noise")


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

    def __init__(self, threshold: float = 0.9, action: str = "alert",
                 heartbeat_interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 min_steps: int = MIN_WINDOW_STEPS) -> None:
        self.policy = StragglerPolicy(threshold, action)
        self.window_s = WINDOW_HEARTBEATS * heartbeat_interval_s
        self.min_steps, self.clock = min_steps, clock
        self.scores: dict[int, float] = {}  # latest window's score per rank (the metric)
        self.flagged: set[int] = set()
        self.windows_closed = 0
        self.history: deque[dict[int, tuple[float, ...]]] = deque(maxlen=NOISE_WINDOWS)
        self._window: _Window | None = None
        self._seen: set[int] = set()  # ranks whose warm-up step was skipped

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
        """Geometric mean of the rank's last `WINDOWS` window scores (1.0 if unmeasured)."""
        recent = [x for w in list(self.history)[-self.policy.windows:] for x in w.get(rank, ())]
        return window_score(recent) if recent else 1.0

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
            for rank, score in step_scores(rates).items():
                per_rank.setdefault(rank, []).append(score)
        self.scores = {rank: window_score(s) for rank, s in per_rank.items()}
        self.windows_closed += 1
        self.history.append({rank: tuple(s) for rank, s in per_rank.items()})
        decision = self.policy.make_decision(self.history)
        current = {rank for rank, _ in decision.stragglers}
        # An episode ends when the rank's recent mean score is back above the threshold, so one
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
