"""The job's states, the transition table the controller executes, and each state's deadline.

Why a table: the controller's only job is to execute decisions, so which state a decision
leads to must not be scattered through `if` branches. `TRANSITIONS[state][action]` is the
whole state machine; the controller looks the next state up and refuses any pair that is not
in it. The diagram in the controller's docstring is `state_diagram()`'s output, and a test
checks that the two agree, so the picture cannot drift from the code.

Deadlines: every non-terminal state has a bound taken from the job's `Timeouts` (derived once
from the spec's `fault_tolerance` fields, `tenax.orchestrator.timeouts`) and a way out when it
passes (`DEADLINES`), so no wait is unbounded:
- PENDING and RECOVERING decide in one pass (RECOVERING's node probes run concurrently and are
  bounded by `heartbeat_timeout_s`);
- PLACING's placement and start calls each time out after STARTUP_HANG_FACTOR ×
  `hang_timeout_s`, and a timeout is a failure (restart or fail);
- RUNNING: a rank whose step does not advance for `hang_timeout_s` (twice that while starting)
  or whose heartbeat is silent for `heartbeat_timeout_s` is a failure;
- RESCALING: the ranks must commit the boundary checkpoint and stop within
  STARTUP_HANG_FACTOR × `hang_timeout_s`, or it is a failure (restart or fail).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import Enum
from typing import Callable

from tenax.orchestrator.job.job_policy import JobAction
from tenax.orchestrator.timeouts import Timeouts

logger = logging.getLogger(__name__)


class JobState(str, Enum):
    PENDING = "PENDING"
    PLACING = "PLACING"
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"
    RESCALING = "RESCALING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


S, A = JobState, JobAction
TRANSITIONS: dict[JobState, dict[JobAction, JobState]] = {
    S.PENDING: {A.SUBMIT: S.PLACING, A.CANCEL: S.CANCELLED},
    S.PLACING: {A.START: S.RUNNING, A.RESTART: S.RECOVERING, A.FAIL: S.FAILED,
                A.CANCEL: S.CANCELLED},
    S.RUNNING: {A.CONTINUE: S.RUNNING, A.SUCCEED: S.SUCCEEDED, A.RESTART: S.RECOVERING,
                A.FAIL: S.FAILED, A.RESCALE: S.RESCALING, A.CANCEL: S.CANCELLED},
    S.RESCALING: {A.CONTINUE: S.RESCALING, A.SUCCEED: S.SUCCEEDED, A.REPLAN: S.PLACING,
                  A.RESTART: S.RECOVERING, A.FAIL: S.FAILED, A.CANCEL: S.CANCELLED},
    S.RECOVERING: {A.CONTINUE: S.RECOVERING, A.REPLAN: S.PLACING, A.CANCEL: S.CANCELLED},
}


def next_state(state: JobState, action: JobAction) -> JobState:
    """The table's answer; a ValueError names the pair the table does not allow."""
    try:
        return TRANSITIONS[state][action]
    except KeyError:
        raise ValueError(f"transition: action {action.value!r} is not allowed in state "
                         f"{state.value}") from None


@dataclass(frozen=True)
class Deadline:
    """How long a state may last (one of the job's `Timeouts`) and where its end leads."""
    seconds: Callable[[Timeouts], float]
    way_out: str


EXHAUSTED = "RECOVERING, or FAILED when restarts are exhausted"
DEADLINES: dict[JobState, Deadline] = {
    S.PENDING: Deadline(lambda t: 0.0, "PLACING at once"),
    S.PLACING: Deadline(lambda t: t.startup_s, f"placement error: {EXHAUSTED}"),
    S.RUNNING: Deadline(lambda t: t.hang_timeout_s, f"a rank without progress: {EXHAUSTED}"),
    S.RESCALING: Deadline(lambda t: t.startup_s, f"ranks that did not stop: {EXHAUSTED}"),
    S.RECOVERING: Deadline(lambda t: t.probe_s,
                           "unanswered node probes count as lost nodes: PLACING"),
}


def state_deadline_s(state: JobState, timeouts: Timeouts) -> float:
    """The state's deadline in seconds (0 for a terminal state: nothing is waited for)."""
    return 0.0 if state.terminal else DEADLINES[state].seconds(timeouts)


def state_diagram() -> str:
    """One line per state, `STATE | action -> NEXT, ...` in table order; CONTINUE (stay) and
    CANCEL (allowed in every non-terminal state) get one line of their own at the end."""
    lines = []
    for state, moves in TRANSITIONS.items():
        arrows = ", ".join(f"{action.value} -> {target.value}" for action, target in moves.items()
                           if target != state and action != JobAction.CANCEL)
        lines.append(f"{state.value:<10} | {arrows}")
    cancellable = all(moves.get(JobAction.CANCEL) == JobState.CANCELLED
                      for moves in TRANSITIONS.values())
    lines.append(f"{'any':<10} | cancel -> CANCELLED" if cancellable else "")
    return "\n".join(line for line in lines if line)
