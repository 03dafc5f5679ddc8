"""Hardware in the planner: the GPU table, `tenax plan layout --gpu`, and MFU that adds up."""
from __future__ import annotations

import json

import pytest

from tenax.orchestrator.cli.main import main as cli_main
from tenax.parallel.config import ModelArgs
from tenax.parallel.cost_model import train_flops_per_token
from tenax.parallel.hardware import GPUS, gpu_from_device_name, gpu_model, planner_options
from tenax.parallel.planner import Cluster, plan_layout
from tenax.workers.presets import PRESETS


def plan_json(capsys: pytest.CaptureFixture, *argv: str) -> dict:
    assert cli_main(["plan", "layout", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_gpu_table_holds_the_vendor_figures() -> None:
    assert GPUS["h100"].peak_bf16_flops == 989e12 and GPUS["h100"].hbm_gb == 80
    assert GPUS["h200"].peak_bf16_flops == 989e12 and GPUS["h200"].hbm_gb == 141
    assert GPUS["a100"].peak_bf16_flops == 312e12 and GPUS["b200"].peak_bf16_flops == 2.25e15
    assert GPUS["h200"].hbm_gib == pytest.approx(141e9 / 2 ** 30)
    assert gpu_from_device_name("NVIDIA H200") is GPUS["h200"]
    assert gpu_from_device_name("NVIDIA A100-SXM4-80GB") is GPUS["a100"]
    assert gpu_from_device_name("Tesla T4") is None
    assert gpu_model("H100", nvlink_Bps=100e9).network().intra.bandwidth_Bps == 100e9
    with pytest.raises(ValueError, match="gpu: 'v100' is not one of"):
        gpu_model("v100")
    with pytest.raises(ValueError, match="must be > 0"):
        gpu_model("h100", hbm_gb=0.0)


def test_pinned_published_layout_reports_consistent_figures(capsys) -> None:
    """Llama 3 70B as tp8 x pp4 x cp1 on 64 H100s: the degrees given with --set are kept, and
    the printed MFU, tokens/s, step time and memory agree with each other and with the GPU.
    (cp is pinned too: left free, cp2 wins, since it avoids the full recompute dp2 needs.)"""
    doc = plan_json(capsys, "--model-preset", "llama3-70b", "--gpus", "64", "--gpus-per-node",
                    "8", "--gpu", "h100", "--set", "parallel.tp=8", "--set", "parallel.pp=4",
                    "--set", "parallel.cp=1")
    assert doc["layout"]["tp"] == 8 and doc["layout"]["pp"] == 4 and doc["layout"]["dp"] == 2
    chosen, hw = doc["chosen"], doc["hardware"]
    assert hw["name"] == "h100" and hw["peak_flops_per_gpu"] == 989e12
    model = ModelArgs(**{k: v for k, v in PRESETS["llama3-70b"].items() if k != "moe"})
    tokens = doc["global_batch_size"] * doc["seq_len"]
    flops = train_flops_per_token(model.num_params(active=True), model.n_layers, model.dim,
                                  doc["seq_len"]) * tokens
    assert chosen["tokens_per_s"] == pytest.approx(tokens / chosen["step_time_s"])
    assert chosen["mfu"] == pytest.approx(flops / chosen["step_time_s"] / (64 * 989e12))
    # compute runs at the assumed 40% of peak; communication and bubble only lower MFU
    assert 0 < chosen["mfu"] <= hw["mfu_assumed"]
    assert chosen["memory_per_gpu_gib"] <= doc["memory_budget_gib"] < GPUS["h100"].hbm_gib


def test_gpu_choice_and_overrides_change_the_prediction(capsys) -> None:
    args = ["--model-preset", "llama3-8b", "--gpus", "8", "--gpus-per-node", "8"]
    h100 = plan_json(capsys, *args, "--gpu", "h100")
    b200 = plan_json(capsys, *args, "--gpu", "b200")
    slow = plan_json(capsys, *args, "--gpu", "h100", "--peak-tflops", "494.5")
    assert b200["chosen"]["step_time_s"] < h100["chosen"]["step_time_s"]
    assert slow["hardware"]["peak_flops_per_gpu"] == pytest.approx(494.5e12)
    assert slow["chosen"]["step_time_s"] > h100["chosen"]["step_time_s"]
    assert h100["memory_budget_gib"] == pytest.approx(0.9 * GPUS["h100"].hbm_gib, rel=1e-3)


def test_planner_options_feed_plan_layout() -> None:
    model = ModelArgs(**{k: v for k, v in PRESETS["llama3-8b"].items() if k != "moe"})
    a100 = GPUS["a100"]
    result = plan_layout(model, Cluster(8, 8, a100.hbm_gib, **planner_options(a100)))
    assert result.best.peak_flops == 8 * 312e12
    assert result.to_dict()["hardware"]["name"] == "a100"
    assert result.best.mfu == pytest.approx(result.best.flops_per_step / result.best.time.total_s
                                            / (8 * 312e12))
