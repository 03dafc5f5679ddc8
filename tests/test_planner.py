"""The planner's contract: whatever it returns is a valid layout that fits, respects the rules
(tp inside a node, pinned degrees, m >= 4p with pipelines) and explains itself; when nothing
fits it says how close it came. Timing is printed, never asserted."""
from __future__ import annotations

import json
import re
import time
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tenax.orchestrator.presets import PRESETS
from tenax.orchestrator.spec import JobSpec, plan_for_spec
from tenax.parallel.config import ModelArgs, MoEArgs
from tenax.parallel.errors import PlanError
from tenax.parallel.planner import Cluster, PlanOptions, PlanResult, plan_layout

REASON = re.compile(r"^(slower: .+ s vs .+ s \(more .+\)|does not fit: [\d.]+ GiB > [\d.]+ GiB|"
                    r"tie at .+)$")


def preset(name: str) -> ModelArgs:
    return ModelArgs.from_dict(PRESETS[name])


def check_plan(result: PlanResult, model: ModelArgs, gpus: int, gpus_per_node: int) -> None:
    """Invariants every returned plan must hold."""
    lay, best = result.layout, result.best
    gbs = result.request["global_batch_size"]
    seq_model = replace(model, seq_len=result.request["seq_len"])
    assert lay.problems(seq_model, gpus, gbs) == []
    assert best.fits and best.memory.total <= best.budget_bytes
    assert lay.tp <= gpus_per_node
    assert not lay.crosses_nodes("tp", gpus_per_node)
    assert best.microbatches == gbs // (lay.dp * lay.micro_batch_size)
    if lay.pp > 1 and "pp" not in result.request["fixed"]:
        assert best.microbatches >= 4 * lay.pp
    for runner in result.runners_up:
        assert REASON.match(runner.reason), runner.reason
    json.dumps(result.to_dict())


def test_llama3_8b_on_one_node_uses_data_parallel_sharding() -> None:
    model = preset("llama3-8b")
    result = plan_layout(model, Cluster(8, 8), PlanOptions(global_batch_size=32, seq_len=8192))
    check_plan(result, model, 8, 8)
    assert result.layout.pp == 1 and result.layout.tp <= 2
    assert result.request["global_batch_size"] == 32


def test_llama3_70b_keeps_tp_inside_a_node() -> None:
    model = preset("llama3-70b")
    result = plan_layout(model, Cluster(64, 8))
    check_plan(result, model, 64, 8)
    assert not result.layout.crosses_nodes("tp", 8)


def test_llama3_405b_on_512_gpus_needs_sharding_or_pipelining() -> None:
    model = preset("llama3-405b")
    start = time.perf_counter()
    result = plan_layout(model, Cluster(512, 8))
    elapsed = time.perf_counter() - start
    print(f"\n405b on 512 GPUs planned in {elapsed:.3f} s: {result.layout.describe()}")
    check_plan(result, model, 512, 8)
    assert result.layout.pp > 1 or result.layout.zero == 3


def test_405b_with_zero1_pinned_falls_back_to_pipelines() -> None:
    model = preset("llama3-405b")
    start = time.perf_counter()
    result = plan_layout(model, Cluster(512, 8), PlanOptions(fixed={"zero": 1}))
    print(f"\n405b/512 with pipelines searched: {time.perf_counter() - start:.3f} s")
    check_plan(result, model, 512, 8)
    assert result.layout.zero == 1 and result.layout.pp > 1


