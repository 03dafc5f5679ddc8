"""ray.nodes() is a GCS call without a deadline: every caller bounds its wait.

A hung GCS is simulated by a `ray.nodes` that blocks until the test releases it; no Ray
cluster is started."""
from __future__ import annotations

import threading
import time
from typing import Any, Iterator

import pytest
import ray

from tenax.orchestrator.placement import capacity
from tenax.orchestrator.errors import RayNodesTimeout
from tenax.orchestrator.placement.nodes_reader import NodesReader
from tenax.orchestrator.service import scheduler

NODE = {"NodeID": "n1", "Alive": True, "Resources": {"GPU": 2.0},
        "NodeManagerAddress": "10.0.0.7", "NodeManagerPort": 0}


@pytest.fixture()
def hung_gcs(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """`ray.nodes` blocks until the event is set (at the latest when the test ends)."""
    release = threading.Event()

    def nodes() -> list[dict[str, Any]]:
        release.wait(30)
        return [NODE]

    monkeypatch.setattr(ray, "nodes", nodes)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(capacity, "READER", NodesReader())
    yield release
    release.set()


def test_a_late_answer_is_a_timeout_and_callers_share_one_call(hung_gcs: threading.Event) -> None:
    calls: list[float] = []

    def listing() -> list[dict[str, Any]]:
        calls.append(time.monotonic())
        return ray.nodes()

    # Counted by its own calls, not by threads: a thread of another test's background loop
    # may be reading the process-wide reader meanwhile.
    reader = NodesReader(listing)
    t0 = time.monotonic()
    for _ in range(3):
        with pytest.raises(RayNodesTimeout, match="did not answer within 0.1 s"):
            reader.nodes(0.1)
    assert time.monotonic() - t0 < 5
    assert len(calls) == 1  # one stuck call, not one per caller
    hung_gcs.set()
    assert reader.nodes(5) == [NODE]
    hung_gcs.clear()
    assert reader.nodes(0.1, stale_ok=True) == [NODE]  # late again: the previous answer


def test_the_scheduler_skips_a_pass_instead_of_waiting(hung_gcs: threading.Event,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scheduler, "NODES_TIMEOUT_S", 0.2)
    t0 = time.monotonic()
    assert scheduler.cluster_now() is None
    assert time.monotonic() - t0 < 5


def test_capacity_and_raylet_probes_have_deadlines(hung_gcs: threading.Event,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(capacity, "RAY_NODES_TIMEOUT_S", 0.2)
    monkeypatch.setattr(capacity, "RAYLET_CONNECT_S", 0.05)
    t0 = time.monotonic()
    assert capacity.raylets_down(("n1",)) == set()  # no answer: no proof a node is down
    with pytest.raises(RayNodesTimeout):
        capacity.cluster_capacity(1, {})
    assert time.monotonic() - t0 < 5
    hung_gcs.set()
    assert capacity.cluster_capacity(1, {}).nodes == 2


def test_an_agent_finds_its_address_without_the_gcs(hung_gcs: threading.Event,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from tenax.workers import worker

    class Context:
        def get_node_id(self) -> str:
            return "n1"

    monkeypatch.setattr(worker, "NODE_IP_TIMEOUT_S", 0.2)
    monkeypatch.setattr(ray, "get_runtime_context", Context)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.9")
    agent = object.__new__(worker.RankWorker)  # no forkserver: only the identity is asked
    t0 = time.monotonic()
    assert agent.info()["ip"] == "10.0.0.9"
    assert time.monotonic() - t0 < 5
    hung_gcs.set()
    assert agent.info()["ip"] == "10.0.0.7"
