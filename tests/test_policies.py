"""Pure decisions: no Ray needed. Every policy decision is a table row here,
including the ones that used to live in the controller (eviction, node loss, restart-or-fail,
the RESCALING wait), and the transition table is checked for deadlines and ways out."""
from __future__ import annotations

import inspect
from dataclasses import replace
from pathlib import Path

import pytest

from tenax.orchestrator.job.health import StragglerFlag
from tenax.orchestrator.job.job_policy import (PEER_LOSS_GRACE_S, EvictionPolicy, FailurePolicy,
                                               JobAction, JobSnapshot, Limits, NodeLossPolicy,
                                               decide, peer_loss)
from tenax.orchestrator.job.scaling_policy import ScalingPolicy
from tenax.orchestrator.placement.capacity import Capacity
from tenax.orchestrator.job.states import (DEADLINES, TRANSITIONS, JobState, next_state,
                                           state_diagram)
from tenax.orchestrator.placement.worker_group import RankHealth
from tenax.orchestrator.spec import load_spec
from tenax.orchestrator.timeouts import Timeouts

LIMITS = Limits(max_restarts=3, gpus_per_node=2, min_nodes=1, max_nodes=4,
                timeouts=Timeouts(heartbeat_timeout_s=5.0, hang_timeout_s=30.0))


def rank(r: int, **kw) -> RankHealth:
    base = dict(rank=r, node_id=f"n{r // 2}", dead=None, heartbeat_age_s=0.1, state="training",
                step=5, step_age_s=0.2, error=None)
    return RankHealth(**{**base, **kw})


def snap(*ranks: RankHealth, restarts: int = 0, max_restarts: int = 3, **kw) -> JobSnapshot:
    return JobSnapshot(tuple(ranks), restarts, replace(LIMITS, max_restarts=max_restarts), **kw)


def test_healthy_continues_and_all_done_succeeds():
    policy = FailurePolicy()
    assert policy.make_decision(snap(rank(0), rank(1))).action == JobAction.CONTINUE
    done = policy.make_decision(snap(rank(0, state="done"), rank(1, state="done")))
    assert done.action == JobAction.SUCCEED


def test_root_cause_first_over_collateral_errors():
    d = FailurePolicy().make_decision(snap(
        rank(0, state="failed", error="RuntimeError: Connection reset by peer"),
        rank(1, dead="ActorDiedError: killed")))
    assert d.action == JobAction.RESTART
    assert d.failed_ranks == (1, 0) and d.cause_kind == "dead"
    assert d.reason.startswith("rank 1 died")


def test_a_fresh_peer_loss_waits_a_moment_for_its_root_cause():
    """A killed rank's peer may report "connection closed" before the killed rank's agent
    reports the death: blaming the peer would name the wrong rank, so that symptom alone waits
    PEER_LOSS_GRACE_S; a real error, or the same symptom once older, restarts at once."""
    gloo = "RuntimeError: [pair.cc:534] Connection closed by peer [127.0.0.1]:4242"
    policy = FailurePolicy()
    fresh = snap(rank(0, state="failed", error=gloo, step_age_s=0.3), rank(1))
    assert policy.make_decision(fresh).action == JobAction.CONTINUE
    root = snap(rank(0, state="failed", error=gloo, step_age_s=0.3),
                rank(1, state="failed", error="rank process killed by signal SIGKILL"))
    d = policy.make_decision(root)
    assert (d.action, d.failed_ranks, d.cause_kind) == (JobAction.RESTART, (1, 0), "dead")
    old = snap(rank(0, state="failed", error=gloo, step_age_s=PEER_LOSS_GRACE_S + 0.1), rank(1))
    d = policy.make_decision(old)
    assert (d.action, d.failed_ranks, d.cause_kind) == (JobAction.RESTART, (0,), "error")
    real = snap(rank(0, state="failed", error="ValueError: bad batch", step_age_s=0.3), rank(1))
    assert policy.make_decision(real).action == JobAction.RESTART
    assert peer_loss("NCCL communicator was aborted on rank 3") and not peer_loss(None)
    # a crashed node's agents never report: once its raylet is found down, no need to wait
    crashed = snap(rank(0, state="failed", error=gloo, step_age_s=0.3), rank(2),
                   nodes_down=("n1",))
    assert policy.make_decision(crashed).action == JobAction.RESTART


