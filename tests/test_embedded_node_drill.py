"""A `kill node` drill on one raylet simulating several nodes loses one node block, not them all.

On the embedded Ray every node block shares the single Ray node, so a loss recorded by Ray node
id would take the survivors too (and the replicas of the lost block they hold): the job would
resume cold from storage. The loss is decided and executed per block instead, so the drill
shows what a real node loss does: the survivors' agents stay, the lost ranks come back from
their replicas, and at most one step is redone.
"""
from __future__ import annotations

import pytest

from tenax.orchestrator.job.job_policy import JobAction, JobSnapshot, Limits, decide
from tenax.orchestrator.placement.worker_group import RankHealth
from tenax.testing.jobs import assert_same_losses, make_spec, run_job

SHARED = "raylet-0"  # the one Ray node every block is placed on


def _rank(rank: int, dead: str | None = None) -> RankHealth:
    return RankHealth(rank=rank, node_id=SHARED, dead=dead, heartbeat_age_s=0.1,
                      state="training", step=12, step_age_s=0.1, error=None)


def _recovering(**kw) -> JobSnapshot:
    ranks = (_rank(0), _rank(1), _rank(2, dead="x"), _rank(3, dead="x"))
    return JobSnapshot(ranks=ranks, restarts=0, limits=Limits(3, 2, 1, 2), state="RECOVERING",
                       state_deadline_s=5.0, failed_ranks=(2, 3), failure_reason="rank 2 died",
                       **kw)


def test_a_reported_block_is_lost_alone_although_its_ray_node_holds_the_survivors():
    d = decide(_recovering(reported_lost=(1,)))
    assert d.action == JobAction.REPLAN, d.reason
    assert d.lost_blocks == (1,)  # block 0 shares the Ray node but keeps its agents
    assert d.lost_nodes == ((SHARED, 2),)  # the capacity loses one block's slots, not four


def test_a_refused_raylet_takes_every_block_on_it():
    d = decide(_recovering(probed=(SHARED,), refused=(SHARED,)))
    assert d.lost_blocks == (0, 1) and d.lost_nodes == ((SHARED, 4),)


def test_no_proof_loses_no_block():
    d = decide(_recovering(probed=(SHARED,), answered=(SHARED,)))
    assert (d.lost_blocks, d.lost_nodes) == ((), ())


@pytest.fixture(scope="module")
def local_ray():
    import ray

    from tenax.testing.clusters import start_local_ray

    start_local_ray(gpus=4)
    yield
    ray.shutdown()


# The spec of the real multi-node drill (tests/test_controller_cluster.py): tp=2 fills a node
# block. Storage commits only the last step, so only memory can give a step near the loss.
DRILL = ["train.steps=20", "resources.nodes=2", "resources.gpus_per_node=2",
         "resources.min_nodes=1", "resources.max_nodes=2", "parallel.tp=2",
         "checkpoint.every_steps=20"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kill_node_drill_on_one_raylet_resumes_from_replicas(tmp_path, local_ray):
    clean = run_job(make_spec(tmp_path / "clean", DRILL, "clean"))
    assert clean.controller.state.value == "SUCCEEDED", clean.controller.cause
    job = run_job(make_spec(tmp_path / "drill", DRILL, "drill"), chaos="kill node=1 at=12")
    assert job.controller.state.value == "SUCCEEDED", job.controller.cause
    recovered = job.of("recovered")[0]
    # the lost block's ranks come from the replicas the surviving block's agents held
    assert recovered["source"] == "replica", recovered
    assert recovered["lost_steps"] <= 1, recovered
    assert recovered["step"] >= job.of("failure")[0]["step"] - 1, recovered
    assert recovered["world_size"] == 2  # one node block of the Ray node's two is gone
    placed = job.of("placed")[-1]
    assert placed["mode"] == "warm" and (placed["reused"], placed["created"]) == (2, 0), placed
    assert sum(job.controller.lost_slots.values()) == 2
    assert_same_losses(job.losses(), clean.losses())
