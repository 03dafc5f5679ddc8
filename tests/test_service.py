"""`tenax serve` end to end: a real gRPC server on 127.0.0.1, real jobs on a real local Ray.

One Ray cluster for the module (started here; subprocess servers join it with --address, so a
SIGKILLed server leaves nothing behind but its jobs' actors, which Ray reaps). The in-process
server requires a token; the embedded-Ray test runs its own cluster under a private TMPDIR and
kills whatever is left there.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from importlib.metadata import version
from pathlib import Path

import grpc
import pytest

from tenax.testing.jobs import job_overrides
from tenax.proto import jobs_pb2 as pb
from tests.service_helpers import (REPO, ServerProcess, auth, bad_rpcs, bad_specs, children,
                                   code_of, fuzz_call, kill_mentioning, of, pids_mentioning,
                                   run_cli, states, stub, submit, wait_until, watch)

pytestmark = pytest.mark.timeout(300)
TOKEN = "t0ken-for-tests"
CLEAN = ["train.steps=40", "resources.nodes=1", "resources.gpus_per_node=2"]
NOT_FOUND, INVALID = grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


def test_generated_modules_match_the_proto(tmp_path):
    committed = REPO / "proto" / "tenax" / "v1"
    pinned = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'",
                       (committed / "jobs_pb2_grpc.py").read_text()).group(1)
    if version("grpcio-tools") != pinned:
        pytest.skip(f"grpcio-tools {version('grpcio-tools')} installed; modules made by {pinned}")
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", "proto",
                    f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
                    f"--grpc_python_out={tmp_path}", "proto/tenax/v1/jobs.proto"],
                   cwd=REPO, check=True, timeout=60)
    for name in ("jobs_pb2.py", "jobs_pb2.pyi", "jobs_pb2_grpc.py"):
        assert (tmp_path / "tenax" / "v1" / name).read_text() == (committed / name).read_text(), \
            f"proto/tenax/v1/{name} is stale: regenerate it (see proto/README.md)"


@pytest.fixture(scope="module")
def ray_address():
    import ray

    from tenax.testing.clusters import start_local_ray

    start_local_ray(gpus=4)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def server(ray_address, tmp_path_factory):
    from tenax.orchestrator.job.metrics import MetricsServer
    from tenax.orchestrator.service.jobs import JobManager
    from tenax.orchestrator.service.server import JobServer, ServerOptions
    from tenax.orchestrator.service.store import JobStore

    store = JobStore(tmp_path_factory.mktemp("state"), exclusive=True)
    metrics = MetricsServer(0, "127.0.0.1")
    manager = JobManager(store, metrics.collector)
    secured = JobServer(manager, ServerOptions("127.0.0.1", 0, [TOKEN]))
    open_ = JobServer(manager, ServerOptions("127.0.0.1", 0))  # auth off, same jobs
    try:
        secured.start()
        open_.start()
        yield {"stub": stub(secured.port), "port": secured.port, "open": stub(open_.port),
               "metrics": metrics.port, "manager": manager,
               "tmp": tmp_path_factory.mktemp("jobs")}
    finally:
        secured.stop(1.0)
        open_.stop(1.0)
        metrics.close()
        store.close()


MD = auth(TOKEN)


@pytest.fixture(scope="module")
def clean(server):
    """An uninterrupted job, watched from submit to the end."""
    s = server["stub"]
    job_id = submit(s, MD, job_overrides(server["tmp"], "clean", CLEAN))
    return job_id, watch(s, MD, job_id, timeout_s=180)


@pytest.mark.slow
def test_submit_then_watch_to_succeeded_and_replay_history(server, clean):
    s, (job_id, events) = server["stub"], clean
    assert states(events) == ["PLACING", "RUNNING", "SUCCEEDED"]
    assert [e["step"] for e in of(events, "step")] == list(range(1, 41))
    assert [e["step"] for e in of(events, "checkpoint")] == list(range(5, 41, 5))
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    job = s.GetJob(pb.GetJobRequest(job_id=job_id), timeout=10, metadata=MD)
    assert job.state == pb.JOB_STATE_SUCCEEDED and job.step == 40 and job.world_size == 2
    assert job.loss == pytest.approx(of(events, "step")[-1]["loss"], rel=1e-9)
    assert watch(s, MD, job_id, timeout_s=30) == events  # a finished job replays, then ends
    assert watch(s, MD, job_id, timeout_s=30, after_seq=events[-3]["seq"]) == events[-2:]
    ckpts = s.ListCheckpoints(pb.ListCheckpointsRequest(job_id=job_id), timeout=10, metadata=MD)
    committed = [v for v in ckpts.versions if v.committed]
    assert committed[-1].step == 40 and committed[-1].world_size == 2
    assert committed[-1].layout.dp == 2 and json.loads(committed[-1].manifest_json)["step"] == 40
    for call in (lambda: s.CancelJob(pb.CancelJobRequest(job_id=job_id), timeout=10, metadata=MD),
                 lambda: s.ScaleJob(pb.ScaleJobRequest(job_id=job_id, nodes=1), timeout=10,
                                    metadata=MD)):
        code, details = code_of(call)
        assert code == PRECONDITION and "SUCCEEDED" in details
    scrape = urllib.request.urlopen(f"http://127.0.0.1:{server['metrics']}/metrics",
                                    timeout=10).read().decode()
    assert f'tenax_job_state{{job="{job_id}",state="SUCCEEDED"}} 1.0' in scrape
    assert f'tenax_job_step{{job="{job_id}"}} 40.0' in scrape


@pytest.mark.slow
def test_scale_a_running_job_and_see_the_new_layout(server):
    s = server["stub"]
    # Long enough that the job is still running when the scheduler's grant reaches it (150
    # steps of ~15 ms were over on a fast host before the grant was looked at, 2 s later).
    job_id = submit(s, MD, job_overrides(server["tmp"], "scale", [
        "train.steps=300", "resources.nodes=1", "resources.gpus_per_node=1",
        "resources.max_nodes=64"]))
    before = watch(s, MD, job_id, timeout_s=120, until=lambda e: e["kind"] == "step")
    for nodes in (65, 0):
        code, details = code_of(lambda: s.ScaleJob(pb.ScaleJobRequest(job_id=job_id, nodes=nodes),
                                                   timeout=10, metadata=MD))
        assert code == INVALID and "max_nodes=64" in details
    # inside the spec's range but more than this cluster could ever hold: refused, not waited on
    code, details = code_of(lambda: s.ScaleJob(pb.ScaleJobRequest(job_id=job_id, nodes=64),
                                               timeout=10, metadata=MD))
    assert code == PRECONDITION and "--nodes 64" in details and "never fit" in details
    job = s.ScaleJob(pb.ScaleJobRequest(job_id=job_id, nodes=2), timeout=10, metadata=MD)
    assert job.target_nodes == 2
    events = watch(s, MD, job_id, timeout_s=180, after_seq=before[-1]["seq"])
    scaled = of(events, "scaled")
    assert len(scaled) == 1 and scaled[0]["from_world"] == 1 and scaled[0]["world_size"] == 2
    assert scaled[0]["layout"]["dp"] == 2 and scaled[0]["lost_steps"] == 0
    assert of(events, "step")[-1]["world_size"] == 2
    assert states(events)[-1] == "SUCCEEDED"


@pytest.mark.slow
def test_cancel_a_running_job_and_refuse_its_checkpoint_uri_meanwhile(server):
    s = server["stub"]
    overrides = job_overrides(server["tmp"], "cancel", [
        "train.steps=5000", "resources.nodes=1", "resources.gpus_per_node=1"])
    job_id = submit(s, MD, overrides)
    watch(s, MD, job_id, timeout_s=120, until=lambda e: e["kind"] == "step")
    code, details = code_of(lambda: submit(s, MD, overrides))
    assert code == PRECONDITION and "checkpoint.uri" in details and job_id in details
    job = s.CancelJob(pb.CancelJobRequest(job_id=job_id), timeout=10, metadata=MD)
    assert job.job_id == job_id
    events = watch(s, MD, job_id, timeout_s=60)
    assert states(events)[-1] == "CANCELLED"
    code, _ = code_of(lambda: s.CancelJob(pb.CancelJobRequest(job_id=job_id), timeout=10,
                                          metadata=MD))
    assert code == PRECONDITION


@pytest.mark.slow
def test_auth_health_and_reflection(server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    s, request = server["stub"], pb.ListJobsRequest()
    for md in ([], auth("wrong"), [("authorization", f"Basic {TOKEN}")], auth(TOKEN + "x")):
        code, details = code_of(lambda: s.ListJobs(request, timeout=10, metadata=md))
        assert code == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in details
    assert s.ListJobs(request, timeout=10, metadata=MD) is not None
    assert server["open"].ListJobs(request, timeout=10) is not None  # auth off: no token needed
    channel = grpc.insecure_channel(f"127.0.0.1:{server['port']}")
    health = health_pb2_grpc.HealthStub(channel)  # exempt from auth: probes send no metadata
    for service in ("", "tenax.v1.JobService"):
        answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    ask = [reflection_pb2.ServerReflectionRequest(list_services="")]
    answers = list(reflect.ServerReflectionInfo(iter(ask), timeout=10, metadata=MD))
    names = [svc.name for svc in answers[0].list_services_response.service]
    assert "tenax.v1.JobService" in names and "grpc.health.v1.Health" in names
    code, _ = code_of(lambda: list(reflect.ServerReflectionInfo(iter(ask), timeout=10)))
    assert code == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl for a test cert")
def test_tls_with_a_self_signed_certificate(server, tmp_path):
    from tenax.orchestrator.cli.client import Client
    from tenax.orchestrator.errors import RpcFailed
    from tenax.orchestrator.service.server import JobServer, ServerOptions

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True,
                   timeout=60)
    tls = JobServer(server["manager"], ServerOptions("127.0.0.1", 0, [TOKEN], str(cert), str(key)))
    tls.start()
    try:
        client = Client(f"127.0.0.1:{tls.port}", TOKEN, 10, tls_ca=str(cert))
        assert client.call("ListJobs", pb.ListJobsRequest()) is not None
        client.close()
        plain = Client(f"127.0.0.1:{tls.port}", TOKEN, 5)  # no TLS: refused by the handshake
        with pytest.raises(RpcFailed, match="UNAVAILABLE"):
            plain.call("ListJobs", pb.ListJobsRequest())
        plain.close()
    finally:
        tls.server.stop(1.0).wait(10)


@pytest.mark.slow
def test_bad_input_names_the_field_and_unknown_jobs_are_not_found(server):
    s = server["stub"]
    cases = [("{}", ["parallel.tp=3"], "parallel.tp"),
             ('{"train": {"steps": -1}}', [], "train.steps"),
             ('{"modle": {}}', [], "modle"),
             ("not json", [], "spec_json"),
             ("[1, 2]", [], "spec_json"),
             ("", [], "spec_json"),
             ("{}", ["no-equals-sign"], "KEY=VALUE"),
             ("{}", ["resources.nodes=9"], "resources.nodes")]
    for spec, overrides, field in cases:
        code, details = code_of(lambda: submit(s, MD, overrides, spec))
        assert code == INVALID and field in details, (spec, overrides, details)
    calls = [lambda i: s.GetJob(pb.GetJobRequest(job_id=i), timeout=10, metadata=MD),
             lambda i: s.CancelJob(pb.CancelJobRequest(job_id=i), timeout=10, metadata=MD),
             lambda i: s.ScaleJob(pb.ScaleJobRequest(job_id=i, nodes=1), timeout=10, metadata=MD),
             lambda i: watch(s, MD, i, timeout_s=10),
             lambda i: s.ListCheckpoints(pb.ListCheckpointsRequest(job_id=i), timeout=10,
                                         metadata=MD)]
    for call in calls:
        assert code_of(lambda: call("no-such-job"))[0] == NOT_FOUND
        assert code_of(lambda: call(""))[0] == INVALID


@pytest.mark.slow
def test_fuzzed_specs_and_rpcs_always_get_an_error_status(server):
    """>= 1000 malformed specs and RPCs: each answers an error status within its deadline
    (DEADLINE_EXCEEDED, UNKNOWN or a dropped server would fail), and no job is created."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    s, codes = server["stub"], []
    channel = grpc.insecure_channel(f"127.0.0.1:{server['port']}")
    allowed = {INVALID, NOT_FOUND, PRECONDITION, grpc.StatusCode.UNAUTHENTICATED}

    @settings(max_examples=1100, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(bad_specs().map(lambda c: ("spec", c[0], c[1])), bad_rpcs()))
    def check(case: tuple) -> None:
        code, details = fuzz_call(s, channel, MD, TOKEN, case)
        codes.append(code)
        if case[0] == "spec":
            assert code == INVALID, (case, details)
        elif case[0] == "raw":  # undecodable bytes: the framework answers INTERNAL
            assert code in allowed | {grpc.StatusCode.INTERNAL}, (case, code, details)
        else:
            assert code in allowed, (case, code, details)

    before = len(s.ListJobs(pb.ListJobsRequest(), timeout=10, metadata=MD).jobs)
    check()
    assert len(codes) >= 1000
    assert len(s.ListJobs(pb.ListJobsRequest(), timeout=10, metadata=MD).jobs) == before