def test_heartbeat_timeout_and_hang():
    d = FailurePolicy().make_decision(snap(rank(0), rank(1, heartbeat_age_s=5.5)))
    assert (d.action, d.cause_kind, d.failed_ranks) == (JobAction.RESTART, "heartbeat", (1,))
    assert "heartbeat_timeout_s=5.0" in d.reason
    d = FailurePolicy().make_decision(snap(rank(0, step_age_s=31.0), rank(1)))
    assert (d.cause_kind, d.failed_ranks) == ("hang", (0,))
    # starting ranks get twice the hang timeout (checkpoint loading)
    ok = FailurePolicy().make_decision(snap(rank(0, state="starting", step_age_s=50.0)))
    assert ok.action == JobAction.CONTINUE
    stuck = FailurePolicy().make_decision(snap(rank(0, state="starting", step_age_s=61.0)))
    assert stuck.cause_kind == "hang"


def test_max_restarts_exhausted_fails_with_cause():
    d = FailurePolicy().make_decision(snap(rank(0, dead="gone"), restarts=3, max_restarts=3))
    assert d.action == JobAction.FAIL
    assert "rank 0 died (gone)" in d.reason and "max_restarts=3 exhausted" in d.reason


def test_a_ranks_own_error_is_the_root_over_a_lower_ranks_peer_gone_symptom():
    d = FailurePolicy().make_decision(snap(
        rank(0, state="failed", error="RuntimeError: Connection closed by peer [127.0.0.1]:1"),
        rank(1, state="failed", error="ValueError: data.source: a token id outside")))
    assert d.action == JobAction.RESTART and d.failed_ranks == (1, 0)
    assert d.reason.startswith("rank 1 failed: ValueError")


def test_the_same_error_at_the_same_step_twice_is_not_restarted():
    """Bad data or config fails a rank the same way on every attempt: the second identical
    failure ends the job; anything else (another step, another error, a death, a peer-gone
    symptom) restarts as before."""
    from tenax.orchestrator.job.job_policy import own_error

    bad = "ValueError: data.source: a token id outside [0, model.vocab_size=512) in sample 77"
    failing = rank(1, state="failed", error=bad, step=7)
    first = FailurePolicy().make_decision(snap(rank(0), failing))
    assert first.action == JobAction.RESTART
    previous = own_error(first, (rank(0), failing))
    assert previous == (7, bad)
    again = FailurePolicy().make_decision(snap(rank(0), failing, restarts=1,
                                               previous_error=previous))
    assert again.action == JobAction.FAIL and again.failed_ranks[0] == 1
    assert bad in again.reason and "same error after step 7" in again.reason
    assert "2 of max_restarts=3 left" in again.reason
    later = rank(1, state="failed", error=bad, step=9)  # got further: not a replay
    assert FailurePolicy().make_decision(snap(later, restarts=1, previous_error=previous)
                                         ).action == JobAction.RESTART
    other = rank(1, state="failed", error="OSError: [Errno 5] Input/output error", step=7)
    assert FailurePolicy().make_decision(snap(other, restarts=1, previous_error=previous)
                                         ).action == JobAction.RESTART
    peer = "RuntimeError: Connection reset by peer"
    symptom = own_error(first, (rank(1, state="failed", error=peer, step=7),))
    assert symptom is None
    died = FailurePolicy().make_decision(snap(rank(1, dead="gone", step=7)))
    assert own_error(died, (rank(1, dead="gone", step=7),)) is None


def test_max_restarts_is_read_only_by_the_policies():
    """The job's restart budget (`fault_tolerance.max_restarts`, an attribute read) is read by
    the job policy alone; Ray's actor option of the same name (a keyword) is another thing."""
    root = Path(__file__).resolve().parents[1] / "orchestrator"
    readers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                     if ".max_restarts" in p.read_text()
                     and p.name not in ("spec.py", "presets.py"))
    assert readers == ["job/job_policy.py"], readers