def test_tiny_model_on_four_cpu_ranks_is_pure_data_parallel() -> None:
    model = ModelArgs()
    result = plan_layout(model, Cluster(4, 4), PlanOptions(global_batch_size=32))
    check_plan(result, model, 4, 4)
    assert result.layout.degrees() == {"dp": 4, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero": 1}


def test_default_spec_on_two_nodes_of_two() -> None:
    spec = JobSpec()
    result = plan_for_spec(spec, 4, 2)
    check_plan(result, spec.model.args(), 4, 2)
    assert result.layout.dp == 4 and result.layout.micro_batch_size == 2


def test_six_gpus_after_a_failure() -> None:
    model = ModelArgs()
    result = plan_layout(model, Cluster(6, 2), PlanOptions(global_batch_size=24))
    check_plan(result, model, 6, 2)
    assert result.layout.world_size == 6
    # 32 sequences cannot split 6 ways: the planner must find another factorisation
    result = plan_layout(model, Cluster(6, 2), PlanOptions(global_batch_size=32))
    check_plan(result, model, 6, 2)
    assert 32 % (result.layout.dp * result.layout.micro_batch_size) == 0


def test_six_gpus_with_a_spec_that_pins_everything_but_dp_fails_clearly() -> None:
    with pytest.raises(PlanError, match="global_batch_size"):
        plan_for_spec(JobSpec(), 6, 2)


def test_pinned_degrees_are_honored() -> None:
    model = preset("llama3-8b")
    result = plan_layout(model, Cluster(16, 8),
                         PlanOptions(fixed={"tp": 2, "zero": 3, "dp": "auto"}))
    check_plan(result, model, 16, 8)
    assert result.layout.tp == 2 and result.layout.zero == 3
    spec = JobSpec.model_validate({"model": PRESETS["llama3-8b"],
                                   "parallel": {"tp": 4, "dp": 2, "zero": 2,
                                                "micro_batch_size": 1},
                                   "train": {"global_batch_size": 16, "dtype": "bfloat16"}})
    result = plan_for_spec(spec, 8, 8)
    assert result.layout.degrees() == {"dp": 2, "tp": 4, "pp": 1, "cp": 1, "ep": 1, "zero": 2}


def test_spec_zero_is_free_while_dp_is_auto() -> None:
    spec = JobSpec.model_validate({"model": PRESETS["llama3-8b"],
                                   "parallel": {"zero": 0, "micro_batch_size": 1},
                                   "train": {"global_batch_size": 32, "dtype": "bfloat16"}})
    assert spec.parallel.dp == "auto"
    result = plan_for_spec(spec, 8, 8)
    assert result.layout.zero != 0  # DDP's 16 B/param of an 8B model cannot fit in 80 GB
    assert "zero" not in result.request["fixed"]


def test_pinned_pipeline_keeps_four_micro_batches_per_stage() -> None:
    model = ModelArgs()
    result = plan_layout(model, Cluster(8, 8), PlanOptions(global_batch_size=32, fixed={"pp": 4}))
    check_plan(result, model, 8, 8)
    assert result.layout.pp == 4 and result.best.microbatches >= 16
    assert result.best.warnings == ()


def test_pinned_pipeline_with_few_micro_batches_runs_and_names_the_bubble() -> None:
    """pp=2 with 4 micro-batches used to fail with "no layout ... fits"; it runs and warns."""
    model = ModelArgs()
    result = plan_layout(model, Cluster(2, 2), PlanOptions(
        global_batch_size=4, fixed={"pp": 2, "micro_batch_size": 1, "pp_schedule": "1f1b"}))
    assert result.layout.pp == 2 and result.best.microbatches == 4
    assert result.best.warnings == ("pipeline bubble 20% with 4 micro-batches; 8 would give 11% "
                                    "(raise train.global_batch_size or lower micro_batch_size)",)
    assert result.to_dict()["warnings"] == list(result.best.warnings)
    with pytest.raises(PlanError, match="no valid layout of 3 GPUs") as err:
        plan_layout(model, Cluster(3, 4), PlanOptions(fixed={"tp": 3}))
    assert "fits" not in str(err.value)  # memory is not the problem: do not say it is


def test_nothing_fits_names_the_smallest_need() -> None:
    with pytest.raises(PlanError, match=r"smallest need found is [\d.]+ GiB") as err:
        plan_layout(preset("llama3-405b"), Cluster(8, 8))
    assert "72.0 GiB per GPU" in str(err.value) and "406B-parameter" in str(err.value)


def test_no_valid_layout_and_bad_arguments_are_clear() -> None:
    with pytest.raises(PlanError, match="parallel.tp: N does not divide model.n_heads"):
        plan_layout(ModelArgs(), Cluster(3, 4), PlanOptions(fixed={"tp": 3}))
    with pytest.raises(PlanError, match="tp=4 must divide 8 GPUs and stay inside a 2-GPU node"):
        plan_layout(ModelArgs(), Cluster(8, 2), PlanOptions(fixed={"tp": 4}))
    with pytest.raises(PlanError, match="cannot multiply to 2"):
        plan_layout(ModelArgs(), Cluster(2, 2), PlanOptions(fixed={"tp": 2, "cp": 2}))
    with pytest.raises(PlanError, match="unknown: \\['tpp'\\]"):
        plan_layout(ModelArgs(), Cluster(4, 4), PlanOptions(fixed={"tpp": 2}))
    with pytest.raises(PlanError, match="'gpus': 0"):
        plan_layout(ModelArgs(), Cluster(0, 4))


def test_runners_up_explain_why_they_lost() -> None:
    model = preset("llama3-70b")
    result = plan_layout(model, Cluster(64, 8))
    assert result.runners_up
    for runner in result.runners_up:
        assert REASON.match(runner.reason), runner.reason
        if runner.fits:
            assert runner.time.total_s >= result.best.time.total_s * (1 - 1e-3)
    out = result.to_dict()
    assert all(r["reason"] for r in out["runners_up"])
    assert 0 <= out["estimate"]["bubble_fraction"] <= 1
    assert out["estimate"]["memory"]["total_gib"] <= out["memory_budget_gib"]
    assert all(isinstance(v, int) for v in out["rejected"].values())


def test_rejections_are_counted_by_reason() -> None:
    result = plan_layout(preset("llama3-8b"), Cluster(8, 8, gpu_mem_gib=40),
                         PlanOptions(global_batch_size=32))
    assert result.rejected.get("does not fit in memory", 0) > 0
    assert result.considered >= 1


def test_plans_are_deterministic() -> None:
    model = preset("llama3-70b")
    cluster = Cluster(32, 8)
    assert plan_layout(model, cluster).to_dict() == plan_layout(model, cluster).to_dict()


def test_moe_model_may_use_expert_parallelism() -> None:
    model = ModelArgs(dim=512, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=1024, seq_len=256,
                      ffn_hidden=1024, moe=MoEArgs(num_experts=8, top_k=2))
    result = plan_layout(model, Cluster(8, 4), PlanOptions(global_batch_size=32))
    check_plan(result, model, 8, 4)
    assert 8 % result.layout.ep == 0


@st.composite
def small_models(draw: st.DrawFn) -> ModelArgs:
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    kv = draw(st.sampled_from([k for k in (1, 2, 4, 8) if heads % k == 0]))
    head_dim = draw(st.sampled_from([2, 8, 16]))
    moe = draw(st.none() | st.builds(lambda e, k: MoEArgs(num_experts=e, top_k=min(k, e)),
                                     st.sampled_from([2, 4, 8]), st.integers(1, 2)))
    return ModelArgs(dim=heads * head_dim, n_layers=draw(st.integers(1, 8)), n_heads=heads,
                     n_kv_heads=kv, vocab_size=draw(st.integers(2, 300)),
                     seq_len=draw(st.sampled_from([8, 16, 64, 128])),
                     ffn_hidden=draw(st.integers(1, 64)), moe=moe)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=small_models(), gpus=st.integers(1, 12), gpn=st.sampled_from([1, 2, 3, 4, 6, 8]),
       gbs=st.sampled_from([1, 2, 6, 8, 12, 24, 32, 64]),
       mem=st.sampled_from([0.0001, 0.01, 80.0]))
