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
    assert recovery_row(7, [], 7, 3.0 * (1 + 5e-6), 3.0).verdict == "pass"  # relative 1e-5
    assert recovery_row(7, [], 7, 3.0 * (1 + 2e-5), 3.0).verdict == "fail"
    assert recovery_row(7, [], 7, 3.0, 3.1).verdict == "fail"
    assert recovery_row(7, [], None, 3.0, 3.0).verdict == "fail"
    assert recovery_row(7, ["shard-0: checksum"], 7, 3.0, 3.0).detail == "shard-0: checksum"


def test_any_failure_fails_progress_naming_rank_kind_and_stacks():
    """A hang the smoke job did not survive (max_restarts=0) fails the row even when some
    losses came in; the row names the rank, the kind and where the stacks are."""
    hang = {"event": "failure", "step": 2, "rank": 0, "ranks": [0, 1], "kind": "hang",
            "cause": "ranks 0, 1 hung: step did not advance", "odd": [1],
            "diagnostics": "file:///c/preflight-x/diagnostics/20261203T171500.000Z-hang"}
    row = progress_row([4.0, 3.9, 3.5, 3.0], 4, "SUCCEEDED", "", [hang])
    assert row.verdict == "fail", row
    assert row.detail == ("ranks 0, 1 failed (hang) at step 2: ranks 0, 1 hung: step did not "
                          "advance; the stacks single out rank 1; stacks: tenax diagnose "
                          + hang["diagnostics"])
    dead = {"event": "failure", "step": 3, "rank": 0, "kind": "dead", "cause": "SIGKILL"}
    row = progress_row([4.0, 3.9], 4, "FAILED", "rank 0 died", [dead])
    assert row.detail == "rank 0 failed (dead) at step 3: SIGKILL"


def test_scratch_spec_never_restarts_and_the_recovery_reshards(tmp_path):
    from tenax.orchestrator.preflight.recovery import other_layout
    from tenax.parallel import ParallelLayout

    spec = load_spec(overrides=small(tmp_path, "fault_tolerance.max_restarts=5"))
    assert scratch_spec(spec, 4, f"file://{tmp_path}/s").fault_tolerance.max_restarts == 0
    moved, layout = other_layout(spec, ParallelLayout(dp=2, zero=1))
    assert (layout.dp, layout.tp, moved.parallel.dp, moved.parallel.tp) == (1, 2, 1, 2)
    moved, layout = other_layout(spec, ParallelLayout(tp=2, zero=1))
    assert (layout.dp, layout.tp, moved.parallel.dp, moved.parallel.tp) == (2, 1, 2, 1)
    assert other_layout(spec, ParallelLayout()) is None  # one rank: nothing to reshard
    # a model tp cannot split: another ZeRO stage is the resharding left
    one_kv = load_spec(overrides=small(tmp_path, "model.n_kv_heads=1"))
    moved, layout = other_layout(one_kv, ParallelLayout(dp=2, zero=1))
    assert (layout.dp, layout.tp, layout.zero, moved.parallel.zero) == (2, 1, 0, 0)


def test_the_memory_restore_must_come_from_memory_and_train_on_equal():
    from tenax.orchestrator.preflight.rows import memory_restore, with_memory

    ref = {1: 4.0, 2: 3.9, 3: 3.5}
    assert memory_restore("memory", 2, dict(ref), ref)[0] == "pass"
    verdict, words = memory_restore("storage", 0, dict(ref), ref)
    assert verdict == "fail" and "from storage" in words
    verdict, words = memory_restore("memory", 2, {**ref, 3: 3.6}, ref)
    assert verdict == "fail" and "step 3 has loss 3.6" in words
    assert memory_restore(None, None, {}, ref, off="3 GiB per node")[0] == "warn"
    row = with_memory(recovery_row(7, [], 7, 3.0, 3.0, "tp2 zero1 (saved from dp2 zero1)"),
                      "fail", "words")
    assert row.verdict == "fail" and row.detail == ("storage step 7 loaded into tp2 zero1 "
                                                    "(saved from dp2 zero1); words")
    assert "in-memory snapshot restored" in row.expected


