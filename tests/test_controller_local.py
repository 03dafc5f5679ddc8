"""Real jobs on a real local Ray: finish, survive a killed rank and a hang, fail cleanly."""
from __future__ import annotations

import contextlib

import pytest

from tenax.testing.clusters import local_ray
from tenax.testing.jobs import JobRun, assert_same_losses, make_spec, reference_losses, run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module", autouse=True)
def ray_on_loopback():
    with local_ray(gpus=4):
        yield


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    spec = make_spec(tmp_path_factory.mktemp("clean"), ["train.steps=20", "resources.nodes=1",
                                                          "resources.gpus_per_node=2"])
    return run_job(spec)


def test_clean_job_succeeds_on_loopback(clean):
    assert clean.controller.state.value == "SUCCEEDED"
    assert sorted(clean.losses()) == list(range(1, 21))
    placed = clean.of("placed")[0]
    assert placed["ips"] == ["127.0.0.1", "127.0.0.1"]
    assert [c["step"] for c in clean.of("checkpoint")] == [5, 10, 15, 20]
    done = clean.of("done")[0]
    assert 0 < done["goodput"]["goodput"] <= 1


def test_killed_rank_resumes_from_memory_losing_at_most_one_step(tmp_path, clean):
    spec = make_spec(tmp_path, ["train.steps=20", "resources.nodes=1", "resources.gpus_per_node=2"])
    job = run_job(spec, chaos="kill rank=1 at=13")
    assert job.controller.state.value == "SUCCEEDED"
    failure = job.of("failure")[0]
    assert failure["rank"] == 1 and "SIGKILL" in failure["cause"]
    recovered = job.of("recovered")[0]
    assert recovered["source"] == "memory"  # the agents' snapshots, not checkpoint step 10
    assert recovered["step"] in (11, 12) and recovered["lost_steps"] <= 1
    assert job.of("placed")[-1]["mode"] == "warm"
    # timed to rank 0's start, not to the poll that saw it: before the first resumed step
    resumed = [e for e in job.of("step") if e["time"] > failure["time"]][0]
    assert failure["time"] < recovered["time"] <= resumed["time"]
    assert recovered["seconds"] <= recovered["time"] - failure["time"] + 0.05
    assert_same_losses(job.losses(), clean.losses())
    assert job.controller.restarts == 1 and job.controller.lost_steps <= 1
    # Rank 0's first snapshot of each attempt is told (what one costs), not one per step
    snaps = job.of("snapshot")
    assert len(snaps) == 2 and snaps[0]["step"] == 1 and snaps[1]["step"] > recovered["step"]
    assert all(s["bytes"] > 0 for s in snaps)


def test_without_memory_snapshots_a_killed_rank_resumes_from_storage(tmp_path, clean):
    spec = make_spec(tmp_path, ["train.steps=20", "resources.nodes=1", "resources.gpus_per_node=2",
                                "checkpoint.memory_every_steps=0"])
    job = run_job(spec, chaos="kill rank=1 at=13")
    assert job.controller.state.value == "SUCCEEDED"
    recovered = job.of("recovered")[0]
    # The newest committed save: step 10's, unless a loaded host had not committed it yet three
    # steps later, when the rank died (then step 5's); every step after it up to 12 is redone.
    assert recovered["step"] in (10, 5) and recovered["source"] == "storage"
    assert recovered["lost_steps"] == 12 - recovered["step"]
    assert not job.of("snapshot")
    assert_same_losses(job.losses(), clean.losses())
    assert job.controller.restarts == 1
    assert job.controller.lost_steps == recovered["lost_steps"]


def test_hang_is_detected_by_the_hang_timeout(tmp_path, clean):
    spec = make_spec(tmp_path, ["train.steps=20", "resources.nodes=1", "resources.gpus_per_node=2",
                                "fault_tolerance.hang_timeout_s=6"])
    job = run_job(spec, chaos="hang rank=0 at=8")
    assert job.controller.state.value == "SUCCEEDED"
    failure = job.of("failure")[0]
    assert "hung" in failure["cause"] and "hang_timeout_s=6" in failure["cause"]
    assert_same_losses(job.losses(), clean.losses())


def test_max_restarts_exhaustion_fails_with_cause(tmp_path):
    spec = make_spec(tmp_path, ["train.steps=20", "resources.nodes=1", "resources.gpus_per_node=2",
                                "fault_tolerance.max_restarts=1"])
    job = run_job(spec, chaos="kill rank=0 at=4; kill rank=1 at=8")
    assert job.controller.state.value == "FAILED"
    assert "max_restarts=1 exhausted" in job.controller.cause
    assert "rank 1 died" in job.controller.cause