# ---- decide(): one row per (state, facts) ------------------------------------------------------
RUNNING_ROWS = [
    ("healthy", [rank(0), rank(1)], {}, JobAction.CONTINUE),
    ("all done", [rank(0, state="done"), rank(1, state="done")], {}, JobAction.SUCCEED),
    ("one done, one training", [rank(0, state="done"), rank(1)], {}, JobAction.CONTINUE),
    ("killed rank", [rank(0), rank(1, dead="ActorDiedError")], {}, JobAction.RESTART),
    ("failed rank, restarts spent", [rank(0), rank(1, state="failed", error="x")],
     {"restarts": 3}, JobAction.FAIL),
    ("stopped without a request", [rank(0, state="stopped"), rank(1)], {}, JobAction.RESTART),
    ("target moved up, capacity there", [rank(0), rank(1)],
     {"target_nodes": 2, "current_nodes": 1, "capacity_nodes": 2}, JobAction.RESCALE),
    ("target moved, capacity not checked", [rank(0), rank(1)],
     {"target_nodes": 2, "current_nodes": 1, "capacity_nodes": 0}, JobAction.CONTINUE),
    ("target up, no node to grow on", [rank(0), rank(1)],
     {"target_nodes": 2, "current_nodes": 1, "capacity_nodes": 1}, JobAction.CONTINUE),
    ("scale down", [rank(0), rank(1), rank(2), rank(3)],
     {"target_nodes": 1, "current_nodes": 2, "capacity_nodes": 2}, JobAction.RESCALE),
    ("cancel wins over a failure", [rank(0, dead="x")], {"cancel_requested": True},
     JobAction.CANCEL),
]


@pytest.mark.parametrize("name, ranks, kw, action", RUNNING_ROWS, ids=[r[0] for r in RUNNING_ROWS])
def test_running_decisions(name, ranks, kw, action):
    restarts = kw.pop("restarts", 0)
    assert decide(snap(*ranks, restarts=restarts, state="RUNNING", **kw)).action == action


def test_pending_submits_and_every_state_can_be_cancelled():
    assert decide(snap(state="PENDING", target_nodes=2)).reason == \
        "submitted: target 2 node(s) x 2 GPUs"
    for state in TRANSITIONS:
        decision = decide(snap(rank(0), state=state.value, cancel_requested=True))
        assert decision.action == JobAction.CANCEL


RESCALING_ROWS = [
    ("all stopped", ["stopped", "stopped"], {}, JobAction.REPLAN),
    ("stopped and done", ["stopped", "done"], {}, JobAction.REPLAN),
    ("all finished the last step", ["done", "done"], {}, JobAction.SUCCEED),
    ("one still training", ["stopped", "training"], {}, JobAction.CONTINUE),
    ("one failed while stopping", ["stopped", "failed"], {}, JobAction.RESTART),
    ("one gone", ["stopped", "gone"], {}, JobAction.RESTART),
    ("one never stopped, deadline passed", ["stopped", "training"], {"state_age_s": 61.0},
     JobAction.RESTART),
    ("deadline passed, restarts spent", ["training", "training"],
     {"state_age_s": 61.0, "restarts": 3}, JobAction.FAIL),
]


def _ranks(states: list[str]) -> list[RankHealth]:
    out = []
    for r, s in enumerate(states):
        if s == "gone":
            out.append(rank(r, dead="ActorDiedError", state="training"))
        else:
            out.append(rank(r, state=s, error="boom" if s == "failed" else None))
    return out


@pytest.mark.parametrize("name, states, kw, action", RESCALING_ROWS,
                         ids=[r[0] for r in RESCALING_ROWS])
def test_rescaling_decisions(name, states, kw, action):
    """The soak's hang: a rank that finished or failed while a stop was requested must end
    the wait; and a wait that does not end is cut by the state's deadline."""
    restarts = kw.pop("restarts", 0)
    d = decide(snap(*_ranks(states), restarts=restarts, state="RESCALING", state_deadline_s=60.0,
                    **kw))
    assert d.action == action, d.reason
    if "deadline" in name:
        assert d.cause_kind == "rescale" and "did not commit the boundary checkpoint" in d.reason


@pytest.mark.parametrize("state", ["RUNNING", "RESCALING"])
@pytest.mark.parametrize("end", ["stopped", "done", "failed", "gone"])
def test_every_rank_end_state_ends_every_wait(state, end):
    """Whatever way every rank ended, no state keeps waiting (CONTINUE) for it."""
    d = decide(snap(*_ranks([end, end]), state=state, state_deadline_s=60.0))
    assert d.action != JobAction.CONTINUE, d.reason


