"""The preflight's rows: what one check measured, what it expected, and its verdict.

Each check is a pure function of what was measured (the scratch job's records, the planner's
estimate, the data it read), so the verdict rules can be tested without starting a job.
"""
from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

logger = logging.getLogger(__name__)

VERDICTS = ("pass", "warn", "fail")
# Memory: a measured peak above this share of the budget leaves too little headroom for a long
# run (fragmentation, a bigger validation batch, a checkpoint's staging buffers).
MEMORY_WARN_SHARE = 0.9
# On CUDA the allocator's peak is comparable to the planner's figure: more than this factor
# above it means the planner (and so the layout choice) misjudges the job.
CUDA_ESTIMATE_FACTOR = 1.25
# Progress: a rank slower than this share of the median rank's throughput is a straggler.
SLOW_RANK_SHARE = 0.5
GIB = 2 ** 30
# Recovery: the loss of a step trained from a loaded state vs the uninterrupted one (relative:
# a resharded layout reduces in another order).
LOSS_RTOL = 1e-5


@dataclass
class Row:
    """One check's result; `measured` and `expected` are short human strings."""
    name: str
    measured: str
    expected: str
    verdict: str  # pass | warn | fail
    detail: str = ""

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict: {self.verdict!r} is not one of {', '.join(VERDICTS)}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def overall(rows: list[Row]) -> str:
    """The worst verdict of the rows ("pass" for none)."""
    worst = max((VERDICTS.index(r.verdict) for r in rows), default=0)
    return VERDICTS[worst]


def gib(n_bytes: float) -> str:
    return f"{n_bytes / GIB:.3g} GiB"


def memory_plan_row(expected_bytes: float, budget_bytes: float, layout: str) -> Row:
    """Before any rank starts: the planner's per-rank figure for the layout vs the budget."""
    expected = f"<= {gib(budget_bytes)} per rank"
    if expected_bytes > budget_bytes:
        return Row("memory", f"planner {gib(expected_bytes)} per rank", expected, "fail",
                   f"{layout}: the planner's per-rank memory exceeds the per-rank budget; "
                   f"the job was not started")
    return Row("memory", f"planner {gib(expected_bytes)} per rank", expected, "pass", layout)


def memory_row(peaks: dict[int, int], expected_bytes: float, budget_bytes: float,
               cuda: bool, layout: str) -> Row:
    """After the smoke steps: every rank's peak vs the budget and (CUDA) the planner's figure.

    On CPU the peak is the process's resident set (interpreter, torch and the data included),
    so only the budget judges it; the planner's figure is shown for reference."""
    what = "peak allocated" if cuda else "peak RSS"
    expected = f"planner {gib(expected_bytes)}, budget {gib(budget_bytes)}"
    if not peaks:
        return Row("memory", "no step records", expected, "fail", "no rank reported a step")
    rank, peak = max(peaks.items(), key=lambda kv: kv[1])
    measured = f"{what} {gib(peak)} (rank {rank}, max of {len(peaks)})"
    if peak > budget_bytes:
        return Row("memory", measured, expected, "fail",
                   f"{layout}: rank {rank} exceeds the per-rank budget")
    if peak > MEMORY_WARN_SHARE * budget_bytes:
        return Row("memory", measured, expected, "warn",
                   f"{layout}: rank {rank} uses over {MEMORY_WARN_SHARE:.0%} of its budget")
    if cuda and peak > CUDA_ESTIMATE_FACTOR * expected_bytes:
        return Row("memory", measured, expected, "warn",
                   f"{layout}: the planner underestimates rank {rank} by "
                   f"{peak / max(expected_bytes, 1.0):.2f}x")
    return Row("memory", measured, expected, "pass", layout)


