"""What the planner returns: a step-time breakdown, one estimated layout, the plan, its error.

Separate from the search (planner.py) because the CLI, the controller and the benches read
these results without running a search, and because every figure a user sees — memory per
GPU, step time, tokens/s, MFU, warnings — is derived here in one place.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

from tenax.parallel.bubble import bubble_fraction, bubble_time
from tenax.parallel.cost_model import MemoryLedger, gib
from tenax.parallel.layout import ParallelLayout

logger = logging.getLogger(__name__)

ZERO_PREFERENCE = (1, 2, 0, 3)
NEAR_MISS = 1.5  # a faster layout that needs up to 1.5x the budget is worth showing
PART_LABELS = {"compute_s": "compute", "tp_comm_s": "TP comm", "dp_comm_s": "exposed DP comm",
               "pp_comm_s": "PP p2p", "ep_comm_s": "EP all-to-all", "cp_comm_s": "CP ring",
               "bubble_s": "pipeline bubble"}


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    tp_comm_s: float = 0.0
    dp_comm_s: float = 0.0
    pp_comm_s: float = 0.0
    ep_comm_s: float = 0.0
    cp_comm_s: float = 0.0
    bubble_s: float = 0.0

    @property
    def total_s(self) -> float:
        return sum(vars(self).values())

    def to_dict(self) -> dict[str, float]:
        return {**vars(self), "total_s": self.total_s}


@dataclass(frozen=True)
class Estimate:
    layout: ParallelLayout
    recompute: str
    microbatches: int
    memory: MemoryLedger
    time: StepTime
    budget_bytes: float
    tokens_per_step: int
    reason: str = ""                # why it was chosen, or why it lost to the chosen one
    flops_per_step: float = 0.0     # model FLOPs of one step (6N + attention, recompute excluded)
    peak_flops: float = 0.0         # dense peak of all the GPUs together
    warnings: tuple[str, ...] = field(default_factory=tuple)  # soft rules it breaks, with cost

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.time.total_s if self.time.total_s else 0.0

    @property
    def mfu(self) -> float:
        """Model FLOPs per second / peak: 6*N*tokens/s (+ attention) over the GPUs' peak."""
        if not (self.peak_flops and self.time.total_s):
            return 0.0
        return self.flops_per_step / self.time.total_s / self.peak_flops

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.budget_bytes

    def key(self) -> tuple[Any, ...]:
        lay = self.layout
        return (float(f"{self.time.total_s:.4g}"), lay.pp, lay.tp, lay.cp, lay.ep,
                ZERO_PREFERENCE.index(lay.zero), -lay.micro_batch_size, lay.pp_virtual_stages)

    def to_dict(self) -> dict[str, Any]:
        total = self.time.total_s
        return {"layout": self.layout.to_dict(), "describe": self.layout.describe(),
                "recompute": self.recompute, "microbatches": self.microbatches,
                "fits": self.fits, "memory": self.memory.to_dict(),
                "step_time": self.time.to_dict(),
                "bubble_fraction": self.time.bubble_s / total if total else 0.0,
                "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
                "memory_per_gpu_gib": round(gib(self.memory.total), 3),
                "warnings": list(self.warnings), "reason": self.reason}


@dataclass(frozen=True)
class PlanResult:
    best: Estimate
    runners_up: list[Estimate]
    rejected: dict[str, int]        # candidates dropped, by rule
    considered: int                 # candidates estimated
    request: dict[str, Any]         # gpus, gpus_per_node, global_batch_size, seq_len, fixed
    hardware: dict[str, Any] = field(default_factory=dict)  # the GPU figures planned with

    @property
    def layout(self) -> ParallelLayout:
        return self.best.layout

    def to_dict(self) -> dict[str, Any]:
        return {**self.request, "memory_budget_gib": round(gib(self.best.budget_bytes), 3),
                "layout": self.layout.to_dict(), "recompute": self.best.recompute,
                "reason": self.best.reason, "estimate": self.best.to_dict(),
                "runners_up": [r.to_dict() for r in self.runners_up],
                "rejected": dict(self.rejected), "considered": self.considered,
                "warnings": list(self.best.warnings), "hardware": self.hardware,
                "chosen": {"memory_per_gpu_gib": round(gib(self.best.memory.total), 3),
                           "step_time_s": self.best.time.total_s,
                           "tokens_per_s": self.best.tokens_per_s, "mfu": self.best.mfu}}


def why_lost(e: Estimate, best: Estimate) -> str:
    if not e.fits:
        return f"does not fit: {gib(e.memory.total):.1f} GiB > {gib(e.budget_bytes):.1f} GiB"
    if e.key()[0] == best.key()[0]:
        return (f"tie at {best.time.total_s:.4g} s; tie-break prefers smaller pp/tp/cp/ep, "
                f"then ZeRO-1, 2, 0, 3, then the larger micro-batch")
    mine, theirs = vars(e.time), vars(best.time)
    part = max(mine, key=lambda k: mine[k] - theirs[k])  # the cause that grew the most
    label = PART_LABELS[part] + (f", recompute={e.recompute}" if part == "compute_s" else "")
    return f"slower: {e.time.total_s:.4g} s vs {best.time.total_s:.4g} s (more {label})"


def choose_best(found: list[Estimate]) -> tuple[Estimate, list[Estimate]]:
    per_layout: dict[tuple[ParallelLayout, bool], Estimate] = {}
    for e in sorted(found, key=Estimate.key):  # per set of degrees: best fitting, best not fitting
        per_layout.setdefault((replace(e.layout, micro_batch_size=1, zero=1), e.fits), e)
    ranked = list(per_layout.values())
    fitting = [e for e in ranked if e.fits]
    best = fitting[0]
    near_misses = [e for e in ranked if not e.fits and e.time.total_s < best.time.total_s
                   and e.memory.total <= NEAR_MISS * e.budget_bytes][:2]
    others = sorted(fitting[1:5] + near_misses, key=Estimate.key)
    return best, [replace(e, reason=why_lost(e, best)) for e in others]


def soft_warnings(lay: ParallelLayout, m: int) -> list[str]:
    """Rules of thumb a layout breaks, each with what it costs (they never refuse a layout)."""
    if lay.pp == 1 or m >= 4 * lay.pp:
        return []
    now = bubble_fraction(bubble_time(lay.pp_schedule, lay.pp, virtual=lay.pp_virtual_stages), m)
    good = bubble_fraction(bubble_time(lay.pp_schedule, lay.pp, virtual=lay.pp_virtual_stages),
                           4 * lay.pp)
    return [f"pipeline bubble {100 * now:.0f}% with {m} micro-batches; {4 * lay.pp} would give "
            f"{100 * good:.0f}% (raise train.global_batch_size or lower micro_batch_size)"]