@pytest.mark.slow
def test_cli_client_against_the_server(server, tmp_path):
    base = ["--server", f"127.0.0.1:{server['port']}"]
    env = {"TENAX_TOKEN": TOKEN}
    spec = tmp_path / "job.yaml"
    spec.write_text("name: cli\ntrain:\n  steps: 6\nresources:\n  nodes: 1\n  gpus_per_node: 1\n")
    sets = [a for o in job_overrides(tmp_path, "cli", [])[:-1] for a in ("--set", o)]
    done = run_cli(["submit", str(spec), *base, *sets], env)
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    assert re.fullmatch(r"cli-[0-9a-f]{8}", job_id)
    done = run_cli(["watch", job_id, *base], env)
    assert done.returncode == 0, done.stderr
    assert "Step 6 done" in done.stdout and "The job is SUCCEEDED" in done.stdout.splitlines()[-1]
    done = run_cli(["status", job_id, "--json", *base], env)
    doc = json.loads(done.stdout)
    assert doc["state"] == "SUCCEEDED" and doc["step"] == 6 and doc["total_steps"] == 6
    listing = json.loads(run_cli(["status", "--json", *base], env).stdout)
    assert job_id in [j["job_id"] for j in listing]
    assert job_id in run_cli(["status", *base], env).stdout  # the rich table
    lines = run_cli(["watch", job_id, "--json", *base], env).stdout.splitlines()
    assert json.loads(lines[-1])["state"] == "SUCCEEDED"
    failures = [(["cancel", job_id], env, "FAILED_PRECONDITION"),
                (["scale", job_id, "--nodes", "1"], env, "FAILED_PRECONDITION"),
                (["status", "no-such-job"], env, "NOT_FOUND"),
                (["status"], {"TENAX_TOKEN": ""}, "UNAUTHENTICATED"),
                (["status"], {"TENAX_TOKEN": ""}, "with --token or $TENAX_TOKEN"),
                (["submit", str(spec), "--set", "parallel.tp=3"], env, "parallel.tp")]
    for args, extra, expected in failures:
        done = run_cli([*args, *base], extra)
        assert done.returncode == 1 and expected in done.stderr, (args, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    done = run_cli(["status", "--server", "127.0.0.1:1", "--timeout", "2"], env)
    assert done.returncode == 1 and "UNAVAILABLE" in done.stderr


@pytest.mark.slow
def test_sigkilled_server_resumes_its_job_from_the_newest_checkpoint(ray_address, clean,
                                                                     tmp_path):
    """SIGKILL mid-job, restart on the same state dir (and port): the job finishes from its
    newest committed checkpoint with the clean run's losses; `tenax watch`, started before the
    kill, reconnects and shows every event once."""
    state, log = tmp_path / "state", tmp_path / "serve.log"
    args = ["--state-dir", str(state), "--address", ray_address, "--no-metrics",
            "--storage-root", f"file://{tmp_path}"]  # job_overrides puts checkpoints there
    first, watcher = ServerProcess(args, log), None
    try:
        s = stub(first.port)
        job_id = submit(s, [], job_overrides(tmp_path, "killed", CLEAN))
        watcher = subprocess.Popen(
            [sys.executable, "-m", "tenax.orchestrator.cli.main", "watch", job_id, "--json",
             "--server", f"127.0.0.1:{first.port}"], cwd=REPO, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        watch(s, [], job_id, timeout_s=120,
              until=lambda e: e["kind"] == "checkpoint" and e["step"] >= 10)
        first.kill()  # SIGKILL, mid-job
        second = ServerProcess(args + ["--port", str(first.port)], log)
        try:
            busy = run_cli(["serve", "--port", "0", *args], timeout_s=120)
            assert busy.returncode == 2 and "in use by another tenax serve" in busy.stderr
            events = watch(stub(second.port), [], job_id, timeout_s=180)
            out, err = watcher.communicate(timeout=120)
        finally:
            second.kill()
    finally:
        first.kill()
        if watcher is not None and watcher.poll() is None:
            watcher.kill()
    resumed_at = [e["seq"] for e in of(events, "resumed")]
    assert len(resumed_at) == 1 and states(events)[-1] == "SUCCEEDED", log.read_text()[-3000:]
    after = [e for e in of(events, "step") if e["seq"] > resumed_at[0]]
    assert after[0]["step"] > 10 and after[-1]["step"] == 40  # from a checkpoint, not step 0
    want = {e["step"]: e["loss"] for e in of(clean[1], "step")}
    for e in after:
        assert e["loss"] == pytest.approx(want[e["step"]], rel=1e-5), e
    assert watcher.returncode == 0 and "reconnecting" in err, err
    assert [json.loads(line)["seq"] for line in out.splitlines()] == [e["seq"] for e in events]


@pytest.mark.slow
def test_embedded_server_sigterm_keeps_jobs_resumable_and_stops_its_ray(tmp_path):
    private = tempfile.mkdtemp(prefix="tx-", dir="/tmp")  # short: Ray's socket paths
    state = tmp_path / "state"
    server = None
    try:
        server = ServerProcess(["--state-dir", str(state), "--gpus", "1", "--cpus", "2",
                                "--no-metrics", "--storage-root", f"file://{tmp_path}"],
                               tmp_path / "serve.log",
                               {"TMPDIR": private, "RAY_TMPDIR": private})
        assert pids_mentioning(private), "the embedded Ray should run under RAY_TMPDIR"
        s = stub(server.port)
        job_id = submit(s, [], job_overrides(tmp_path, "term", [
            "train.steps=5000", "resources.nodes=1", "resources.gpus_per_node=1"]))
        watch(s, [], job_id, timeout_s=120, until=lambda e: e["kind"] == "step")
        # The embedded service started this node's forkserver before Ray; the job's zygote
        # adopted it, so the training process is its child (no import paid per job).
        forkservers = [p for p in children(server.proc.pid)
                       if b"multiprocessing.forkserver" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(forkservers) == 1 and children(forkservers[0]), \
            (forkservers, children(server.proc.pid), server.tail())
        assert server.terminate(timeout_s=120) == 0, server.tail()
        wait_until(lambda: not pids_mentioning(private), 60, "the embedded Ray to exit")
    finally:
        if server is not None:
            server.kill()
        kill_mentioning(private)  # only what this test started
        shutil.rmtree(private, ignore_errors=True)
    from tenax.orchestrator.service.store import JobStore

    store = JobStore(state)
    try:
        job = store.get_job(job_id)
        assert job.state == "RUNNING" and not job.terminal
        assert [e.event.get("state") for e in store.events(job_id) if e.kind == "state"][-1] \
            == "RUNNING"
    finally:
        store.close()