def test_only_a_hangs_stacks_outlive_the_scratch_location(tmp_path):
    from tenax.orchestrator.preflight.smoke import remove_tree

    scratch = tmp_path / "preflight-x"
    for part in ("step-00000003/a", "diagnostics/t-hang/rank-1.txt"):
        (scratch / part).parent.mkdir(parents=True, exist_ok=True)
        (scratch / part).write_text("x")
    remove_tree(f"file://{scratch}", keep=("diagnostics",))
    assert [p.name for p in scratch.iterdir()] == ["diagnostics"]
    assert (scratch / "diagnostics/t-hang/rank-1.txt").exists()
    remove_tree(f"file://{scratch}")
    assert not scratch.exists()


def test_data_row_names_the_file_with_a_bad_token(tmp_path):
    path = token_file(tmp_path / "bad.tok", 40_000, bad_at=33_333)
    row = data_row(load_spec(overrides=small(tmp_path, f"data.source=file://{path}")), 4)
    assert row.verdict == "fail" and row.measured == "invalid"  # it reads: not "unreadable"
    assert "bad.tok" in row.detail and "100" in row.detail
    missing = data_row(load_spec(overrides=small(tmp_path,
                                                 f"data.source=file://{tmp_path}/none.tok")), 4)
    assert missing.verdict == "fail" and missing.measured == "unreadable", missing
    good = token_file(tmp_path / "good.tok", 40_000)
    assert data_row(load_spec(overrides=small(tmp_path, f"data.source=file://{good}")),
                    4).verdict == "pass"


def test_data_row_holds_the_tokenizer_to_the_vocabulary(tmp_path):
    """A tokenizer with more tokens than the embedding has rows fails naming both fields (the
    spec checks this at load; the preflight checks again what the ranks will load)."""
    from tests.test_tokenizer import make_hf_tokenizer

    path = make_hf_tokenizer(tmp_path / "tokenizer.json", vocab_size=300)
    spec = load_spec(overrides=small(tmp_path, f"data.tokenizer={path}",
                                     "model.vocab_size=320"))
    row = data_row(spec, 2)
    assert row.verdict == "pass" and "tokenizer vocab 300" in row.measured, row
    narrow = spec.model_copy(update={"model": spec.model.model_copy(update={"vocab_size": 64})})
    row = data_row(narrow, 2)
    assert row.verdict == "fail", row
    assert "data.tokenizer" in row.detail and "300 tokens" in row.detail
    assert "model.vocab_size=64" in row.detail


def test_data_row_opens_the_validation_set(tmp_path):
    """data.validation: too few windows for its evaluations, or an id outside the vocabulary,
    fails naming the field and the file; a good one passes and is counted."""
    good = token_file(tmp_path / "val.tok", 40_000)
    row = data_row(load_spec(overrides=small(
        tmp_path, f"data.validation={{uri: 'file://{good}', steps: 2}}")), 2)
    assert row.verdict == "pass" and "validation 1249 windows" in row.measured, row
    short = token_file(tmp_path / "short.tok", 1_000)  # 31 windows of 33 tokens
    row = data_row(load_spec(overrides=small(
        tmp_path, f"data.validation={{uri: 'file://{short}', steps: 10}}")), 2)
    assert row.verdict == "fail" and "data.validation.uri" in row.detail, row
    assert "short.tok" in row.detail and "holds 31 windows" in row.detail and "= 80" in row.detail
    bad = token_file(tmp_path / "val-bad.tok", 40_000, bad_at=30_000)
    row = data_row(load_spec(overrides=small(
        tmp_path, f"data.validation={{uri: 'file://{bad}', steps: 2}}")), 2)
    assert row.verdict == "fail" and "data.validation.uri" in row.detail, row
    assert "val-bad.tok" in row.detail and "100" in row.detail