def test_eviction_takes_the_straggler_node_block_unless_it_would_stop_the_job():
    ranks = [rank(0), rank(1), rank(2), rank(3)]
    flag = (StragglerFlag(3, 0.61, "evict"),)
    d = decide(snap(*ranks, state="RUNNING", stragglers=flag, capacity_nodes=2))
    assert (d.action, d.cause_kind, d.failed_ranks) == (JobAction.RESTART, "straggler", (3, 2))
    assert d.lost_nodes == (("n1", 2),) and "rank 3" in d.reason and "0.61" in d.reason
    assert EvictionPolicy().make_decision(snap(*ranks, stragglers=flag, capacity_nodes=1)) is None
    assert EvictionPolicy().make_decision(snap(*ranks, stragglers=flag, capacity_nodes=2,
                                               restarts=3)) is None
    alert = (StragglerFlag(3, 0.61, "alert"),)
    assert decide(snap(*ranks, state="RUNNING", stragglers=alert, capacity_nodes=2,
                       current_nodes=2, target_nodes=2)).action == JobAction.CONTINUE


def _recovering(ranks, failed, **kw) -> JobSnapshot:
    return snap(*ranks, state="RECOVERING", state_deadline_s=5.0, failed_ranks=failed,
                failure_reason="rank 2 died", **kw)


def test_node_loss_probes_every_suspect_at_once_and_waits_only_until_the_deadline():
    ranks = [rank(0), rank(1), rank(2, dead="x"), rank(3, dead="x")]
    s = _recovering(ranks, (2, 3))
    assert NodeLossPolicy().suspects(s) == ("n0", "n1")  # every node of the group, at once
    waiting = _recovering(ranks, (2, 3), probed=("n1",), state_age_s=1.0)
    assert decide(waiting).action == JobAction.CONTINUE
    answered = decide(_recovering(ranks, (2, 3), probed=("n1",), answered=("n1",)))
    assert (answered.action, answered.lost_nodes) == (JobAction.REPLAN, ())
    assert answered.reason.startswith("restart 1/3 after: rank 2 died")
    late = decide(_recovering(ranks, (2, 3), probed=("n1",), state_age_s=5.5))
    assert late.lost_nodes == (("n1", 2),)
    refused = decide(_recovering(ranks, (2, 3), probed=("n1",), refused=("n1",), state_age_s=0.1))
    assert (refused.action, refused.lost_nodes) == (JobAction.REPLAN, (("n1", 2),))


def test_a_block_not_seen_failing_is_probed_but_lost_only_on_proof():
    ranks = [rank(0), rank(1), rank(2, dead="x"), rank(3)]  # rank 3 not seen failing yet
    s = _recovering(ranks, (2,))
    assert NodeLossPolicy().suspects(s) == ("n0", "n1")
    crashed = _recovering([rank(0), rank(1), rank(2), rank(3)], (0, 1))  # survivors' errors first
    assert "n1" in NodeLossPolicy().suspects(crashed)
    late = decide(_recovering(ranks, (2,), probed=("n1",), state_age_s=5.5))
    assert late.lost_nodes == ()  # rank 3 may be fine: silence alone does not take the node
    refused = decide(_recovering(ranks, (2,), probed=("n1",), refused=("n1",)))
    assert refused.lost_nodes == (("n1", 2),)  # its raylet refused: the node is gone


def test_node_loss_without_a_probe_when_the_facts_are_certain():
    silent = [rank(0), rank(1), rank(2, heartbeat_age_s=6.0), rank(3, heartbeat_age_s=6.0)]
    assert NodeLossPolicy().suspects(_recovering(silent, (2, 3))) == ("n0",)  # n1 is certain
    assert decide(_recovering(silent, (2, 3))).lost_nodes == (("n1", 2),)
    ranks = [rank(0), rank(1), rank(2, dead="x"), rank(3, dead="x")]
    reported = _recovering(ranks, (2, 3), reported_lost=(1,))
    assert NodeLossPolicy().suspects(reported) == ("n0",)
    assert decide(reported).lost_nodes == (("n1", 2),)
    evicted = _recovering(ranks, (3, 2), known_lost=(("n1", 2),))
    assert decide(evicted).lost_nodes == (("n1", 2),)


