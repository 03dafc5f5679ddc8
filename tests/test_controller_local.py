"""Real jobs on a real local Ray: finish, survive a killed rank and a hang, fail cleanly."""
from __future__ import annotations

import pytest

from tests.ray_helpers import assert_same_losses, make_spec, run_job, start_local_ray

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    import ray

    start_local_ray(gpus=4)
    yield
    ray.shutdown()


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


def test_killed_rank_resumes_from_checkpoint_with_same_losses(tmp_path, clean):
    spec = make_spec(tmp_path, ["train.steps=20", "resources.nodes=1", "resources.gpus_per_node=2"])
    job = run_job(spec, chaos="kill rank=1 at=13")
    assert job.controller.state.value == "SUCCEEDED"
    failure = job.of("failure")[0]
    assert failure["rank"] == 1 and "SIGKILL" in failure["cause"]
    recovered = job.of("recovered")[0]
    assert recovered["step"] == 10  # newest committed checkpoint before the kill
    assert recovered["lost_steps"] == 2  # steps 11 and 12 were redone
    assert job.of("placed")[-1]["mode"] == "warm"
    assert_same_losses(job.losses(), clean.losses())
    assert job.controller.restarts == 1 and job.controller.lost_steps == 2


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


def test_scale_event_commits_then_replans_without_losing_steps(tmp_path, clean):
    spec = make_spec(tmp_path, ["train.steps=20", "resources.nodes=1", "resources.gpus_per_node=2",
                                "resources.max_nodes=2"])
    job = run_job(spec, chaos="scale nodes=2 at=8")
    assert job.controller.state.value == "SUCCEEDED"
    scaled = job.of("scaled")[0]
    assert scaled["from_world"] == 2 and scaled["world_size"] == 4
    assert scaled["lost_steps"] == 0
    assert_same_losses(job.losses(), clean.losses())