def test_any_returned_layout_is_valid(model: ModelArgs, gpus: int, gpn: int, gbs: int,
                                      mem: float) -> None:
    try:
        result = plan_layout(model, Cluster(gpus, gpn, gpu_mem_gib=mem),
                             PlanOptions(global_batch_size=gbs))
    except PlanError as err:
        # "no layout fits" only when memory was the problem, else "no valid layout": the reason
        assert str(err).startswith((f"no layout of {gpus} GPUs", f"no valid layout of {gpus} GPUs"))
        return
    check_plan(result, model, gpus, gpn)


# ---- activation recompute and published runs ---------------------------------------------------
def test_pinned_recompute_is_honoured_and_charged() -> None:
    from tenax.parallel.planner import estimate_layout

    model, cluster = ModelArgs(), Cluster(4, 4)
    auto = plan_layout(model, cluster, PlanOptions(global_batch_size=32))
    assert auto.best.recompute == "none" and "the lightest that fits" in auto.best.reason
    for level in ("selective", "full"):
        pinned = plan_layout(model, cluster, PlanOptions(global_batch_size=32, recompute=level))
        assert pinned.best.recompute == level and "(pinned;" in pinned.best.reason
        assert pinned.best.time.compute_s > auto.best.time.compute_s
        same = estimate_layout(model, pinned.layout, cluster,
                               PlanOptions(global_batch_size=32, recompute=level))
        assert same.memory == pinned.best.memory and same.time == pinned.best.time
    full = plan_layout(model, cluster, PlanOptions(global_batch_size=32, recompute="full"))
    assert full.best.memory.activations < auto.best.memory.activations
    assert full.best.memory.buffers > 0, "the block being recomputed is a transient buffer"
    with pytest.raises(PlanError, match="parallel.recompute: 'most'"):
        plan_layout(model, cluster, PlanOptions(global_batch_size=32, recompute="most"))
    spec = JobSpec.model_validate({"parallel": {"recompute": "selective"}})
    assert plan_for_spec(spec, 4, 2).best.recompute == "selective"


