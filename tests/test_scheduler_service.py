"""`tenax serve`'s scheduler end to end: a real gRPC server and real jobs on a real multi-node
Ray (cluster_utils: 2 raylets x 2 fake GPUs on 127.0.0.1, one cluster for the module).

Issue 16's "Checked by": a job larger than the free GPUs is QUEUED and starts when the earlier
job ends (two equal jobs never overlap), a job that can never fit is refused at submission,
a queue wait past queue_timeout_s fails, the autoscaler request is visible while a job waits
and withdrawn after; a priority-10 job shrinks an elastic job that grows back with its clean
losses; a preemptible job is stopped at a checkpoint and requeued; the queue survives SIGKILL.
"""
from __future__ import annotations

import json
import os
import tempfile
import urllib.request
from typing import Any

import grpc
import pytest
from tenax.v1 import jobs_pb2 as pb

from tests.ray_helpers import ray_env
from tests.service_helpers import (ServerProcess, code_of, job_overrides, of, states, stub,
                                   submit, wait_until, watch)

pytestmark = pytest.mark.timeout(600)
WHOLE = ["resources.nodes=2", "resources.gpus_per_node=2", "resources.min_nodes=2"]


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    ray_env()
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="tenax-sched-")
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "num_gpus": 0, "node_ip_address": "127.0.0.1"})
    for _ in range(2):
        c.add_node(num_cpus=2, num_gpus=2, node_ip_address="127.0.0.1")
    ray.init(address=c.address, log_to_driver=False, configure_logging=False)
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def server(cluster, tmp_path_factory):
    from orchestrator.jobs import JobManager
    from orchestrator.metrics import MetricsServer
    from orchestrator.service import JobServer, ServerOptions
    from orchestrator.store import JobStore

    store = JobStore(tmp_path_factory.mktemp("state"), exclusive=True)
    metrics = MetricsServer(0, "127.0.0.1")
    manager = JobManager(store, metrics.collector)
    srv = JobServer(manager, ServerOptions("127.0.0.1", 0))
    srv.start()
    try:
        yield {"stub": stub(srv.port), "metrics": metrics.port, "manager": manager,
               "tmp": tmp_path_factory.mktemp("jobs")}
    finally:
        srv.stop(1.0)
        metrics.close()
        store.close()


def get(s: Any, job_id: str) -> pb.Job:
    return s.GetJob(pb.GetJobRequest(job_id=job_id), timeout=10)


def autoscaler_demand() -> list[dict[str, float]]:
    """The bundles requested from Ray's autoscaler, as Ray stores them (v1 KV or v2 GCS)."""
    from ray.autoscaler.v2.utils import is_autoscaler_v2

    if is_autoscaler_v2():
        from ray.autoscaler.v2.sdk import get_cluster_resource_state
        from ray.experimental.internal_kv import internal_kv_get_gcs_client

        state = get_cluster_resource_state(internal_kv_get_gcs_client())
        return [dict(r.request.resources_bundle) for c in state.cluster_resource_constraints
                for r in c.resource_requests for _ in range(r.count)]
    from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    return json.loads(raw) if raw else []


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def placed_times(events: list[dict[str, Any]]) -> list[float]:
    return [e["time"] for e in of(events, "placed")]


def test_a_job_waits_for_the_earlier_one_and_never_overlaps_it(server):
    s, tmp = server["stub"], server["tmp"]
    code, details = code_of(lambda: submit(s, [], job_overrides(tmp, "huge", [
        "resources.nodes=1", "resources.gpus_per_node=4", "resources.min_nodes=1"])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "can never fit" in details, details
    assert "resources.gpus_per_node=4" in details

    first = submit(s, [], job_overrides(tmp, "first", WHOLE + ["train.steps=15"]))
    second = submit(s, [], job_overrides(tmp, "second", WHOLE + ["train.steps=5"]))
    job = get(s, second)
    assert job.state == pb.JOB_STATE_QUEUED and job.queue_position == 1, job
    assert "waiting for 4 GPU(s)" in job.waiting_for and first in job.waiting_for
    want = [{"GPU": 2.0}] * 4
    wait_until(lambda: autoscaler_demand() == want, 30, "the autoscaler request")
    assert 'tenax_queue_jobs{priority="0"} 1.0' in scrape(server["metrics"])
    late = submit(s, [], job_overrides(tmp, "late", WHOLE + ["resources.queue_timeout_s=1"]))

    expired = watch(s, [], late, timeout_s=60)
    assert states(expired) == ["QUEUED", "FAILED"]
    assert "resources.queue_timeout_s=1" in get(s, late).cause
    done_first = watch(s, [], first, timeout_s=300)
    done_second = watch(s, [], second, timeout_s=300)
    assert states(done_first)[-1] == "SUCCEEDED" and states(done_second)[-1] == "SUCCEEDED"
    assert [e["event"] for e in done_second[:3]] == ["queued", "state", "admitted"]
    end_of_first = of(done_first, "state")[-1]["time"]
    assert min(placed_times(done_second)) >= end_of_first  # never both on the cluster
    wait_until(lambda: autoscaler_demand() == [], 30, "the autoscaler request withdrawn")
    scraped = scrape(server["metrics"])
    assert f'tenax_job_queued_seconds{{job="{second}"}}' in scraped
