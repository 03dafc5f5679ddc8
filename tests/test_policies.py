"""Pure decisions and chaos parsing: no Ray needed."""
from __future__ import annotations

import pytest

from orchestrator.chaos import ChaosError, ChaosEvent, parse_chaos, validate_for_job
from orchestrator.policies import Action, Capacity, FailurePolicy, JobSnapshot, ScalingPolicy
from orchestrator.spec import load_spec
from orchestrator.worker_group import RankHealth


def rank(r: int, **kw) -> RankHealth:
    base = dict(rank=r, node_id="n0", dead=None, heartbeat_age_s=0.1, state="training", step=5,
                step_age_s=0.2, error=None)
    return RankHealth(**{**base, **kw})


def snap(*ranks: RankHealth, restarts: int = 0, max_restarts: int = 3) -> JobSnapshot:
    return JobSnapshot(tuple(ranks), restarts, max_restarts, heartbeat_timeout_s=5.0,
                       hang_timeout_s=30.0, gpus_per_node=2)


def test_healthy_continues_and_all_done_succeeds():
    policy = FailurePolicy()
    assert policy.make_decision(snap(rank(0), rank(1))).action == Action.CONTINUE
    done = policy.make_decision(snap(rank(0, state="done"), rank(1, state="done")))
    assert done.action == Action.SUCCEED


def test_root_cause_first_over_collateral_errors():
    d = FailurePolicy().make_decision(snap(
        rank(0, state="failed", error="RuntimeError: Connection reset by peer"),
        rank(1, dead="ActorDiedError: killed")))
    assert d.action == Action.RESTART
    assert d.failed_ranks == (1, 0) and d.cause_kind == "dead"
    assert d.reason.startswith("rank 1 died")


def test_heartbeat_timeout_and_hang():
    d = FailurePolicy().make_decision(snap(rank(0), rank(1, heartbeat_age_s=5.5)))
    assert (d.action, d.cause_kind, d.failed_ranks) == (Action.RESTART, "heartbeat", (1,))
    assert "heartbeat_timeout_s=5.0" in d.reason
    d = FailurePolicy().make_decision(snap(rank(0, step_age_s=31.0), rank(1)))
    assert (d.cause_kind, d.failed_ranks) == ("hang", (0,))
    # starting ranks get twice the hang timeout (checkpoint loading)
    ok = FailurePolicy().make_decision(snap(rank(0, state="starting", step_age_s=50.0)))
    assert ok.action == Action.CONTINUE
    stuck = FailurePolicy().make_decision(snap(rank(0, state="starting", step_age_s=61.0)))
    assert stuck.cause_kind == "hang"


def test_max_restarts_exhausted_fails_with_cause():
    d = FailurePolicy().make_decision(snap(rank(0, dead="gone"), restarts=3, max_restarts=3))
    assert d.action == Action.FAIL
    assert "rank 0 died (gone)" in d.reason and "max_restarts=3 exhausted" in d.reason


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


def test_chaos_parsing():
    events = parse_chaos("kill rank=1 at=30; kill node=1 at=40 ;hang rank=0 at=50;"
                         "slow rank=2 factor=1.5 at=10; scale nodes=2 at=60; corrupt-checkpoint at=25")
    assert events[0] == ChaosEvent("kill", 30, rank=1)
    assert events[1] == ChaosEvent("kill", 40, node=1)
    assert events[3].factor == 1.5 and events[4].nodes == 2
    assert events[1].targets(2, 2) and events[1].targets(3, 2) and not events[1].targets(1, 2)
    assert not events[5].targets(0, 2)


@pytest.mark.parametrize("text, message", [
    ("explode rank=1 at=3", "unknown fault 'explode'"),
    ("kill rank=1", "missing at=STEP"),
    ("kill at=3", "exactly one of rank=R or node=N"),
    ("slow rank=1 factor=0.5 at=3", "factor=0.5 must be > 1"),
    ("hang node=1 at=3", "hang needs rank=R"),
    ("kill rank=x at=3", "invalid literal"),
    ("kill rank=1 at=3 extra", "cannot read 'extra'"),
])
def test_chaos_errors(text, message):
    with pytest.raises(ChaosError, match=message):
        parse_chaos(text)


def test_chaos_validated_against_job():
    with pytest.raises(ChaosError, match="ranks 0..3"):
        validate_for_job(parse_chaos("kill rank=4 at=3"), world=4, nodes=2, steps=10)
    with pytest.raises(ChaosError, match="train.steps=10"):
        validate_for_job(parse_chaos("kill rank=0 at=11"), world=4, nodes=2, steps=10)
