"""Multi-process runs must match the single-process run on the same spec and data.

SGD runs compare per-step loss, grad norm and final parameters: SGD exposes any error in the
gradient directly (Adam would hide a wrong gradient scale). AdamW runs compare loss and grad
norm tightly and parameters at 1e-4, since Adam amplifies rounding of near-zero gradients.
"""
from __future__ import annotations

import functools

import pytest
import torch

from tests.distributed import run_ranks
from tests.engine_jobs import train_job

STEPS = 5
SGD = ["train.lr=0.5"]


@functools.lru_cache(maxsize=None)
def reference(optimizer: str) -> dict:
    extra = SGD if optimizer == "sgd" else []
    return run_ranks(train_job, 1, {"micro_batch_size": 1}, optimizer, STEPS, extra)[0]


def layout_id(layout: dict) -> str:
    return "-".join(f"{k}{v}" for k, v in layout.items())


def world_of(layout: dict) -> int:
    return layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1)


def assert_matches(out: dict, ref: dict, param_tol: float) -> None:
    for name in ("loss", "grad_norm"):
        got, want = torch.tensor(out[name]), torch.tensor(ref[name])
        rel = ((got - want).abs() / want.abs()).max().item()
        assert rel < 1e-5, f"{name}: {out[name]} vs reference {ref[name]} (max rel {rel:.2e})"
    assert out["params"].keys() == ref["params"].keys()
    for key, want in ref["params"].items():
        diff = (out["params"][key] - want).abs().max().item()
        assert diff < param_tol, f"param {key}: max abs diff {diff:.2e}"


SLOW = pytest.mark.slow  # the layouts whose run takes more than ~5 s on 2 shared cores
SGD_LAYOUTS = [dict(dp=2, zero=z) for z in range(4)] + [dict(dp=4, zero=z) for z in range(4)] + [
    dict(tp=2), pytest.param(dict(tp=4), marks=SLOW),
    pytest.param(dict(dp=2, tp=2, zero=3), marks=SLOW), dict(dp=2, tp=2, zero=1)]


@pytest.mark.parametrize("layout", SGD_LAYOUTS, ids=layout_id)
def test_sgd_parity(layout):
    ref = reference("sgd")
    out = run_ranks(train_job, world_of(layout), {**layout, "micro_batch_size": 1}, "sgd", STEPS,
                    SGD)[0]
    assert ref["loss"][-1] < ref["loss"][0] - 0.05, "the reference must actually learn"
    assert_matches(out, ref, param_tol=1e-5)


@pytest.mark.parametrize("layout", [dict(dp=2, zero=1), dict(dp=2, zero=2), dict(dp=4, zero=3),
                                    pytest.param(dict(dp=2, tp=2, zero=2), marks=SLOW)],
                         ids=layout_id)
def test_adamw_parity(layout):
    ref = reference("adamw")
    out = run_ranks(train_job, world_of(layout), {**layout, "micro_batch_size": 1}, "adamw", STEPS,
                    [])[0]
    assert_matches(out, ref, param_tol=1e-4)


def test_micro_batch_split_does_not_change_the_step():
    """Same global batch with micro batch 1 vs 4 (accumulation 8 vs 2) gives the same run."""
    ref = reference("sgd")
    out = run_ranks(train_job, 2, {"dp": 2, "zero": 1, "micro_batch_size": 4}, "sgd", STEPS, SGD)[0]
    assert_matches(out, ref, param_tol=1e-5)


FOUR_LAYERS = ["model.n_layers=4"]
PP_LAYOUTS = [dict(pp=2, pp_schedule=s) for s in ("gpipe", "1f1b", "zero_bubble")] + [
    dict(pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2),
    dict(pp=2, pp_schedule="zero_bubble", pp_virtual_stages=2),
    dict(pp=4, pp_schedule="1f1b"), dict(pp=4, pp_schedule="gpipe"),
    dict(pp=4, pp_schedule="interleaved_1f1b", pp_virtual_stages=1),
    dict(pp=4, pp_schedule="zero_bubble"),
    dict(pp=2, dp=2, zero=1), dict(pp=2, dp=2, zero=3),
    pytest.param(dict(pp=2, tp=2), marks=SLOW),
    dict(cp=2), dict(cp=4), dict(cp=2, dp=2, zero=2), dict(pp=2, cp=2, zero=0),
    pytest.param(dict(dp=2, pp=2, tp=2, zero=1), marks=SLOW),
    pytest.param(dict(dp=2, cp=2, tp=2, zero=3), marks=SLOW)]


@functools.lru_cache(maxsize=None)
def reference_with(extra: tuple[str, ...]) -> dict:
    return run_ranks(train_job, 1, {"micro_batch_size": 1}, "sgd", STEPS, [*SGD, *extra])[0]


@pytest.mark.parametrize("layout", PP_LAYOUTS, ids=layout_id)
def test_pipeline_and_context_parity(layout):
    ref = reference_with(tuple(FOUR_LAYERS))
    out = run_ranks(train_job, world_of(layout), {**layout, "micro_batch_size": 1}, "sgd", STEPS,
                    [*SGD, *FOUR_LAYERS])[0]
    assert_matches(out, ref, param_tol=1e-5)


MOE = ["model.moe={num_experts: 4, top_k: 2, capacity_factor: 4.0, aux_loss_coef: 0.05}"]


@pytest.mark.parametrize("layout", [dict(dp=2, zero=1), dict(dp=2, ep=2, zero=0),
                                    dict(dp=4, ep=4, zero=2), dict(dp=4, ep=2, zero=1)],
                         ids=layout_id)
def test_moe_expert_parallel_parity(layout):
    """Aux loss is in the objective: grad norms and parameters would differ without it."""
    ref = reference_with(tuple(MOE))
    out = run_ranks(train_job, world_of(layout), {**layout, "micro_batch_size": 1}, "sgd", STEPS,
                    [*SGD, *MOE])[0]
    assert_matches(out, ref, param_tol=1e-5)