def test_a_frozen_node_whose_ranks_cross_the_timeout_a_poll_apart_is_lost_without_waiting():
    # rank 3's last reply came one poll after rank 2's: the failure names rank 2 alone
    frozen = [rank(0), rank(1), rank(2, heartbeat_age_s=5.1), rank(3, heartbeat_age_s=4.6)]
    start = _recovering(frozen, (2,))
    assert NodeLossPolicy().suspects(start) == ("n0", "n1")  # not certain yet: probed
    soon = decide(_recovering(frozen, (2,), probed=("n0", "n1"), answered=("n0",),
                              state_age_s=0.5))
    assert (soon.action, soon.lost_nodes) == (JobAction.REPLAN, (("n1", 2),))  # before the deadline
    early = decide(_recovering(frozen, (2,), probed=("n0", "n1"), answered=("n0",),
                               state_age_s=0.2))
    assert early.action == JobAction.CONTINUE  # rank 3 silent 4.8 s of 5: not yet
    alive = decide(_recovering(frozen, (2,), probed=("n0", "n1"), answered=("n0", "n1"),
                               state_age_s=0.5))
    assert alive.lost_nodes == ()  # its node answered: a live node is never silent
    busy = [rank(0), rank(1), rank(2, heartbeat_age_s=5.1), rank(3, heartbeat_age_s=1.0)]
    late = decide(_recovering(busy, (2,), probed=("n0", "n1"), answered=("n0",),
                              state_age_s=5.5))
    assert late.lost_nodes == ()  # rank 3 was talking at the failure: silence is not proof


# ---- the transition table --------------------------------------------------------------------
def test_table_gives_every_state_a_deadline_and_a_way_out():
    spec = load_spec()
    for state in JobState:
        if state.terminal:
            assert state not in TRANSITIONS and state not in DEADLINES
            continue
        moves = TRANSITIONS[state]
        assert moves[JobAction.CANCEL] == JobState.CANCELLED
        assert any(target != state for action, target in moves.items()
                   if action != JobAction.CANCEL)
        deadline = DEADLINES[state]
        assert deadline.way_out
        assert 0.0 <= deadline.seconds(Timeouts.from_spec(spec)) < float("inf")


def test_controller_docstring_diagram_is_the_table():
    from tenax.orchestrator.job import controller

    doc = inspect.getdoc(controller)
    assert "\n".join(line.strip() for line in state_diagram().splitlines()) in \
        "\n".join(line.strip() for line in doc.splitlines())


def test_next_state_refuses_a_pair_the_table_does_not_have():
    assert next_state(JobState.RESCALING, JobAction.REPLAN) == JobState.PLACING
    with pytest.raises(ValueError, match="'rescale' is not allowed in state RECOVERING"):
        next_state(JobState.RECOVERING, JobAction.RESCALE)


def test_scaling_uses_available_nodes_within_bounds():
    spec = load_spec(overrides=["resources.nodes=2", "resources.gpus_per_node=2"])
    d = ScalingPolicy().make_decision(spec, Capacity(1), target_nodes=2)
    assert d.layout is not None and d.layout.world_size == 2 and d.nodes == 1
    d = ScalingPolicy().make_decision(spec, Capacity(5), target_nodes=2)
    assert d.layout.world_size == 4
    spec_min = load_spec(overrides=["resources.min_nodes=2", "resources.nodes=2"])
    d = ScalingPolicy().make_decision(spec_min, Capacity(1), target_nodes=2)
    assert d.layout is None and "below resources.min_nodes=2" in d.reason


def test_scaling_steps_down_when_gpus_cannot_all_be_used():
    # 3 nodes x 2 GPUs = 6 GPUs; global batch 32 with micro batch 2 admits dp 1, 2, 4, 8, 16
    spec = load_spec(overrides=["resources.nodes=3", "resources.gpus_per_node=2"])
    d = ScalingPolicy().make_decision(spec, Capacity(3), target_nodes=3)
    assert d.layout.world_size == 4 and d.nodes == 2
    assert "could not use more GPUs" in d.reason