def test_bad_data_fails_the_job_after_one_replayed_restart(tmp_path):
    """A token id outside the vocabulary deep in the data fails its step on every attempt: the
    job restarts once, sees the same error at the same step, and fails with it instead of
    spending the other restarts on replays."""
    import numpy as np

    tokens = np.arange(40 * 32 + 1, dtype=np.uint16) % 64  # 40 samples of the SMALL job
    tokens[20 * 32 + 5] = 1000  # inside one sample: met within the first epoch's 5 steps
    data = tmp_path / "tokens.bin"
    data.write_bytes(tokens.astype("<u2").tobytes())
    spec = make_spec(tmp_path, ["train.steps=20", "resources.nodes=1",
                                "resources.gpus_per_node=2", f"data.source=file://{data}",
                                "data.token_dtype=uint16", "fault_tolerance.max_restarts=5"])
    job = run_job(spec)
    assert job.controller.state.value == "FAILED"
    assert job.controller.restarts == 1
    cause = job.controller.cause
    assert "token id outside [0, model.vocab_size=64)" in cause and "would replay it" in cause
    failures = job.of("failure")
    assert len(failures) == 2 and failures[0]["step"] == failures[1]["step"]


def test_scale_event_commits_then_replans_without_losing_steps(tmp_path, clean):
    spec = make_spec(tmp_path, ["train.steps=20", "resources.nodes=1", "resources.gpus_per_node=2",
                                "resources.max_nodes=2"])
    job = run_job(spec, chaos="scale nodes=2 at=8")
    assert job.controller.state.value == "SUCCEEDED"
    scaled = job.of("scaled")[0]
    assert scaled["from_world"] == 2 and scaled["world_size"] == 4
    assert scaled["lost_steps"] == 0
    assert_same_losses(job.losses(), clean.losses())


def test_a_finished_job_run_again_is_already_complete(tmp_path, clean):
    """Same checkpoint URI as the clean run: nothing to train, and the job says so."""
    again = JobRun(clean.controller.spec).start().finish()
    assert again.controller.state.value == "SUCCEEDED"
    done = again.of("done")[0]
    assert done["step"] == 20 and done["already_complete"] is True
    assert again.of("step") == []


def test_events_carry_the_time_they_happened(clean):
    steps = clean.of("step")
    assert all(isinstance(e["time"], float) for e in clean.events)
    times = [e["time"] for e in steps]
    assert times == sorted(times)  # rank 0's clock, step after step
    # relayed, not restamped: the controller publishes after a poll, the rank stamped earlier
    state_times = [e["time"] for e in clean.events if e["event"] == "state"]
    assert state_times[-1] >= times[-1]


def test_scale_and_cancel_from_eight_threads_at_once(tmp_path):
    """gRPC handler threads call scale() and cancel() concurrently; the loop drains them."""
    import threading

    spec = make_spec(tmp_path, ["train.steps=400", "resources.nodes=1", "resources.gpus_per_node=1",
                                "resources.max_nodes=2", "checkpoint.every_steps=100"])
    job = JobRun(spec).start()
    job.wait_for(lambda: job.controller.step >= 3, 240, "step 3")
    barrier, errors = threading.Barrier(8), []

    def client(i: int) -> None:
        try:
            barrier.wait()
            for k in range(50):
                job.controller.scale(1 + (i + k) % 2)
            if i % 2:
                job.controller.cancel()
        except Exception as err:  # every request must be accepted
            errors.append(err)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    job.finish()
    assert errors == []
    assert job.controller.state.value == "CANCELLED"
    assert job.controller.group is None  # workers stopped
    assert job.controller.target_nodes in (1, 2)
    assert job.of("state")[-1]["state"] == "CANCELLED"


def test_scale_arriving_as_the_job_finishes_its_last_step_succeeds(tmp_path, clean):
    spec = make_spec(tmp_path, ["train.steps=20", "resources.nodes=1", "resources.gpus_per_node=2",
                                "resources.max_nodes=2"])
    job = run_job(spec, chaos="scale nodes=2 at=20")
    assert job.controller.state.value == "SUCCEEDED", job.controller.cause
    assert job.controller.step == 20
    assert_same_losses(job.losses(), clean.losses())


def test_scale_arriving_while_a_rank_fails_recovers_and_rescales(tmp_path, clean):
    spec = make_spec(tmp_path, ["train.steps=20", "resources.nodes=1", "resources.gpus_per_node=2",
                                "resources.max_nodes=2"])
    job = run_job(spec, chaos="scale nodes=2 at=12; kill rank=1 at=12")
    assert job.controller.state.value == "SUCCEEDED", job.controller.cause
    assert job.of("failure") and job.of("failure")[0]["rank"] == 1
    assert job.of("placed")[-1]["world_size"] == 4  # recovered onto the requested 2 nodes
    assert job.controller.restarts == 1
    assert_same_losses(job.losses(), clean.losses())


def _training_parents(job: JobRun, seen: dict) -> bool:
    """Once the job has (re)started its ranks: their agents' pids and their training processes'
    parents (the forkserver they forked from) into `seen`."""
    import psutil

    group = job.controller.group
    if group is None or job.controller.step < 1:
        return False
    seen["agents"] = {h.pid for h in group.ranks}
    try:
        seen["parents"] = {psutil.Process(h.status["child_pid"]).ppid() for h in group.ranks}
    except (KeyError, TypeError, psutil.NoSuchProcess):
        return False
    return True


