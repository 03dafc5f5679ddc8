"""`train.profile_steps` / `tenax run --profile-steps A:B`: every rank keeps a torch.profiler
trace (Chrome JSON) of steps A..B under `<checkpoint.uri>/diagnostics/<time>-profile/`, rank 0's
`profile` event names it, the losses are those of a run without it, and a bad range is a clear
error naming the flag (or key) and the value."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tenax.testing.jobs import run_cli
from tenax.workers.diagnostics import diagnostics_location
from tenax.workers.profiling import parse_profile_steps


@pytest.mark.parametrize("text", ["5:3", "a:b", "3", "1:2:3", "0:4", "1.5:2", ""])
def test_a_bad_range_names_the_flag_and_the_value(text: str):
    with pytest.raises(ValueError) as err:
        parse_profile_steps(text)
    assert "--profile-steps" in str(err.value) and repr(text) in str(err.value)


def test_a_good_range():
    assert parse_profile_steps("3:5") == (3, 5)
    assert parse_profile_steps("7:7") == (7, 7)


def test_the_spec_key_checks_the_window():
    from tenax.orchestrator.spec import SpecError, load_spec

    assert load_spec(overrides=["train.profile_steps=[2,4]"]).train.profile_steps == [2, 4]
    assert load_spec().train.profile_steps is None
    for bad in ("[4,2]", "[0,2]", "[3]", "[x,2]"):
        with pytest.raises(SpecError, match="train.profile_steps"):
            load_spec(overrides=[f"train.profile_steps={bad}"])


def test_the_location_sits_beside_the_hang_evidence():
    assert diagnostics_location("file:///c/ckpt/", "profile", 0.0) == \
        "file:///c/ckpt/diagnostics/19700101T000000.000Z-profile"


def test_two_requests_within_one_second_get_two_locations():
    # A profile request's id is the epoch milliseconds it was asked at; the location keeps them.
    first, second = (diagnostics_location("file:///c", "profile", ms / 1000)
                     for ms in (1_764_000_000_123, 1_764_000_000_999))
    assert first != second and first.endswith("T160000.123Z-profile"), (first, second)


@pytest.mark.slow  # a `tenax` process
def test_tenax_run_refuses_a_bad_range_before_starting_anything():
    done = run_cli(["run", "--profile-steps", "9:2"])
    assert done.returncode == 2 and "--profile-steps: '9:2'" in done.stderr, done.stderr


def launch_job(tmp_path: Path, extra: list[str], nproc: int = 2) -> tuple[Any, list[dict]]:
    from tenax.testing.jobs import make_spec
    from tenax.testing.ranks import rank_context
    from tenax.workers.launch import launch
    from tenax.workers.spec import layout_from_spec

    spec = make_spec(tmp_path, ["train.steps=8", "checkpoint.every_steps=8",
                                "checkpoint.memory_every_steps=0", *extra])
    events: list[dict] = []
    ok = launch(spec.to_dict(), layout_from_spec(spec, nproc).to_dict(), nproc, events.append,
                240, rank_context())
    assert ok, [e for e in events if e["event"] == "failure"]
    return spec, events


def trace_names(path: Path) -> set[str]:
    doc = json.loads(path.read_text())
    return {e.get("name", "") for e in doc["traceEvents"]}


@pytest.mark.slow  # two training processes
@pytest.mark.timeout(600)
def test_every_rank_keeps_a_trace_of_the_window_and_the_losses_do_not_change(tmp_path: Path):
    from tenax.testing.jobs import assert_same_losses, reference_losses

    spec, events = launch_job(tmp_path, ["train.profile_steps=[3,5]"])
    profiles = [e for e in events if e["event"] == "profile"]
    assert len(profiles) == 1 and profiles[0]["steps"] == [3, 5], profiles
    location = profiles[0]["diagnostics"]
    assert location.startswith(spec.checkpoint.uri.rstrip("/") + "/diagnostics/")
    assert location.endswith("-profile") and profiles[0]["written"] is True
    local = Path(location.removeprefix("file://"))
    assert sorted(p.name for p in local.iterdir()) == ["rank-0.trace.json", "rank-1.trace.json"]
    for rank in (0, 1):
        names = trace_names(local / f"rank-{rank}.trace.json")
        assert any(n.startswith("aten::") for n in names), sorted(names)[:20]
    losses = {e["step"]: e["loss"] for e in events if e["event"] == "step" and e["rank"] == 0}
    plain = spec.model_copy(update={"train": spec.train.model_copy(
        update={"profile_steps": None})})  # the reference must run without the profiler
    assert_same_losses(losses, reference_losses(plain))
    steps = {e["step"]: e["step_s"] for e in events if e["event"] == "step" and e["rank"] == 0}
    inside = sum(steps[s] for s in (3, 4, 5)) / 3
    outside = sum(steps[s] for s in (2, 6, 7)) / 3
    print(f"profile: step_s inside the window {inside:.4f} s vs outside {outside:.4f} s, "
          f"trace export {profiles[0]['export_s']:.3f} s")


@pytest.mark.slow  # `tenax run` on an embedded Ray
@pytest.mark.timeout(600)
def test_tenax_run_profile_steps_writes_traces_and_a_profile_event(tmp_path: Path):
    from tenax.testing.jobs import job_overrides, read_events

    log = tmp_path / "log.jsonl"
    sets = [a for o in job_overrides(tmp_path, "prof", ["train.steps=6",
                                                        "resources.nodes=1",
                                                        "resources.gpus_per_node=2"])
            for a in ("--set", o)]
    done = run_cli(["run", *sets, "--profile-steps", "2:3", "--log-json", str(log)],
                   env={"RAY_AUTH_MODE": "disabled"}, timeout_s=400)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    profiles = [e for e in read_events(log) if e["event"] == "profile"]
    assert len(profiles) == 1 and profiles[0]["steps"] == [2, 3], profiles
    local = Path(profiles[0]["diagnostics"].removeprefix("file://"))
    assert sorted(p.name for p in local.iterdir()) == ["rank-0.trace.json", "rank-1.trace.json"]
    assert "Profiled steps 2-3 on every rank" in done.stdout + done.stderr


# ---- a running job, on request (`tenax profile JOB_ID --steps N`) -------------------------
def test_a_request_is_handled_once_and_waits_for_a_window_being_recorded():
    from tenax.orchestrator.spec import load_spec
    from tenax.workers.profiling import ProfileWindows

    spec = load_spec(overrides=["checkpoint.uri=file:///c/ck"])
    windows = ProfileWindows(spec, rank=1, storage_options=None)
    assert windows.current is None  # no spec window
    windows.on_request(1_700_000_000_000, 3, next_step=11)
    first = windows.current
    assert (first.first, first.last, first.request) == (11, 13, 1_700_000_000_000)
    assert first.location == "file:///c/ck/diagnostics/20231114T221320.000Z-profile"
    windows.on_request(1_700_000_000_000, 3, next_step=12)  # a rank that read it late
    assert windows.current is first
    first.active = object()  # being recorded: a newer request waits for its end
    windows.on_request(1_700_000_005_000, 2, next_step=12)
    assert windows.current is first
    first.active = None
    windows.on_request(1_700_000_005_000, 2, next_step=14)
    assert (windows.current.first, windows.current.last) == (14, 15)


def test_the_control_channel_reads_stop_and_the_latest_profile_request():
    import multiprocessing as mp

    from tenax.workers.rank import ControlChannel

    read, write = mp.Pipe(duplex=False)
    channel = ControlChannel(read)
    assert channel.profile_request() == (0, 0) and not channel.should_stop()
    write.send(("profile", 5, 3))
    write.send(("profile", 7, 2))
    assert channel.profile_request() == (7, 2) and not channel.should_stop()
    write.send("stop")
    assert channel.should_stop() and channel.profile_request() == (7, 2)
    write.close()
    assert ControlChannel(read).should_stop()  # the agent is gone: stop


class FakeController:
    def __init__(self, state: str) -> None:
        from tenax.orchestrator.job.states import JobState

        self.job_id, self.state, self.group, self.step = "j", JobState(state), None, 0


def test_a_request_names_the_steps_or_the_state_that_refuses_it():
    from tenax.orchestrator.job.profiling import ProfileUnavailable, request_profile

    for bad in (0, -1, 1001, "3", True):
        with pytest.raises(ValueError, match=r"steps: .* must be an integer in \[1, 1000\]"):
            request_profile(FakeController("RUNNING"), bad)
    with pytest.raises(ProfileUnavailable, match="RECOVERING"):
        request_profile(FakeController("RECOVERING"), 3)


@pytest.mark.slow  # a service, a Ray cluster and a job
@pytest.mark.timeout(600)
def test_tenax_profile_records_the_next_steps_of_a_service_job(tmp_path: Path):
    from tests.service_helpers import code_of, submit, stub, watch

    from tenax.orchestrator.service.jobs import JobManager
    from tenax.orchestrator.service.server import JobServer, ServerOptions
    from tenax.orchestrator.service.store import JobStore
    from tenax.testing.clusters import local_ray
    from tenax.testing.jobs import job_overrides
    from tenax.proto import jobs_pb2 as pb

    with local_ray(gpus=2):
        store = JobStore(tmp_path / "state", exclusive=True)
        server = JobServer(JobManager(store), ServerOptions("127.0.0.1", 0))
        server.start()
        try:
            s = stub(server.port)
            job_id = submit(s, [], job_overrides(tmp_path, "prof", [
                "train.steps=100000", "resources.nodes=1", "resources.gpus_per_node=2",
                "checkpoint.every_steps=100000"]))
            watch(s, [], job_id, timeout_s=180, until=lambda e: e["kind"] == "step")
            where = f"127.0.0.1:{server.port}"
            bad = run_cli(["profile", job_id, "--steps", "0", "--server", where])
            assert bad.returncode == 2 and "--steps: must be at least 1" in bad.stderr, \
                bad.stderr  # the CLI refuses before calling
            code, details = code_of(lambda: s.ProfileJob(
                pb.ProfileJobRequest(job_id=job_id, steps=0), timeout=30))
            assert code.name == "INVALID_ARGUMENT" and "steps: 0" in details, (code, details)
            done = run_cli(["profile", job_id, "--steps", "3", "--wait", "--server", where],
                           timeout_s=240)
            s.CancelJob(pb.CancelJobRequest(job_id=job_id), timeout=10)
        finally:
            server.stop(1.0)
            store.close()
    assert done.returncode == 0, done.stdout + done.stderr
    location = done.stdout.strip().splitlines()[-1].split(" are at ")[-1]
    assert "-profile" in location and location in done.stdout.splitlines()[0]
    local = Path(location.removeprefix("file://"))
    assert sorted(p.name for p in local.iterdir()) == ["rank-0.trace.json", "rank-1.trace.json"]
    assert any(n.startswith("aten::") for n in trace_names(local / "rank-1.trace.json"))
