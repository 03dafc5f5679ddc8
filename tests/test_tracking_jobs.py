"""Tracking on real ranks: rank 0 of a local gloo job writes every step to TensorBoard and
W&B, a broken tracking directory leaves the clean losses (and says so in one event), a killed
rank 0 recovers into the same run (the redone steps read back once, with their final values),
and `tenax run` run again on its checkpoint continues the same W&B run."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tenax.workers.trainer import lr_at
from tenax.workers.tracking import TrackingStart, wandb_run_id
from tests.test_tracking import f32
from tests.tracking_readers import tensorboard_scalars, tensorboard_texts, wandb_run


# ---- real ranks (local gloo processes) ---------------------------------------------------------
def launch_job(tmp_path: Path, extra: list[str], world: int = 1) -> tuple[Any, list[dict]]:
    from tenax.parallel.layout import ParallelLayout
    from tenax.testing.jobs import make_spec
    from tenax.testing.ranks import rank_context
    from tenax.workers.launch import launch

    spec = make_spec(tmp_path, ["train.steps=6", "checkpoint.memory_every_steps=0"] + extra)
    events: list[dict[str, Any]] = []
    layout = ParallelLayout(dp=world, zero=0 if world == 1 else 1, micro_batch_size=1)
    assert launch(spec.to_dict(), layout.to_dict(), world, events.append, 180, rank_context())
    return spec, events


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch) -> Path:
    pytest.importorskip("wandb")
    root = tmp_path / "wandb-dir"
    root.mkdir()
    for key, value in {"WANDB_DIR": str(root), "WANDB_SILENT": "true", "WANDB_MODE": "offline",
                       "WANDB_DISABLE_GIT": "true", "WANDB_API_KEY": ""}.items():
        monkeypatch.setenv(key, value)
    return root


@pytest.mark.slow
def test_rank_zero_writes_every_step_to_tensorboard_and_wandb(tmp_path, wandb_offline):
    tb = tmp_path / "tb"
    spec, events = launch_job(tmp_path, [f"logging.tensorboard_dir={tb}",
                                         "logging.wandb={project: tenax-test, mode: offline}"],
                              world=2)
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, 7))
    for e in steps:  # the pinned fields, with lr the schedule's and grad_norm before clipping
        assert e["lr"] == pytest.approx(lr_at(e["step"] - 1, spec))
        assert e["grad_norm"] > 0 and e["tokens_per_s"] > 0
    scalars = tensorboard_scalars(tb)
    for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
        assert scalars[f"train/{key}"] == [(e["step"], f32(e[key])) for e in steps], key
    checkpoints = [e for e in events if e["event"] == "checkpoint"]
    assert scalars["checkpoint/blocked_s"] == [(c["step"], f32(c["blocked_s"]))
                                               for c in checkpoints]
    runs = list((wandb_offline / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    run = wandb_run(runs[0])
    assert run["id"] == wandb_run_id("", spec.to_dict())
    assert run["config"]["train"]["steps"] == 6 and run["config"]["model"]["dim"] == 32
    rows = [r for r in run["history"] if "train/loss" in r]
    assert [(r["_step"], r["train/loss"], r["train/grad_norm"]) for r in rows] == \
        [(e["step"], e["loss"], e["grad_norm"]) for e in steps]


@pytest.mark.slow
def test_a_broken_tensorboard_dir_leaves_the_clean_losses(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    _, clean = launch_job(tmp_path / "clean", [])
    _, broken = launch_job(tmp_path / "broken", [f"logging.tensorboard_dir={blocker}/tb"])
    losses = {e["step"]: e["loss"] for e in clean if e["event"] == "step"}
    assert {e["step"]: e["loss"] for e in broken if e["event"] == "step"} == losses
    assert sorted(losses) == list(range(1, 7))
    assert not any(e["event"] == "failure" for e in broken)
    offs = [e for e in broken if e["event"] == "tracking_off"]  # what the user is told
    assert len(offs) == 1 and offs[0]["backend"] == "tensorboard", offs
    assert offs[0]["reason"].startswith("open failed: ") and offs[0]["rank"] == 0
    assert not any(e["event"] == "tracking_off" for e in clean)


# ---- a kill-and-recover drill on a real local Ray ------------------------------------------
def final_values(events: list[dict[str, Any]], key: str) -> dict[int, float]:
    """Step -> the last value of `key` the job logged for it (a redone step's final value)."""
    return {e["step"]: e[key] for e in events if e.get("event") == "step"}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_killed_rank_zero_recovers_into_the_same_run(tmp_path, wandb_offline):
    from tenax.testing.clusters import local_ray
    from tenax.testing.jobs import make_spec, run_job

    tb = tmp_path / "tb"
    spec = make_spec(tmp_path, ["train.steps=16", "resources.nodes=1",
                                "resources.gpus_per_node=2", "checkpoint.memory_every_steps=0",
                                f"logging.tensorboard_dir={tb}",
                                "logging.wandb={project: tenax-test, mode: offline}"])
    with local_ray(gpus=2):  # started after the fixture set WANDB_*: the agents inherit them
        job = run_job(spec, chaos="kill rank=0 at=13")
    assert job.state == "SUCCEEDED"
    recovered = job.of("recovered")[0]
    assert (recovered["step"], recovered["lost_steps"]) == (10, 2)  # steps 11 and 12 redone
    assert [e["step"] for e in job.of("step")].count(11) == 2
    scalars = tensorboard_scalars(tb)
    for key in ("loss", "tokens_per_s", "grad_norm", "lr"):  # tokens/s differs per attempt
        final = final_values(job.events, key)
        assert scalars[f"train/{key}"] == [(s, f32(final[s])) for s in range(1, 17)], key
    assert [step for step, _ in tensorboard_texts(tb)["attempts"]] == [1, 11]
    job_run = tensorboard_scalars(tb / "job")  # the controller's side, a run of its own
    assert job_run["job/restarts"] == [(10, 1.0)] and job_run["job/lost_steps"] == [(10, 2.0)]
    failures = tensorboard_texts(tb / "job")["failures"]
    assert len(failures) == 1 and "rank 0 failed" in failures[0][1]
    runs = sorted((wandb_offline / "wandb").glob("offline-run-*"))
    # One directory per attempt, one run id: `wandb sync` makes them one run. (The killed
    # attempt may have died inside wandb.init, before writing a record: only names are sure.
    # Two attempts that open within one second share the timestamp: W&B then adds "-1".)
    run_id = wandb_run_id(job.controller.job_id, {})
    named = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{re.escape(run_id)}(-\d+)?")
    assert len(runs) == 2 and all(named.fullmatch(r.name) for r in runs), runs
    second = wandb_run(runs[1])
    assert second["id"] == run_id
    steps = [r["_step"] for r in second["history"] if "train/loss" in r]
    assert steps == list(range(11, 17))
    final = final_values(job.events, "tokens_per_s")
    assert [r["train/tokens_per_s"] for r in second["history"] if "train/loss" in r] == \
        [final[s] for s in steps]
    # The controller's totals (its `recovered` event, the `job` run) in the attempt's first row.
    assert [(r["_step"], r["job/restarts"], r["job/lost_steps"])
            for r in second["history"] if "job/restarts" in r] == \
        [(recovered["step"] + 1, 1, recovered["lost_steps"])]


# ---- `tenax run`, run again on its checkpoint --------------------------------------------------
def test_tenax_run_names_the_wandb_run_by_the_spec_not_the_process(tmp_path, monkeypatch):
    import contextlib

    import tenax.orchestrator.cli.runner as runner
    import tenax.orchestrator.job.controller as controller
    from tenax.orchestrator.job.controller import JobState
    from tenax.testing.jobs import make_spec

    given: list[Any] = []

    class Recorded:  # the Controller run_job builds, without Ray
        def __init__(self, spec: Any, options: Any) -> None:
            given.append(options)
            self.job_id, self.step, self.cause = "x-1", spec.train.steps, ""

        def run(self) -> JobState:
            return JobState.SUCCEEDED

    monkeypatch.setattr(runner, "ray_session", lambda *a: contextlib.nullcontext(None))
    monkeypatch.setattr(controller, "Controller", Recorded)
    spec = make_spec(tmp_path, [])
    again = spec.model_copy(update={"train": spec.train.model_copy(update={"steps": 99})})
    assert runner.run_job(spec) == 0 and runner.run_job(again) == 0  # two processes' worth
    assert [o.tracking_id for o in given] == [wandb_run_id("", spec.to_dict())] * 2
    assert runner.tracking_id(make_spec(tmp_path, [])) != runner.tracking_id(spec)  # other uri
    monkeypatch.undo()
    # The controller hands it to every start of the ranks; without one (the service), the job id.
    ranks = controller.Controller(spec, controller.ControllerOptions(tracking_id="t")).placer
    assert ranks.tracking() == TrackingStart("t", 0, 0, 0)
    service = controller.Controller(spec, controller.ControllerOptions(job_id="job-7"))
    assert service.placer.tracking().run_id == "job-7"


@pytest.mark.slow  # two `tenax run`s on an embedded Ray
@pytest.mark.timeout(900)
def test_tenax_run_again_continues_the_wandb_run_and_says_tracking_is_off(tmp_path,
                                                                          wandb_offline):
    from tenax.orchestrator.spec import load_spec
    from tenax.testing.jobs import job_overrides, read_events, run_cli

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    base = job_overrides(tmp_path, "again", ["resources.nodes=1", "resources.gpus_per_node=1",
                                             "checkpoint.memory_every_steps=0",
                                             f"logging.tensorboard_dir={blocker}/tb",
                                             "logging.wandb={project: tenax-test, mode: offline}"])
    for steps in (3, 5):  # the second resumes the first's checkpoint of step 3
        log = tmp_path / f"log-{steps}.jsonl"
        sets = [a for o in base + [f"train.steps={steps}"] for a in ("--set", o)]
        done = run_cli(["run", *sets, "--log-json", str(log)],
                       env={"RAY_AUTH_MODE": "disabled"}, timeout_s=400)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        offs = [e for e in read_events(log) if e["event"] == "tracking_off"]
        # once for rank 0's run and once for the controller's own (`job`) run
        assert sorted(e.get("run", "rank 0") for e in offs) == ["job", "rank 0"], offs
        assert all(e["backend"] == "tensorboard" for e in offs), offs
        said = done.stdout + done.stderr
        assert said.count("Tracking to tensorboard is off") == 1
        assert said.count("Tracking to tensorboard (the job's own run) is off") == 1
    runs = sorted((wandb_offline / "wandb").glob("offline-run-*"))
    spec = load_spec(overrides=base)
    assert len(runs) == 2 and {wandb_run(r)["id"] for r in runs} == {
        wandb_run_id("", spec.to_dict())}
    assert [r["_step"] for r in wandb_run(runs[1])["history"] if "train/loss" in r] == [4, 5]

