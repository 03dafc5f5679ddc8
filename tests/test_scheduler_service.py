"""`tenax serve`'s scheduler end to end: a real gRPC server and real jobs on a real multi-node
Ray (cluster_utils: 2 raylets x 2 fake GPUs on 127.0.0.1, one cluster for the module).

What the scheduler promises: a job larger than the free GPUs is QUEUED and starts when the earlier
job ends (two equal jobs never overlap), a job that can never fit is refused at submission,
a queue wait past queue_timeout_s fails, the autoscaler request is visible while a job waits
and withdrawn after; a priority-10 job shrinks an elastic job that grows back with its clean
losses; a preemptible job is stopped at a checkpoint and requeued; the queue survives SIGKILL.
"""
from __future__ import annotations

import json
import urllib.request
from typing import Any

import grpc
import pytest

from tenax.orchestrator.spec import load_spec
from tenax.testing.clusters import start_cluster
from tenax.testing.jobs import job_overrides, reference_losses
from tenax.proto import jobs_pb2 as pb
from tests.service_helpers import (ServerProcess, code_of, of, run_cli, states, stub, submit,
                                   wait_until, watch)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
WHOLE = ["resources.nodes=2", "resources.gpus_per_node=2", "resources.min_nodes=2"]


@pytest.fixture(scope="module")
def cluster():
    import ray

    c, _ = start_cluster(2, head_cpus=2)
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def server(cluster, tmp_path_factory):
    from tenax.orchestrator.job.metrics import MetricsServer
    from tenax.orchestrator.service.jobs import JobManager
    from tenax.orchestrator.service.server import JobServer, ServerOptions
    from tenax.orchestrator.service.store import JobStore

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


def test_a_priority_job_shrinks_an_elastic_one_which_grows_back_with_clean_losses(server):
    s, tmp = server["stub"], server["tmp"]
    elastic_spec = ["resources.nodes=2", "resources.gpus_per_node=2", "resources.min_nodes=1",
                    "train.steps=300"]
    overrides = job_overrides(tmp, "elastic", elastic_spec)
    elastic = submit(s, [], overrides)
    watch(s, [], elastic, timeout_s=180, until=lambda e: e["kind"] == "step")
    urgent = submit(s, [], job_overrides(tmp, "urgent", [
        "priority=10", "resources.nodes=1", "resources.gpus_per_node=2", "train.steps=5"]))
    urgent_events = watch(s, [], urgent, timeout_s=300)
    events = watch(s, [], elastic, timeout_s=300)
    assert states(urgent_events)[-1] == "SUCCEEDED" and states(events)[-1] == "SUCCEEDED"
    shrunk, grown, scaled = of(events, "shrunk"), of(events, "grown"), of(events, "scaled")
    assert len(shrunk) == 1 and shrunk[0]["nodes"] == 1 and urgent in shrunk[0]["reason"]
    assert len(grown) == 1 and grown[0]["nodes"] == 2
    assert [(e["from_world"], e["world_size"], e["lost_steps"]) for e in scaled] == \
        [(4, 2, 0), (2, 4, 0)]
    assert min(placed_times(urgent_events)) >= scaled[0]["time"] - 1.0  # room first, then urgent
    assert of(urgent_events, "admitted")
    assert grown[0]["time"] >= of(urgent_events, "state")[-1]["time"]
    assert get(s, elastic).lost_steps == 0

    want = reference_losses(load_spec(overrides=overrides))  # the same job in one process
    got = {e["step"]: e["loss"] for e in of(events, "step")}
    assert sorted(got) == list(range(1, 301)) == sorted(want)
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, rel=1e-5), step


def test_a_preemptible_job_stops_at_a_checkpoint_and_is_requeued(server):
    s, tmp = server["stub"], server["tmp"]
    victim = submit(s, [], job_overrides(tmp, "victim", WHOLE + [
        "resources.preemptible=true", "train.steps=30"]))
    watch(s, [], victim, timeout_s=180, until=lambda e: e["kind"] == "step" and e["step"] >= 3)
    urgent = submit(s, [], job_overrides(tmp, "urgent2", WHOLE + ["priority=10",
                                                                  "train.steps=5"]))
    urgent_events = watch(s, [], urgent, timeout_s=300)
    events = watch(s, [], victim, timeout_s=300)
    assert states(urgent_events)[-1] == "SUCCEEDED" and states(events)[-1] == "SUCCEEDED"
    (preempted,) = of(events, "preempted")
    assert urgent in preempted["reason"]
    requeued = next(e for e in of(events, "state")
                    if e["state"] == "QUEUED" and e["seq"] > preempted["seq"])
    assert "CANCELLED" not in states(events)
    first_urgent_step = of(urgent_events, "step")[0]["time"]
    before = [e for e in of(events, "step") if e["seq"] < requeued["seq"]]
    after = [e for e in of(events, "step") if e["seq"] > requeued["seq"]]
    assert before[-1]["time"] <= first_urgent_step <= after[0]["time"]  # never both training
    assert after[0]["step"] == before[-1]["step"] + 1  # resumed at the boundary: 0 lost steps
    assert get(s, victim).lost_steps == 0


def test_the_queue_survives_a_sigkilled_server(cluster, tmp_path):
    state, log = tmp_path / "state", tmp_path / "serve.log"
    args = ["--state-dir", str(state), "--address", cluster.address, "--no-metrics",
            "--storage-root", f"file://{tmp_path}"]
    first = ServerProcess(args, log)
    try:
        s = stub(first.port)
        holder = submit(s, [], job_overrides(tmp_path, "holder", WHOLE + ["train.steps=5000"]))
        low = submit(s, [], job_overrides(tmp_path, "low", WHOLE))
        high = submit(s, [], job_overrides(tmp_path, "high", WHOLE + ["priority=5"]))
        watch(s, [], holder, timeout_s=180, until=lambda e: e["kind"] == "step")
        before = [(get(s, j).state, get(s, j).queue_position) for j in (holder, high, low)]
        assert before == [(pb.JOB_STATE_RUNNING, 0), (pb.JOB_STATE_QUEUED, 1),
                          (pb.JOB_STATE_QUEUED, 2)]
        first.kill()
        second = ServerProcess(args, log)
        try:
            s = stub(second.port)
            wait_until(lambda: get(s, holder).state == pb.JOB_STATE_RUNNING, 180,
                       f"the holder to run again: {log.read_text()[-2000:]}")
            after = [(get(s, j).state, get(s, j).queue_position) for j in (holder, high, low)]
            assert after == before
            assert "waiting for 4 GPU(s)" in get(s, high).waiting_for
            sets = [a for o in job_overrides(tmp_path, "run", WHOLE + [
                "resources.queue_timeout_s=2"]) for a in ("--set", o)]
            done = run_cli(["run", *sets, "--address", cluster.address], timeout_s=180)
            assert done.returncode == 1, done.stderr[-2000:]  # `tenax run` queues, then gives up
            assert "waiting for 4 GPU(s)" in done.stderr and "queue_timeout_s=2" in done.stderr
            for job in (low, high, holder):
                s.CancelJob(pb.CancelJobRequest(job_id=job), timeout=10)
            assert states(watch(s, [], holder, timeout_s=120))[-1] == "CANCELLED"
            assert get(s, low).state == pb.JOB_STATE_CANCELLED
        finally:
            second.kill()
    finally:
        first.kill()
