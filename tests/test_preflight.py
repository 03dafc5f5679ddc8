"""`tenax preflight` and `tenax run --preflight` / `preflight:`: the job itself for a few steps
on scratch checkpoints, judged row by row (data, memory, progress, throughput, links, recovery); the
real run afterwards starts at step 0 and trains exactly as a run without a preflight."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from tenax.orchestrator.preflight import (Row, memory_plan_row, memory_row, overall,
                                          progress_row, recovery_row, scratch_spec)
from tenax.orchestrator.preflight.data import data_row
from tenax.orchestrator.spec import load_spec
from tenax.testing.jobs import (SMALL, assert_same_losses, read_events, reference_losses,
                                run_cli)

ONE_NODE = ["resources.nodes=1", "resources.min_nodes=1", "resources.max_nodes=1",
            "resources.gpus_per_node=2"]
GIB = 2 ** 30


def small(tmp_path: Path, *extra: str) -> list[str]:
    return [*SMALL, *ONE_NODE, f"checkpoint.uri=file://{tmp_path}/ckpt", "name=pf", *extra]


def flags(overrides: list[str]) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


def token_file(path: Path, n: int, bad_at: int | None = None) -> Path:
    """A flat uint16 token file of ids in [0, 64), one id 100 at `bad_at`."""
    tokens = (np.arange(n) * 7 % 64).astype("<u2")
    if bad_at is not None:
        tokens[bad_at] = 100
    path.write_bytes(tokens.tobytes())
    return path


# ---- the rules, without a job ----------------------------------------------------------------
def test_overall_is_the_worst_row():
    rows = [Row("a", "", "", "pass"), Row("b", "", "", "warn")]
    assert overall(rows) == "warn"
    assert overall(rows + [Row("c", "", "", "fail")]) == "fail"
    assert overall([]) == "pass"
    with pytest.raises(ValueError, match="verdict"):
        Row("x", "", "", "maybe")


def test_memory_rows_judge_against_the_budget():
    assert memory_plan_row(5 * GIB, 4 * GIB, "dp2").verdict == "fail"
    assert memory_plan_row(1 * GIB, 4 * GIB, "dp2").verdict == "pass"
    assert memory_row({0: GIB, 1: 5 * GIB}, GIB, 4 * GIB, False, "dp2").verdict == "fail"
    assert "rank 1" in memory_row({0: GIB, 1: 5 * GIB}, GIB, 4 * GIB, False, "dp2").detail
    assert memory_row({0: int(3.8 * GIB)}, GIB, 4 * GIB, False, "dp2").verdict == "warn"
    assert memory_row({0: 2 * GIB}, GIB, 4 * GIB, False, "dp2").verdict == "pass"
    # on CUDA the allocator's peak is held to the planner's figure too
    assert memory_row({0: 2 * GIB}, GIB, 4 * GIB, True, "dp2").verdict == "warn"
    assert memory_row({}, GIB, 4 * GIB, False, "dp2").verdict == "fail"


def test_progress_wants_every_step_and_a_falling_loss():
    assert progress_row([4.0, 3.9, 3.5, 3.0], 4, "SUCCEEDED", "").verdict == "pass"
    assert progress_row([3.0, 3.5, 3.9, 4.0], 4, "SUCCEEDED", "").verdict == "warn"
    row = progress_row([4.0, 3.9], 4, "FAILED", "rank 1 hung")
    assert row.verdict == "fail" and "rank 1 hung" in row.detail
    assert progress_row([4.0, float("nan"), 3.0, 2.0], 4, "SUCCEEDED", "").verdict == "fail"


def test_recovery_wants_the_same_loss_from_the_loaded_state():
    assert recovery_row(7, [], 7, 3.0, 3.0).verdict == "pass"
    assert recovery_row(7, [], 7, 3.0, 3.1).verdict == "fail"
    assert recovery_row(7, [], None, 3.0, 3.0).verdict == "fail"
    assert recovery_row(7, ["shard-0: checksum"], 7, 3.0, 3.0).detail == "shard-0: checksum"


def test_data_row_names_the_file_with_a_bad_token(tmp_path):
    path = token_file(tmp_path / "bad.tok", 40_000, bad_at=33_333)
    row = data_row(load_spec(overrides=small(tmp_path, f"data.source=file://{path}")), 4)
    assert row.verdict == "fail"
    assert "bad.tok" in row.detail and "100" in row.detail
    good = token_file(tmp_path / "good.tok", 40_000)
    assert data_row(load_spec(overrides=small(tmp_path, f"data.source=file://{good}")),
                    4).verdict == "pass"


def test_scratch_spec_keeps_the_job_and_moves_its_checkpoints(tmp_path):
    spec = load_spec(overrides=small(tmp_path, "train.steps=30"))
    scratch = scratch_spec(spec, 8, f"file://{tmp_path}/ckpt/preflight-x")
    assert scratch.train.steps == 8 and scratch.checkpoint.every_steps == 7
    assert scratch.checkpoint.uri.endswith("preflight-x") and scratch.preflight is None
    assert (scratch.model, scratch.parallel, scratch.data) == (spec.model, spec.parallel,
                                                               spec.data)


def test_spec_key_defaults_and_bounds():
    spec = load_spec(overrides=["preflight={}"])
    assert (spec.preflight.steps, spec.preflight.required) == (50, False)
    assert load_spec().preflight is None
    from tenax.orchestrator.spec import SpecError

    with pytest.raises(SpecError, match="preflight.steps"):
        load_spec(overrides=["preflight={steps: 0}"])


# ---- real jobs through the command line --------------------------------------------------------
@pytest.mark.slow
def test_run_after_a_passing_preflight_trains_as_without(tmp_path):
    """Every row passes on a healthy job; the run then starts at step 0 and every loss equals
    the single-process reference (what a run without a preflight gives, 1e-5); the scratch
    checkpoints are gone."""
    overrides = small(tmp_path, "train.steps=12")
    log = tmp_path / "events.jsonl"
    out = run_cli(["run", *flags(overrides), "--preflight", "--log-json", str(log)],
                  timeout_s=400)
    assert out.returncode == 0, out.stderr[-3000:]
    events = read_events(log)
    pre = [e for e in events if e["event"] == "preflight"]
    assert len(pre) == 1 and pre[0]["verdict"] == "pass", pre
    assert {r["name"] for r in pre[0]["rows"]} == {"data", "memory", "progress", "throughput",
                                                    "links", "recovery"}
    assert all(r["verdict"] == "pass" for r in pre[0]["rows"]), pre[0]["rows"]
    losses = {e["step"]: e["loss"] for e in events if e["event"] == "step"}
    assert min(losses) == 1
    assert_same_losses(losses, reference_losses(load_spec(overrides=overrides)))
    assert not list((tmp_path / "ckpt").glob("preflight-*"))


@pytest.mark.slow
def test_required_preflight_stops_a_run_on_a_bad_token(tmp_path):
    bad = token_file(tmp_path / "shard-3.tok", 40_000, bad_at=39_000)
    doc = load_spec(overrides=small(tmp_path, f"data.source=file://{bad}",
                                    "preflight={steps: 4, required: true}")).to_dict()
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    log = tmp_path / "events.jsonl"
    out = run_cli(["run", str(job), "--log-json", str(log)], timeout_s=300)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "preflight failed: data" in out.stderr and "shard-3.tok" in out.stderr
    events = read_events(log)
    assert not [e for e in events if e["event"] == "step"]
    (pre,) = [e for e in events if e["event"] == "preflight"]
    data = next(r for r in pre["rows"] if r["name"] == "data")
    assert pre["verdict"] == data["verdict"] == "fail" and "shard-3.tok" in data["detail"]


@pytest.mark.slow
def test_memory_fails_when_the_planner_figure_exceeds_the_budget(tmp_path):
    """A model whose model states alone exceed each CPU slot's share of host memory: the
    planner finds no layout that fits, the memory row fails and no rank starts."""
    huge = ["model.dim=8192", "model.n_layers=64", "model.n_heads=64", "model.n_kv_heads=8",
            "model.ffn_hidden=28672"]
    out = run_cli(["preflight", *flags(small(tmp_path, *huge)), "--steps", "2", "--json"],
                  timeout_s=300)
    assert out.returncode == 1, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    assert doc["event"] == "preflight" and doc["verdict"] == "fail"
    memory = next(r for r in doc["rows"] if r["name"] == "memory")
    assert memory["verdict"] == "fail", memory
    assert {r["name"] for r in doc["rows"]} == {"data", "memory"}  # nothing ran


@pytest.mark.slow
def test_optional_preflight_reports_and_the_job_runs_anyway(tmp_path):
    """`preflight: {required: false}`: a failing row is reported (event and table) and the job
    still runs to its end; the bad id sits where this job's few steps never read."""
    bad = token_file(tmp_path / "late.tok", 40_000, bad_at=39_000)
    overrides = small(tmp_path, f"data.source=file://{bad}", "train.steps=3",
                      "preflight={steps: 2}")
    log = tmp_path / "events.jsonl"
    out = run_cli(["run", *flags(overrides), "--log-json", str(log)], timeout_s=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "running anyway" in out.stderr
    events = read_events(log)
    (pre,) = [e for e in events if e["event"] == "preflight"]
    assert pre["verdict"] == "fail" and "late.tok" in pre["rows"][0]["detail"]
    assert sorted(e["step"] for e in events if e["event"] == "step") == [1, 2, 3]
