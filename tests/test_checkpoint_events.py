"""Every committed checkpoint version is told exactly once, as one `checkpoint` event.

A save ends on its writer's thread; told only when the training thread next polled it, a commit
that ended while rank 0 was blocked in a collective (a peer hung or died) was never told, though
the version was on storage. Rank 0's writer now hands the event over as the commit is written;
a rank killed before that is told of by the controller, from the catalog (orchestrator/job/
progress.py; a real job cannot time that kill, so its test drives the controller's ledger over
a real catalog). The job pauses rank 0's writer (TENAX_CKPT_FAULT=pause:DIR, rank 0 only, armed
for the whole Ray session and re-armed by removing DIR/release) to decide when the commit lands.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tenax.checkpoint import Catalog, CommitInfo, Storage, version_name
from tenax.checkpoint.save import commit_event
from tenax.orchestrator.job.facts import Recovery, Rescaling
from tenax.orchestrator.job.progress import JobProgress, committed_events
from tenax.testing.clusters import start_local_ray
from tenax.testing.jobs import JobRun, make_spec

JOB = ["train.steps=20", "resources.nodes=1", "resources.gpus_per_node=2",
       "checkpoint.every_steps=10", "checkpoint.keep_last=10", "fault_tolerance.hang_timeout_s=8"]


@pytest.fixture(scope="module")
def pause_dir(tmp_path_factory):
    """A local Ray whose rank processes pause rank 0's checkpoint writer half-way through its
    shard until `pause_dir/release` exists."""
    import ray

    folder = tmp_path_factory.mktemp("pause")
    saved = {k: os.environ.get(k) for k in ("TENAX_CKPT_FAULT", "TENAX_CKPT_FAULT_RANKS")}
    os.environ.update(TENAX_CKPT_FAULT=f"pause:{folder}", TENAX_CKPT_FAULT_RANKS="0")
    start_local_ray(gpus=4)  # its workers, hence the rank processes, inherit the environment
    yield folder
    (folder / "release").touch()
    ray.shutdown()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def rearm(folder: Path) -> None:
    for path in folder.iterdir():
        path.unlink()


def commits_on_storage(uri: str) -> list[tuple[int, str]]:
    catalog = Catalog(Storage(uri))
    return [(step, catalog.manifest(step).created_at) for step in catalog.committed_steps()]


def told(job: JobRun) -> list[tuple[int, str]]:
    return sorted((e["step"], e["created_at"]) for e in job.of("checkpoint"))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_commit_while_rank_0_waits_on_a_hung_peer_is_told_at_once(tmp_path, pause_dir):
    rearm(pause_dir)
    spec = make_spec(tmp_path, JOB)
    job = JobRun(spec, chaos="hang rank=1 at=12").start()
    # Rank 0 reported step 11, so it has passed its last poll and waits in step 12 for rank 1,
    # which hangs; only now may the save of step 10 commit.
    job.wait_for(lambda: any(e["step"] >= 11 for e in job.of("step"))
                 and (pause_dir / "writer-r0-s10.pid").exists(), 240,
                 "step 11 with rank 0's save of step 10 paused")
    (pause_dir / "release").touch()
    job.finish()
    assert job.state == "SUCCEEDED"
    assert told(job) == commits_on_storage(spec.checkpoint.uri)  # each exactly once
    assert [e["step"] for e in job.of("checkpoint")] == [10, 20]
    ten = job.of("checkpoint")[0]
    assert "told_by" not in ten  # rank 0 told it, from its writer's thread ...
    assert ten["t"] < job.of("failure")[0]["t"]  # ... while the hang was not yet detected
    assert ten["blocked_s"] >= 0 and ten["total_s"] > 0 and ten["bytes"] > 0


# ---- the controller's ledger over a real catalog, without a job -------------------------------
META = dict(layout={"dp": 2, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero": 1}, world_size=2,
            model_hash="abc", data_cursor=0, seed=7, lr_step=0)


def commit(catalog: Catalog, step: int, after: str = "") -> dict[str, Any]:
    """Commit `step` (a created_at other than `after`); the event its rank 0 would tell."""
    while True:
        catalog.begin(step, replace_committed=True)
        catalog.storage.write_bytes(f"{version_name(step)}/shard", b"x" * 64)
        event = commit_event(catalog.commit(CommitInfo(step=step, extra={"writer": "thread"},
                                                       **META)))
        if event["created_at"] != after:  # the name has milliseconds
            return {**event, "rank": 0}


def test_the_controller_tells_from_storage_only_the_commits_no_rank_told(tmp_path):
    uri = f"file://{tmp_path}/ckpt"
    catalog = Catalog(Storage(uri))
    commit(catalog, 3)  # an earlier run's: told by the controller of that run
    progress = JobProgress("j", read_commits=committed_events(uri, 30.0))

    def absorb(*records: dict[str, Any]) -> list[tuple[int, str, str]]:
        notices = progress.absorb(list(records), None, Rescaling(), Recovery())
        return [(n.fields["step"], n.fields["created_at"], n.fields.get("told_by", "rank"))
                for n in notices if n.event == "checkpoint"]

    def started(step: int) -> dict[str, Any]:
        return {"event": "started", "rank": 0, "step": step}

    assert absorb(started(0)) == []
    five = commit(catalog, 5)
    assert absorb(five) == [(5, five["created_at"], "rank")]
    ten = commit(catalog, 10)  # rank 0 was killed before it told of it
    assert absorb(started(10)) == [(10, ten["created_at"], "controller")]
    assert absorb(started(10)) == []  # never twice
    # An attempt resumed below step 10 saves it again: another commit, told by its rank ...
    absorb(started(5))
    again = commit(catalog, 10, after=ten["created_at"])
    assert absorb(again) == [(10, again["created_at"], "rank")]
    # ... or, killed before telling, by the controller; the same commit is never told twice.
    assert absorb(started(5)) == []
    third = commit(catalog, 10, after=again["created_at"])
    commit(catalog, 15)
    assert absorb(started(12)) == [(10, third["created_at"], "controller")]  # 15: this attempt
    ended = list(progress.untold_commits())  # the job ended: every commit is told
    assert [n.event for n in ended] == ["checkpoint"]
    rank_fields = {k: v for k, v in commit_event(catalog.manifest(15)).items() if k != "event"}
    assert {k: v for k, v in ended[0].fields.items() if k not in ("time", "told_by")} == \
        rank_fields  # what rank 0 would have told, from the manifest
    assert ended[0].fields["told_by"] == "controller" and ended[0].fields["time"] > 0
    assert list(progress.untold_commits()) == []
