"""Pipeline bubble: idle time per step of each pipeline schedule, and its share of the step.

Closed form like the rest of the cost model (DeepSeek-V3, Table 2); its own module because the
CLI's `tenax plan bubble` and the planner's step time both need it without the memory and
communication formulas.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name}: {value!r} must be > 0")


# ---- pipeline bubble -----------------------------------------------------------------------
BUBBLE_LABELS = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved 1F1B",
                 "zero_bubble": "ZB1P", "dualpipe": "DualPipe"}


@dataclass(frozen=True)
class Bubble:
    schedule: str
    bubble: float
    fraction: float

    def to_dict(self) -> dict[str, Any]:
        return {"schedule": self.schedule, "label": BUBBLE_LABELS[self.schedule],
                "bubble": self.bubble, "fraction": self.fraction}


def bubble_time(schedule: str, pp: int, F: float = 1.0, B: float = 2.0, W: float = 0.5,
                FB: float = 2.0, virtual: int = 1) -> float:
    """Idle time per step (DeepSeek-V3 Table 2); B is the whole backward, W its weight part.

    GPipe, 1F1B: (p-1)(F+B); interleaved 1F1B: (p-1)(F+B)/v; ZB1P: (p-1)(F+B-2W);
    DualPipe: (p/2-1)(F&B+B-3W), F&B = one overlapped forward+backward chunk (needs even p).
    Negative values (W too large for the formula) are clamped to 0.
    """
    _positive(pp=pp, F=F, B=B, FB=FB, virtual=virtual)
    if not 0 <= W <= B:
        raise ValueError(f"W: {W!r} must lie in [0, B={B}] (it is part of the backward)")
    if schedule in ("gpipe", "1f1b"):
        out = (pp - 1) * (F + B)
    elif schedule == "interleaved_1f1b":
        out = (pp - 1) * (F + B) / virtual
    elif schedule == "zero_bubble":
        out = (pp - 1) * (F + B - 2 * W)
    elif schedule == "dualpipe":
        if pp % 2:
            raise ValueError(f"dualpipe needs an even pp, got {pp}")
        out = (pp / 2 - 1) * (FB + B - 3 * W)
    else:
        raise ValueError(f"schedule: {schedule!r} must be one of {tuple(BUBBLE_LABELS)}")
    return max(0.0, out)


def bubble_fraction(bubble: float, microbatches: int, F: float = 1.0, B: float = 2.0) -> float:
    """bubble / (m(F+B) + bubble): the share of a step the stage sits idle."""
    _positive(microbatches=microbatches)
    return bubble / (microbatches * (F + B) + bubble)


def bubble_table(pp: int, microbatches: int, virtual: int = 1, F: float = 1.0, B: float = 2.0,
                 W: float = 0.5, FB: float = 2.0) -> dict[str, Bubble]:
    """Every schedule for `tenax plan bubble`; DualPipe only when pp is even."""
    out = {}
    for schedule in BUBBLE_LABELS:
        if schedule == "dualpipe" and pp % 2:
            continue
        t = bubble_time(schedule, pp, F, B, W, FB, virtual)
        out[schedule] = Bubble(schedule, t, bubble_fraction(t, microbatches, F, B))
    return out
