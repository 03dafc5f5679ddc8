"""Real multi-node Ray (cluster_utils: several raylets on 127.0.0.1 with fake GPUs): topology
of placement, a node that dies, a node that joins, and scaling across nodes."""
from __future__ import annotations

import pytest

from tenax.testing.clusters import start_cluster
from tenax.testing.jobs import JobRun, assert_same_losses, make_spec, reference_losses, run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture
def cluster2():
    import ray

    cluster, nodes = start_cluster(2)
    yield cluster, nodes
    ray.shutdown()
    cluster.shutdown()


TWO_NODES = ["train.steps=20", "resources.nodes=2", "resources.gpus_per_node=2",
             "resources.min_nodes=1", "resources.max_nodes=2"]


def test_tp_groups_sit_inside_a_node_and_node_loss_resumes_from_replicas(cluster2, tmp_path):
    spec = make_spec(tmp_path, TWO_NODES + ["parallel.tp=2"], "nodeloss")
    job = run_job(spec, chaos="kill node=1 at=12")
    placed = job.of("placed")[0]  # before the node loss
    nodes, ips = placed["nodes"], placed["ips"]
    assert set(ips) == {"127.0.0.1"}
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2]
    assert placed["layout"]["tp"] == 2 and placed["layout"]["dp"] == 2
    assert job.controller.state.value == "SUCCEEDED", job.controller.cause
    recovered = job.of("recovered")[0]
    assert recovered["world_size"] == 2 and recovered["layout"]["dp"] == 1  # one node left
    # the lost node's ranks come from the replicas its peer held: at most one step redone
    assert recovered["source"] == "replica" and recovered["lost_steps"] <= 1
    assert recovered["step"] >= job.of("failure")[0]["step"] - 1
    assert_same_losses(job.losses(), reference_losses(spec))


def test_added_node_is_used_after_the_next_scale_decision(tmp_path):
    import ray

    cluster, _ = start_cluster(1)
    try:
        grow = make_spec(tmp_path, ["train.steps=60", "resources.nodes=1",
                                    "resources.gpus_per_node=2", "resources.max_nodes=2"], "grow")
        # Rank 0 sleeps 10x its compute until the rescale (chaos fires once per job): the job is
        # still early when the node has joined, without hundreds of steps of CPU to get there.
        job = JobRun(grow, chaos="slow rank=0 factor=10 at=2").start()
        job.wait_for(lambda: job.controller.step >= 4, 120, "step 4")
        cluster.add_node(num_cpus=2, num_gpus=2, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        assert job.controller.layout.world_size == 2  # target is still 1 node
        job.controller.scale(2)  # the next scale decision uses the node that joined
        job.finish()
        assert job.controller.state.value == "SUCCEEDED"
        scaled = job.of("scaled")[0]
        assert scaled["from_world"] == 2 and scaled["world_size"] == 4 and scaled["lost_steps"] == 0
        assert len(set(job.of("placed")[-1]["nodes"])) == 2
        assert_same_losses(job.losses(), reference_losses(grow))
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_scale_down_two_to_one_node(cluster2, tmp_path):
    spec = make_spec(tmp_path, TWO_NODES, "shrink")
    job = run_job(spec, chaos="scale nodes=1 at=9")
    assert job.controller.state.value == "SUCCEEDED"
    scaled = job.of("scaled")[0]
    assert (scaled["from_world"], scaled["world_size"], scaled["lost_steps"]) == (4, 2, 0)
    assert_same_losses(job.losses(), reference_losses(spec))