def _plan_cli(capsys: pytest.CaptureFixture, *argv: str) -> dict:
    from tenax.orchestrator.cli.main import main

    assert main(["plan", "layout", *argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


LLAMA3_405B_RUN = ("--model-preset", "llama3-405b", "--gpus", "16384", "--gpus-per-node", "8",
                   "--gpu", "h100", "--set", "parallel.tp=8", "--set", "parallel.pp=16",
                   "--set", "parallel.cp=1", "--set", "parallel.dp=128")


@pytest.mark.parametrize("extra", [(), ("--set", "model.seq_len=8192")], ids=["preset", "8k"])
def test_published_405b_run_is_planned_with_its_batch(capsys, extra: tuple[str, ...]) -> None:
    doc = _plan_cli(capsys, *LLAMA3_405B_RUN, "--global-batch-size", "2048", *extra)
    lay = doc["layout"]
    assert (lay["tp"], lay["pp"], lay["cp"], lay["dp"]) == (8, 16, 1, 128)
    assert doc["global_batch_size"] == 2048 and doc["estimate"]["microbatches"] == 16
    assert doc["recompute"] in ("none", "selective", "full") and 0 < doc["chosen"]["mfu"] < 0.4
    if extra:
        assert doc["seq_len"] == 8192
    via_set = _plan_cli(capsys, *LLAMA3_405B_RUN, "--set", "train.global_batch_size=2048", *extra)
    assert via_set["global_batch_size"] == 2048 and via_set["layout"] == lay


def test_train_keys_and_recompute_reach_a_preset_plan(capsys) -> None:
    base = ("--model-preset", "llama3-8b", "--gpus", "8", "--gpus-per-node", "8",
            "--global-batch-size", "64")
    mixed = _plan_cli(capsys, *base, "--set", "parallel.dp=8", "--set", "parallel.zero=3")
    fp32 = _plan_cli(capsys, *base, "--set", "parallel.dp=8", "--set", "parallel.zero=3",
                     "--set", "train.dtype=float32")
    # 16 B/param either way, but fp32 holds 4-byte weights and grads where bf16 holds 2
    assert fp32["estimate"]["memory"]["params_gib"] == pytest.approx(
        2 * mixed["estimate"]["memory"]["params_gib"], rel=1e-3)
    full = _plan_cli(capsys, *base, "--set", "parallel.recompute=full")
    assert full["recompute"] == "full" and full["global_batch_size"] == 64


def test_cpu_slots_plan_with_the_hosts_memory(capsys, tmp_path) -> None:
    import os

    host_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    doc = _plan_cli(capsys, "--model-preset", "tiny", "--gpus", "4", "--gpus-per-node", "2",
                    "--set", "resources.device=cpu")
    assert doc["memory_budget_gib"] == pytest.approx(host_gib / 2 * 0.9, rel=1e-2)
    spec = tmp_path / "cpu.yaml"
    spec.write_text("resources: {device: cpu, gpus_per_node: 4}\n")
    doc = _plan_cli(capsys, "--spec", str(spec), "--gpus", "4", "--gpus-per-node", "4",
                    "--global-batch-size", "16")
    assert doc["memory_budget_gib"] == pytest.approx(host_gib / 4 * 0.9, rel=1e-2)
    assert doc["global_batch_size"] == 16
    gpu = _plan_cli(capsys, "--model-preset", "tiny", "--gpus", "4", "--gpus-per-node", "2")
    assert gpu["memory_budget_gib"] == pytest.approx(80 * 0.9)


def test_an_moe_model_is_never_planned_with_zero3_experts() -> None:
    """zero 3 cannot shard ep-sharded experts: a stage that rules itself out is skipped, even
    when nothing fits and the planner reports its nearest miss."""
    model = ModelArgs(dim=8, n_layers=5, n_heads=4, n_kv_heads=1, vocab_size=2, seq_len=64,
                      ffn_hidden=54, moe=MoEArgs(num_experts=2, top_k=1))
    for mem in (0.0001, 80.0):
        try:
            result = plan_layout(model, Cluster(6, 1, gpu_mem_gib=mem),
                                 PlanOptions(global_batch_size=6))
        except PlanError as err:
            assert "zero3" not in str(err).split("smallest need found")[-1]
            continue
        check_plan(result, model, 6, 1)
