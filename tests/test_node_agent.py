"""A node's agent on a real local Ray: it links its own snapshot pieces and refuses one changed
since verification, its ping proves its node alive without a pinned task, and it answers a wait
for its training process as soon as that process ends."""
from __future__ import annotations

import pytest

from tenax.testing.clusters import local_ray

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module", autouse=True)
def ray_on_loopback():
    with local_ray(gpus=1):
        yield


def test_an_agent_links_its_own_snapshot_and_never_one_changed_since_it_was_verified():
    """Pieces held on the assembling agent's node are hard-linked (no byte copied), verified
    first; a snapshot rewritten after verification, or on another node, is refused; a new
    restore drops the restores of older snapshot generations (each pins a whole state)."""
    import os

    from tenax.checkpoint.errors import SnapshotError
    from tenax.checkpoint.format.catalog import Catalog
    from tenax.checkpoint.format.storage import Storage
    from tenax.checkpoint.memory.snapshot_store import SnapshotDir, SnapshotStamp, crc32c_of
    from tenax.workers.snapshot_keeper import SnapshotKeeper

    data = {"__0_0.distcp": b"x" * 4096, ".metadata": b"{}"}
    commit = {"layout": {"dp": 1}, "model_hash": "h", "data_cursor": 4, "seed": 0, "lr_step": 5,
              "extra": {"format": "tenax-raw-2"}}

    def publish(generation: int) -> None:
        stamp = SnapshotStamp(generation, 0, 1, 5, {n: [len(d), crc32c_of([d])]
                                                    for n, d in data.items()}, commit)
        SnapshotDir(keeper.local_dir).write(stamp, data)

    keeper = SnapshotKeeper()
    keeper.configure(f"link-test-{os.getpid()}", 0, None, 3)
    try:
        publish(3)
        where = keeper.locate(3, 0, 5)
        uri = keeper.assemble(keeper.job_id, 3, "node-s5", [where])
        version = os.path.join(uri[len("file://"):], "step-00000005")
        assert os.stat(os.path.join(version, "__0_0.distcp")).st_nlink == 2  # linked, not copied
        assert Catalog(Storage(uri, timeout_s=10)).verify(5) == []
        with pytest.raises(SnapshotError, match="not this one"):
            keeper.assemble(keeper.job_id, 3, "node-s5", [{**where, "node": "f" * 56}])
        publish(3)  # the same step written again after it was verified
        with pytest.raises(SnapshotError, match="changed since it was verified"):
            keeper.assemble(keeper.job_id, 3, "node-s5", [where])
        publish(4)
        keeper.assemble(keeper.job_id, 4, "node-s5", [keeper.locate(4, 0, 5)])
        assert os.listdir(os.path.join(keeper.job_root, "restore")) == ["g4"]
    finally:
        keeper.drop_job()


def _collect_until_settled(probes, timeout_s: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not (set(probes.nodes) <= probes.answered | probes.refused):
        assert time.monotonic() < deadline, f"probes unsettled: {probes.nodes}"
        probes.collect(0.2)


def test_a_node_whose_agent_answers_gets_no_pinned_task_one_without_a_live_agent_does():
    """A pinned task needs a Ray worker process on its node (the first: a fresh interpreter,
    about a second of CPU that slowed every job's first recovery); a live agent's ping proves
    the node alive without one."""
    import ray

    from tenax.orchestrator.placement.capacity import NodeProbes

    @ray.remote(num_cpus=0)
    class Agent:
        def ping(self) -> bool:
            return True

    node = ray.get_runtime_context().get_node_id()
    live, dead = Agent.remote(), Agent.remote()
    ray.get([live.ping.remote(), dead.ping.remote()])
    ray.kill(dead, no_restart=True)
    answered_by_ping = NodeProbes()
    answered_by_ping.start((node,), {node: [dead, live]})
    _collect_until_settled(answered_by_ping)
    assert answered_by_ping.answered == {node} and answered_by_ping.refs == {}
    for agents in ({node: [dead]}, None):  # every ping fails / nobody to ping: the task decides
        probes = NodeProbes()
        probes.start((node,), agents)
        _collect_until_settled(probes)
        assert probes.answered == {node} and set(probes.refs) == {node}


def test_an_agent_answers_a_wait_for_its_training_process_as_soon_as_it_ends():
    """The controller keeps one `wait_ended` per rank in flight, so a process that dies wakes it
    at once instead of at the next heartbeat poll."""
    import ray

    from tenax.workers.worker import RankRun, RankWorker

    agent = ray.remote(RankWorker).options(num_cpus=0, max_concurrency=4).remote()
    assert ray.get(agent.wait_ended.remote(1, 0.1), timeout=120) is False  # nothing ran yet
    waiting = agent.wait_ended.remote(1, 120)
    broken = RankRun(spec={"train": "not a table"}, layout={}, rank=0, world=1,
                     addr="127.0.0.1", port=1)  # fails at once: invalid spec
    assert ray.get(agent.start.remote(broken), timeout=120) == 1
    assert ray.get(waiting, timeout=120) is True
    assert ray.get(agent.heartbeat.remote(), timeout=60)["state"] == "failed"
    assert ray.get(agent.wait_ended.remote(1, 0.1), timeout=60) is True  # and stays ended
    ray.kill(agent, no_restart=True)

