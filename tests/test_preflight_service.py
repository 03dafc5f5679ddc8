"""The service's preflight at admission: a job with `preflight:` is smoke-tested after the
scheduler admits it and before its long run; `required: true` and a failing row end it FAILED
with the failing rows as its cause; the verdict stays in the job's status (`tenax status`)."""
from __future__ import annotations

import pytest

from tenax.proto import jobs_pb2 as pb
from tenax.testing.jobs import job_overrides
from tests.service_helpers import of, states, stub, submit, watch
from tests.test_preflight import token_file

pytestmark = pytest.mark.timeout(600)
ONE_NODE = ["resources.nodes=1", "resources.min_nodes=1", "resources.max_nodes=1",
            "resources.gpus_per_node=2"]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    import ray

    from tenax.orchestrator.service.jobs import JobManager
    from tenax.orchestrator.service.server import JobServer, ServerOptions
    from tenax.orchestrator.service.store import JobStore
    from tenax.testing.clusters import start_local_ray

    start_local_ray(gpus=2)
    store = JobStore(tmp_path_factory.mktemp("state"), exclusive=True)
    server = JobServer(JobManager(store), ServerOptions("127.0.0.1", 0))
    try:
        server.start()
        yield {"stub": stub(server.port), "tmp": tmp_path_factory.mktemp("jobs")}
    finally:
        server.stop(1.0)
        store.close()
        ray.shutdown()


def get(s, job_id: str) -> pb.Job:
    return s.GetJob(pb.GetJobRequest(job_id=job_id), timeout=10)


@pytest.mark.slow
def test_a_required_preflight_that_fails_ends_the_job_failed(service):
    s, tmp = service["stub"], service["tmp"]
    bad = token_file(tmp / "shard-7.tok", 40_000, bad_at=39_000)
    job_id = submit(s, [], job_overrides(tmp, "pfbad", [
        *ONE_NODE, "train.steps=4", f"data.source=file://{bad}",
        "preflight={steps: 2, required: true}"]))
    events = watch(s, [], job_id, timeout_s=300)
    assert states(events)[-1] == "FAILED" and "RUNNING" not in states(events)
    assert not of(events, "step")
    (pre,) = of(events, "preflight")
    data = next(r for r in pre["rows"] if r["name"] == "data")
    assert pre["verdict"] == data["verdict"] == "fail" and "shard-7.tok" in data["detail"]
    job = get(s, job_id)
    assert job.state == pb.JOB_STATE_FAILED
    assert job.cause.startswith("preflight failed: data") and "shard-7.tok" in job.cause
    assert job.preflight.startswith("fail; data fail:") and "shard-7.tok" in job.preflight


@pytest.mark.slow
def test_a_passing_preflight_runs_before_the_job_and_stays_in_its_status(service):
    """The preflight event precedes the job's placement; the job then trains from step 1 to
    its end; the job's status (GetJob, what `tenax status` prints) holds the verdict and every
    row that did not pass."""
    from tenax.orchestrator.preflight import Report, Row
    from tenax.orchestrator.service.wire import job_dict

    s, tmp = service["stub"], service["tmp"]
    job_id = submit(s, [], job_overrides(tmp, "pfok", [*ONE_NODE, "train.steps=4",
                                                        "preflight={steps: 3}"]))
    events = watch(s, [], job_id, timeout_s=400)
    assert states(events) == ["PLACING", "RUNNING", "SUCCEEDED"]
    kinds = [e["event"] for e in events]
    assert kinds.index("preflight") < kinds.index("state")
    (pre,) = of(events, "preflight")
    assert {r["name"] for r in pre["rows"]} == {"data", "memory", "progress", "throughput",
                                                "links", "recovery"}
    assert pre["verdict"] != "fail", pre["rows"]
    assert [e["step"] for e in of(events, "step")] == [1, 2, 3, 4]
    report = Report([Row(**r) for r in pre["rows"]])
    job = job_dict(get(s, job_id))
    assert job["state"] == "SUCCEEDED" and job["preflight"] == report.summary()