def test_the_preflight_event_reads_as_the_verdict_and_the_rows_that_did_not_pass():
    from tenax.orchestrator.cli.client import human_line
    from tenax.workers.events import human

    rows = [{"name": "data", "measured": "2 batches", "expected": "ids in [0, 64)",
             "verdict": "pass", "detail": "40 samples"},
            {"name": "links", "measured": "dp 0.4x", "expected": "median group",
             "verdict": "warn", "detail": "slow links on node 1 (ab12)"},
            {"name": "progress", "measured": "2 of 4 steps", "expected": "4 steps",
             "verdict": "fail", "detail": ""}]
    doc = {"event": "preflight", "verdict": "fail", "rows": rows, "time": 1.7e9}
    assert human(doc) == ("Preflight fail; links warn: slow links on node 1 (ab12); "
                          "progress fail: 2 of 4 steps.")
    assert "{" not in human_line(doc) and human_line(doc).endswith(human(doc))
    assert human({"event": "preflight", "verdict": "pass", "rows": rows[:1]}) == \
        "Preflight pass."


def test_bad_counts_are_refused_before_anything_starts(monkeypatch, capsys):
    """`--steps 0` (preflight) and `--frames 0` (diagnose) are refused while parsing, naming
    the flag: no Ray, no forkserver, no stacks read."""
    import tenax.orchestrator.cli.runner as runner
    from tenax.orchestrator.cli.main import main

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(runner, "ray_session", no_ray)
    for argv, flag in ((["preflight", "--steps", "0"], "--steps"),
                       (["preflight", "--steps", "-3"], "--steps"),
                       (["diagnose", "/nonexistent", "--frames", "0"], "--frames")):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2, argv
        err = capsys.readouterr().err
        assert f"argument {flag}: must be at least 1" in err, err


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
    rows = {r["name"]: r for r in pre[0]["rows"]}  # CPU ranks: no GPU figure beside them
    assert "no planner figure for cpu" in rows["throughput"]["expected"], rows["throughput"]
    # the checkpoint was loaded into another layout, and a snapshot restored from memory
    recovery = next(r for r in pre[0]["rows"] if r["name"] == "recovery")
    assert "storage step 19 loaded into tp2 zero1 (saved from dp2 zero1)" in recovery["detail"]
    assert "in-memory snapshot of step" in recovery["detail"], recovery
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


@pytest.mark.slow
def test_a_hang_in_the_smoke_steps_fails_progress(tmp_path):
    """Chaos `hang rank=1 at=3`: the smoke job does not recover it (max_restarts=0), so the
    progress row fails naming rank 1, the hang and its stacks, which outlive the scratch
    checkpoints; the recovery row is not run."""
    from tenax.orchestrator.chaos.faults import parse_chaos
    from tenax.orchestrator.preflight import run_preflight
    from tenax.testing.clusters import local_ray

    spec = load_spec(overrides=small(tmp_path, "fault_tolerance.hang_timeout_s=8"))
    with local_ray(gpus=2):
        report = run_preflight(spec, 4, chaos=parse_chaos("hang rank=1 at=3"))
    rows = {r.name: r for r in report.rows}
    progress = rows["progress"]
    assert report.verdict == progress.verdict == "fail", report.rows
    assert "failed (hang) at step" in progress.detail, progress.detail
    assert "the stacks single out rank 1;" in progress.detail, progress.detail
    location = progress.detail.split("stacks: tenax diagnose ")[1].split(";")[0]
    assert location == report.kept and location.startswith(report.scratch_uri + "/diagnostics/")
    kept = Path(location.removeprefix("file://"))
    assert (kept / "rank-1.txt").is_file()
    assert [p.name for p in kept.parents[1].iterdir()] == ["diagnostics"]  # no checkpoints
    assert rows["recovery"].verdict == "warn" and rows["recovery"].measured == "not run"