def loss_trend(losses: list[float]) -> tuple[float, float]:
    """Mean loss of the first and of the last quarter of the steps (at least one step each)."""
    q = max(1, len(losses) // 4)
    return sum(losses[:q]) / q, sum(losses[-q:]) / q


def progress_row(losses: list[float], steps: int, ended: str, cause: str,
                 failures: Sequence[Mapping[str, Any]] = ()) -> Row:
    """N steps without a hang or failure, and the loss falling (first vs last quarter).
    `failures`: the scratch job's `failure` events; any one fails the row, naming its rank,
    kind and (a hang) where its stacks are kept."""
    expected = f"{steps} steps, loss falling"
    if failures:
        return Row("progress", f"{len(losses)} of {steps} steps", expected, "fail",
                   "; ".join(failure_words(f) for f in failures))
    if ended != "SUCCEEDED" or len(losses) < steps:
        return Row("progress", f"{len(losses)} of {steps} steps", expected, "fail",
                   f"the job ended {ended}" + (f": {cause}" if cause else ""))
    if not all(math.isfinite(x) for x in losses):
        return Row("progress", f"{steps} steps", expected, "fail", "a loss is not finite")
    first, last = loss_trend(losses)
    measured = f"{steps} steps, loss {first:.4g} -> {last:.4g}"
    if last >= first:
        return Row("progress", measured, expected, "warn",
                   "the loss did not fall (mean of the first vs the last quarter of the steps)")
    return Row("progress", measured, expected, "pass", "")


def failure_words(event: Mapping[str, Any]) -> str:
    """One `failure` event as the progress row names it: its ranks, kind, step and cause,
    the rank its stacks single out (`odd`, when read) and where they are kept."""
    ranks = list(event.get("ranks") or [event.get("rank", "?")])
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    kind = f" ({event['kind']})" if event.get("kind") else ""
    text = (f"{who} failed{kind} at step {event.get('step', '?')}: "
            f"{event.get('cause', 'no cause given')}")
    if event.get("odd"):
        text += f"; the stacks single out rank {', '.join(map(str, event['odd']))}"
    if event.get("diagnostics"):
        text += f"; stacks: tenax diagnose {event['diagnostics']}"
    return text


def slow_ranks(rank_tokens_per_s: dict[int, float]) -> list[int]:
    """Ranks below SLOW_RANK_SHARE of the median rank's throughput."""
    if not rank_tokens_per_s:
        return []
    ordered = sorted(rank_tokens_per_s.values())
    median = ordered[len(ordered) // 2]
    return sorted(r for r, v in rank_tokens_per_s.items() if v < SLOW_RANK_SHARE * median)


def throughput_row(rank_tokens_per_s: dict[int, float], planner_tokens_per_s: float | None,
                   nodes: list[str] | None = None) -> Row:
    """Per-rank throughput over the smoke steps; a rank far below the median warns, naming
    it and (`nodes`: per rank) its node. `planner_tokens_per_s`: the job's, for reference;
    None on CPU ranks, which the planner prices as GPUs."""
    expected = (f"planner {planner_tokens_per_s:.4g} tok/s (job)"
                if planner_tokens_per_s is not None
                else "each rank vs the median rank (no planner figure for cpu)")
    if not rank_tokens_per_s:
        return Row("throughput", "no step records", expected, "fail", "no rank reported a step")
    ordered = sorted(rank_tokens_per_s.values())
    median = ordered[len(ordered) // 2]
    slow = {r: rank_tokens_per_s[r] for r in slow_ranks(rank_tokens_per_s)}
    measured = (f"median {median:.4g} tok/s per rank (min {ordered[0]:.4g}, "
                f"max {ordered[-1]:.4g})")
    if slow:
        return Row("throughput", measured, expected, "warn",
                   "slow ranks: " + ", ".join(f"{r} ({v:.4g})" for r, v in sorted(slow.items()))
                   + _on_nodes(sorted(slow), nodes))
    return Row("throughput", measured, expected, "pass", f"{len(ordered)} ranks")


def _on_nodes(ranks: list[int], nodes: list[str] | None) -> str:
    if not nodes:
        return ""
    names = sorted({nodes[r] for r in ranks if r < len(nodes)})
    return f" on {', '.join(names)}" if names else ""


def same_loss(got: float, want: float) -> bool:
    """Equal within LOSS_RTOL relative (another layout sums in another order)."""
    return abs(got - want) <= LOSS_RTOL * max(abs(want), 1e-12)


def recovery_row(saved_step: int, problems: list[str], resumed_from: int | None,
                 loss_resumed: float | None, loss_reference: float | None,
                 into: str = "") -> Row:
    """A checkpoint saved, verified by the catalog, and loaded (`into`: the layout it was
    loaded into and the one it was saved from): the step after it, trained from the loaded
    state, has the loss the uninterrupted job had (LOSS_RTOL relative)."""
    where = f" into {into}" if into else ""
    expected = (f"step {saved_step} verified, resumed{where}, same loss at step "
                f"{saved_step + 1}")
    if problems:
        return Row("recovery", f"step {saved_step} damaged", expected, "fail", problems[0])
    if resumed_from != saved_step or loss_resumed is None or loss_reference is None:
        return Row("recovery", f"resumed from {resumed_from}", expected, "fail",
                   f"the resumed job did not load step {saved_step} and train one step")
    gap = abs(loss_resumed - loss_reference) / max(abs(loss_reference), 1e-12)
    measured = f"loss {loss_resumed:.6g} vs {loss_reference:.6g} (rel diff {gap:.2g})"
    if not same_loss(loss_resumed, loss_reference):
        return Row("recovery", measured, expected, "fail",
                   "the loaded state trains differently from the state it was saved from")
    return Row("recovery", measured, expected, "pass",
               f"storage step {saved_step} loaded{where}" if into else "")


def memory_restore(source: str | None, step: int | None, losses: Mapping[int, float],
                   reference: Mapping[int, float], off: str = "") -> tuple[str, str]:
    """(verdict, words) of the in-memory snapshot check: a rank killed mid-run, the job
    resumed from the agents' snapshots (`source` "memory"), and every step it trained has the
    loss the uninterrupted job had. `off`: why the job's snapshots were switched off."""
    if off:
        return "warn", f"in-memory snapshots were off ({off}): none restored"
    if source != "memory":
        return "fail", (f"the killed rank's job resumed from {source or 'no checkpoint'}, "
                        f"not from an in-memory snapshot")
    bad = [s for s in sorted(reference) if s not in losses
           or not same_loss(losses[s], reference[s])]
    if bad:
        s = bad[0]
        return "fail", (f"after the in-memory restore of step {step}, step {s} has loss "
                        f"{losses.get(s, 'missing')} instead of {reference[s]:.6g}")
    return "pass", (f"in-memory snapshot of step {step} restored after a kill, steps "
                    f"{min(reference)}-{max(reference)} equal")


def with_memory(row: Row, verdict: str, words: str, checked: bool = True) -> Row:
    """The recovery row with the in-memory snapshot check's verdict and words added.
    `checked`: the check ran (else the expected column does not promise a restore)."""
    worst = overall([row, Row(row.name, "", "", verdict)])
    expected = f"{row.expected}; one in-memory snapshot restored" if checked else row.expected
    return Row(row.name, row.measured, expected, worst,
               "; ".join(w for w in (row.detail, words) if w))