@contextlib.contextmanager
def launchers_forkserver():
    """A forkserver started here, as `tenax run` starts one before an embedded Ray, and what the
    controller is handed to adopt it ({"node_id", "endpoint"})."""
    from dataclasses import asdict

    import ray

    from tenax.workers import PRELOAD, NodeForkServer

    server = NodeForkServer(PRELOAD)
    try:
        yield server, {"node_id": ray.get_runtime_context().get_node_id(),
                       "endpoint": asdict(server.endpoint)}
    finally:
        server.close()


def test_the_agents_on_the_launchers_node_fork_from_its_forkserver_with_no_zygote(
        tmp_path, clean):
    """`tenax run` with an embedded Ray starts the node's forkserver before Ray, so the imports
    overlap Ray's start; the agents on that node fork from it, and no zygote starts there."""
    with launchers_forkserver() as (server, adopt):
        spec = make_spec(tmp_path, ["train.steps=20", "resources.nodes=1",
                                    "resources.gpus_per_node=2"])
        job = JobRun(spec, forkserver=adopt).start()
        seen: dict = {}
        job.wait_for(lambda: _training_parents(job, seen), 300, "the ranks forked")
        zygotes = [b["zygote"] for b in job.controller.group.blocks]
        job.finish(300)
    assert job.controller.state.value == "SUCCEEDED", job.controller.cause
    assert seen["parents"] == {server.endpoint.pid}
    assert zygotes == [None]
    assert_same_losses(job.losses(), clean.losses())


def test_a_killed_launcher_forkserver_leaves_the_agents_forking_their_own_from_memory(tmp_path):
    """The agents on the launcher's node fork from its forkserver. Killed, it takes the ranks
    with it; with no zygote there to start another, each agent — untouched, snapshots and all
    — starts a forkserver of its own (one import each) and its rank resumes from memory."""
    import os
    import signal

    import psutil

    with launchers_forkserver() as (server, adopt):
        spec = make_spec(tmp_path, ["train.steps=120", "resources.nodes=1",
                                    "resources.gpus_per_node=2"])
        job = JobRun(spec, forkserver=adopt).start()
        job.wait_for(lambda: job.controller.step >= 5, 300, "step 5")
        agents = {h.pid for h in job.controller.group.ranks}
        os.kill(server.endpoint.pid, signal.SIGKILL)
        seen: dict = {}
        job.wait_for(lambda: bool(job.of("recovered")) and _training_parents(job, seen), 300,
                     "the ranks forked again")
        job.finish(300)
    assert job.controller.state.value == "SUCCEEDED", job.controller.cause
    recovered = job.of("recovered")[0]
    assert recovered["source"] == "memory" and recovered["lost_steps"] <= 1, recovered
    failure = job.of("failure")[0]
    assert f"forkserver it was forked from (pid {server.endpoint.pid}) died" in failure["cause"]
    assert seen["agents"] == agents
    assert {psutil.Process(p).ppid() for p in seen["parents"]} == agents  # the agents' own
    assert_same_losses(job.losses(), reference_losses(spec))


def test_a_crashed_zygote_is_replaced_and_the_ranks_resume_from_memory(tmp_path):
    """Every training process of a node block forks from the block's zygote; when the zygote's
    process dies, its forkserver and the ranks forked from it die with it, Ray starts the
    zygote again (one import), and the agents — untouched, snapshots and all — fork from the
    new one. Enough steps that the resumed ranks are still training when their parents are
    looked at: on a quiet host 15 steps took 0.2 s and the job ended before the first look."""
    import os
    import signal

    import ray

    spec = make_spec(tmp_path, ["train.steps=120", "resources.nodes=1",
                                "resources.gpus_per_node=2"])
    job = JobRun(spec).start()
    job.wait_for(lambda: job.controller.step >= 5, 300, "step 5")
    zygote = job.controller.group.blocks[0]["zygote"]
    old = ray.get(zygote.endpoint.remote(60), timeout=90)
    agents = {h.pid for h in job.controller.group.ranks}
    os.kill(ray.get(zygote.pid.remote(), timeout=60), signal.SIGKILL)
    seen: dict = {}
    job.wait_for(lambda: bool(job.of("recovered")) and _training_parents(job, seen), 300,
                 "the ranks forked again")
    new = ray.get(zygote.endpoint.remote(60), timeout=90)
    job.finish(300)
    assert job.controller.state.value == "SUCCEEDED", job.controller.cause
    recovered = job.of("recovered")[0]
    assert recovered["source"] == "memory" and recovered["lost_steps"] <= 1, recovered
    failure = job.of("failure")[0]
    assert f"forkserver it was forked from (pid {old['pid']}) died" in failure["cause"], failure
    assert seen["agents"] == agents  # the same agents, with the snapshots they held
    assert new["pid"] != old["pid"] and seen["parents"] == {new["pid"]}  # the new zygote's
    assert_same_losses(job.losses(), reference_losses(spec))
