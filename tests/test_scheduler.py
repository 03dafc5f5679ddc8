"""The scheduler's policy as tables: one snapshot in, the decisions out (no Ray, no threads)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from tenax.orchestrator.job.job_policy import JobAction
from tenax.orchestrator.job.scaling_policy import allotted_capacity, preempt_decision
from tenax.orchestrator.placement.capacity import Capacity
from tenax.orchestrator.service.scheduling_policy import (Cluster, JobView, SchedulingSnapshot,
                                                          decide, never_fits)
from tenax.orchestrator.service.scheduling_policy import SchedulingAction as A

TWO_BY_TWO = Cluster((2, 2))


def queued(job_id: str, order: float, priority: int = 0, nodes: int = 1, min_nodes: int = 0,
           g: int = 2, **kw) -> JobView:
    return JobView(job_id, priority, order, g, min_nodes or nodes, nodes, **kw)


def running(job_id: str, order: float, allotted: int, priority: int = 0, nodes: int = 0,
            min_nodes: int = 0, g: int = 2, holds: int | None = None, **kw) -> JobView:
    return JobView(job_id, priority, order, g, min_nodes or allotted, nodes or allotted, True,
                   allotted, allotted if holds is None else holds, **kw)


def kinds(decisions) -> list[tuple[str, str, int]]:
    return [(d.action, d.job_id, d.nodes) for d in decisions if d.action != A.WAIT] + \
        [(A.WAIT, d.job_id, d.position) for d in decisions if d.action == A.WAIT]


CASES = {
    "fits: admitted with its target": (
        [queued("a", 1, nodes=2)], [(A.ADMIT, "a", 2)]),
    "elastic job admitted with what is free (>= min_nodes)": (
        [running("x", 0, 1), queued("a", 1, nodes=2, min_nodes=1)], [(A.ADMIT, "a", 1)]),
    "larger than the free GPUs: waits, first in line": (
        [running("x", 0, 1), queued("a", 1, nodes=2)], [(A.WAIT, "a", 1)]),
    "priority first, then submission order": (
        [running("x", 0, 2), queued("late", 2), queued("early", 1), queued("urgent", 3,
                                                                           priority=5)],
        [(A.WAIT, "urgent", 1), (A.WAIT, "early", 2), (A.WAIT, "late", 3)]),
    "the head reserves: a small job behind a big one does not jump it": (
        [running("x", 0, 1), queued("big", 1, nodes=2), queued("small", 2, g=1)],
        [(A.WAIT, "big", 1), (A.WAIT, "small", 2)]),
    "never fits: refused": (
        [queued("huge", 1, g=4)], [(A.REFUSE, "huge", 0)]),
    "waited past queue_timeout_s: expires": (
        [running("x", 0, 2), queued("a", 1, queued_s=31.0, queue_timeout_s=30.0)],
        [(A.EXPIRE, "a", 0)]),
    "higher priority shrinks a lower elastic job toward min_nodes": (
        [running("elastic", 0, 2, min_nodes=1), queued("urgent", 1, priority=10)],
        [(A.SHRINK, "elastic", 1), (A.WAIT, "urgent", 1)]),
    "equal priority never shrinks": (
        [running("elastic", 0, 2, min_nodes=1), queued("same", 1)], [(A.WAIT, "same", 1)]),
    "non-elastic, non-preemptible: left alone": (
        [running("fixed", 0, 2), queued("urgent", 1, priority=10)], [(A.WAIT, "urgent", 1)]),
    "preemptible lower job is preempted when shrinking is not enough": (
        [running("pre", 0, 2, preemptible=True), queued("urgent", 1, priority=10, nodes=2)],
        [(A.PREEMPT, "pre", 0), (A.WAIT, "urgent", 1)]),
    "not enough even with everything lower: nothing is taken": (
        [running("elastic", 0, 2, min_nodes=1), running("fixed", 0, 0, g=2, priority=20),
         queued("urgent", 1, priority=10, nodes=2)],
        [(A.WAIT, "urgent", 1)]),
    "a shrink in flight is not repeated; the job waits for the release": (
        [running("elastic", 0, 1, min_nodes=1, nodes=2, holds=2), queued("urgent", 1, priority=10)],
        [(A.WAIT, "urgent", 1)]),
    "after the shrink the urgent job is admitted": (
        [running("elastic", 0, 1, min_nodes=1, nodes=2), queued("urgent", 1, priority=10)],
        [(A.ADMIT, "urgent", 1)]),
    "free GPUs nobody waits for: the shrunk job grows back": (
        [running("elastic", 0, 1, min_nodes=1, nodes=2)], [(A.GROW, "elastic", 2)]),
    "no growth while someone waits": (
        [running("elastic", 0, 1, min_nodes=1, nodes=2), running("fixed", 0, 1),
         queued("a", 1, nodes=2)], [(A.WAIT, "a", 1)]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_policy_table(name: str) -> None:
    jobs, want = CASES[name]
    got = kinds(decide(SchedulingSnapshot(tuple(jobs), TWO_BY_TWO)))
    assert sorted(got) == sorted(want), name


def test_every_decision_says_why_and_a_waiting_job_says_what_it_waits_for() -> None:
    jobs = (running("x", 0, 2), queued("a", 1, nodes=2))
    (wait,) = decide(SchedulingSnapshot(jobs, TWO_BY_TWO))
    assert wait.action == A.WAIT and wait.position == 1 and wait.missing_gpus == 4
    assert "waiting for 4 GPU(s)" in wait.reason and "held by x (4)" in wait.reason
    refused = never_fits(queued("huge", 1, g=4, min_nodes=1), TWO_BY_TWO)
    assert "resources.gpus_per_node=4" in refused and "2, 2" in refused
    assert never_fits(queued("huge", 1, g=4), Cluster((2, 2), largest=(8, 8))) is None


def test_the_jobs_side_capacity_cap_and_preemption_stop() -> None:
    assert allotted_capacity(Capacity(2), lambda: 1).nodes == 1
    assert allotted_capacity(Capacity(2), lambda: 3).nodes == 2
    assert allotted_capacity(Capacity(2), None).nodes == 2
    assert preempt_decision("RUNNING", True, "room", False).action == JobAction.RESCALE
    assert preempt_decision("RESCALING", True, "room", False) is None
    assert preempt_decision("PLACING", True, "room", False).action == JobAction.CANCEL
    assert preempt_decision("RUNNING", True, "", False) is None
    assert preempt_decision("RUNNING", True, "room", True) is None  # a user cancel wins
    assert "preempted: room" in preempt_decision("PLACING", False, "room", False).reason
    assert replace(running("x", 0, 1), holds=2).held_gpus == 4
