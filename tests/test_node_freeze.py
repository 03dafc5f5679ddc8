"""A frozen node (every process SIGSTOPped: a hung host, no socket closes) on a real multi-node
Ray: it is found lost by silence, and its ranks resume from the replicas its peer held."""
from __future__ import annotations

import signal

import pytest

from tenax.testing.jobs import JobRun, assert_same_losses, make_spec, reference_losses
from tests import test_controller_cluster
from tests.test_controller_cluster import TWO_NODES

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# The two-node cluster fixture; pytest finds a fixture by the module's attribute name.
cluster2 = test_controller_cluster.cluster2

# A short heartbeat timeout keeps the test quick; hang_timeout_s stays above it (policy rule).
# Storage commits only the last step (20): a storage commit racing the frozen node's last replica
# would rightly win whenever it is strictly newer, and this test is about the replica.
FAST = TWO_NODES + ["fault_tolerance.heartbeat_timeout_s=3", "fault_tolerance.hang_timeout_s=30",
                    "checkpoint.every_steps=20"]


def node_processes(node):
    """The node's raylet and everything under it: agents, forkservers, training processes."""
    import psutil

    raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
    return [raylet] + raylet.children(recursive=True)


def test_a_frozen_node_is_lost_and_its_ranks_resume_from_replicas(cluster2, tmp_path):
    import psutil

    _, nodes = cluster2
    spec = make_spec(tmp_path, FAST, "freeze")
    job = JobRun(spec).start()
    job.wait_for(lambda: job.controller.step >= 12, 300, "step 12")
    victim = next(n for n in nodes if n.node_id == job.controller.group.ranks[2].node_id)
    procs = node_processes(victim)
    for proc in procs:
        proc.send_signal(signal.SIGSTOP)
    try:
        job.finish(300)
    finally:
        for proc in procs:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
    assert job.controller.state.value == "SUCCEEDED", job.controller.cause
    failure, recovered = job.of("failure")[0], job.of("recovered")[0]
    assert "missed heartbeats" in failure["cause"], failure
    assert recovered["world_size"] == 2 and recovered["source"] == "replica", recovered
    assert recovered["lost_steps"] <= 1 and job.controller.restarts == 1
    assert_same_losses(job.losses(), reference_losses(spec))
