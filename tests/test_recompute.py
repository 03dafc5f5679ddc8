"""Activation recompute: every level trains exactly like `none`, holds what the planner charges,
and `auto` takes the planner's choice.

The held bytes are measured independently of the cost model: a saved-tensor hook sums the
unique storages autograd keeps for backward during one micro-batch's forward (parameters
excluded) and is compared with the planner's closed-form activation figure.
"""
from __future__ import annotations

import functools
import logging

import pytest
import torch

from tenax.parallel import (ParallelLayout, SavedTensorMeter, apply_recompute, build_model,
                            cross_entropy_sum, resolve_recompute)
from tenax.parallel.config import ModelArgs, MoEArgs
from tenax.parallel.cost_model import block_activation_bytes, head_activation_bytes
from tenax.parallel.pricing import activation_shape
from tenax.parallel.recompute import MARK
from tests.distributed import run_ranks

TINY = ModelArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=96, seq_len=32,
                 vocab_size=128)
BIGGER = ModelArgs(dim=128, n_layers=3, n_heads=8, n_kv_heads=8, ffn_hidden=344, seq_len=128,
                   vocab_size=256)
LEVELS = ("none", "selective", "full")


def _loss_and_grads(model_args: ModelArgs, level: str, batch: int = 2
                    ) -> tuple[float, dict[str, torch.Tensor], int]:
    model = build_model(model_args, seed=3)
    apply_recompute(model, level)
    tokens = torch.randint(0, model_args.vocab_size, (batch, model_args.seq_len + 1),
                           generator=torch.Generator().manual_seed(0))
    with SavedTensorMeter(model.parameters()) as meter:
        loss, _ = cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.item(), grads, meter.nbytes


def planner_held_bytes(model_args: ModelArgs, level: str, batch: int) -> float:
    """The planner's activation figure for one micro-batch of a whole model (pp=1, fp32)."""
    shape = activation_shape(model_args, ParallelLayout(micro_batch_size=batch), 4)
    return (model_args.n_layers * block_activation_bytes(shape, level)
            + head_activation_bytes(shape, model_args.vocab_size, model_args.head_dim))


@pytest.mark.parametrize("model_args", [TINY, ModelArgs(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, seq_len=16, vocab_size=64,
    moe=MoEArgs(num_experts=4, top_k=2, capacity_factor=4.0))], ids=["dense", "moe"])
def test_every_level_gives_the_loss_and_grads_of_none(model_args: ModelArgs) -> None:
    loss, grads, held = _loss_and_grads(model_args, "none")
    for level in ("selective", "full"):
        got_loss, got_grads, got_held = _loss_and_grads(model_args, level)
        assert abs(got_loss - loss) <= 1e-5 * abs(loss), level
        assert got_grads.keys() == grads.keys(), "recompute must not rename parameters"
        for name, want in grads.items():
            assert torch.allclose(got_grads[name], want, rtol=1e-4, atol=1e-6), (level, name)
        assert got_held < held, f"{level} must hold less than none"


def test_levels_wrap_what_they_say() -> None:
    model = build_model(TINY, seed=0)
    assert apply_recompute(model, "selective") == TINY.n_layers
    assert apply_recompute(model, "selective") == 0, "a level is applied once"
    assert apply_recompute(model, "full") == TINY.n_layers
    assert all(getattr(b.forward, MARK, False) for b in model.layers.values())
    assert apply_recompute(build_model(TINY, seed=0), "none") == 0
    with pytest.raises(ValueError, match="parallel.recompute: 'auto'"):
        apply_recompute(model, "auto")


@pytest.mark.parametrize("model_args", [TINY, pytest.param(BIGGER, marks=pytest.mark.slow)],
                         ids=["tiny", "bigger"])
@pytest.mark.parametrize("level", LEVELS)
def test_held_activations_match_the_planner(model_args: ModelArgs, level: str) -> None:
    _, _, measured = _loss_and_grads(model_args, level)
    predicted = planner_held_bytes(model_args, level, 2)
    assert measured / predicted == pytest.approx(1.0, abs=0.05), (measured, predicted)


def test_auto_takes_the_planner_choice_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    layout = ParallelLayout(micro_batch_size=2)
    need = {lv: planner_held_bytes(BIGGER, lv, 2) for lv in LEVELS}
    assert need["full"] < need["selective"] < need["none"]
    assert resolve_recompute("auto", BIGGER, layout, 2, "float32", 64)[0] == "none"
    assert resolve_recompute("auto", BIGGER, layout, 2, "float32", 0.01)[0] == "full"
    level, why = resolve_recompute("selective", BIGGER, layout, 2, "float32", 64)
    assert (level, why) == ("selective", "set by parallel.recompute")
    level, why = resolve_recompute("auto", BIGGER, layout, 2, "float32", 0.001)
    assert level == "full" and "nothing fits" in why
    with pytest.raises(ValueError, match="parallel.recompute: 'most'"):
        resolve_recompute("most", BIGGER, layout, 2, "float32", 64)
    from tenax.parallel import engine_recompute

    with caplog.at_level(logging.INFO, logger="tenax.parallel.recompute"):
        level = engine_recompute("auto", TINY, layout, 2, "float32", torch.device("cpu"), 2)
    assert level == "none"
    assert "parallel.recompute=auto -> none" in caplog.text


# ---- the plan's level is the one the ranks run -------------------------------------------------
class StartRecorder:
    """A WorkerGroup stand-in for Placer: records the spec each start hands the ranks."""
    started: list[dict] = []

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.ranks: list = []
        self.blocks: list = []

    def create(self, layout: ParallelLayout, timeout_s: float) -> dict:
        return {"reused": 0, "created": layout.world_size}

    def start(self, spec: dict, *args: object) -> tuple[str, int]:
        StartRecorder.started.append(spec)
        return "127.0.0.1", 0


def test_ranks_run_the_level_the_plan_printed(monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """llama3-8b on 8 GPUs pinned to tp8: planned with the assumed 80 GiB, `none` fits; a 24 GiB
    card's own estimate says `full`. The ranks get `none` (what the plan printed), and a rank
    with 24 GiB keeps it and warns naming both."""
    from tenax.orchestrator.job.scaling_policy import ScalingPolicy
    from tenax.orchestrator.placement import placer as placer_module
    from tenax.orchestrator.placement.capacity import Capacity
    from tenax.orchestrator.presets import PRESETS
    from tenax.orchestrator.spec import JobSpec, plan_for_spec, spec_from_dict
    from tenax.parallel import engine_recompute
    from tenax.parallel import recompute as recompute_module

    spec = JobSpec.model_validate({
        "model": PRESETS["llama3-8b"], "parallel": {"tp": 8, "dp": 1, "micro_batch_size": 1},
        "resources": {"gpus_per_node": 8, "device": "cuda"},
        "train": {"global_batch_size": 64, "dtype": "bfloat16"},
        "checkpoint": {"memory_every_steps": 0}})
    decision = ScalingPolicy().make_decision(spec, Capacity(1), 1)
    reference = plan_for_spec(spec, 8, 8, pin_zero=True).best  # the planner on its own
    assert decision.layout == reference.layout and decision.layout.tp == 8
    assert decision.recompute == reference.recompute == "none"
    assert "recompute=none" in decision.reason  # the level the controller prints
    model, layout = spec.model.args(), decision.layout
    assert resolve_recompute("auto", model, layout, 64, "bfloat16", 24.0)[0] == "full"

    monkeypatch.setattr(placer_module, "WorkerGroup", StartRecorder)
    StartRecorder.started.clear()
    placer_module.Placer("job", spec, 1.0).place(None, layout, None, decision.recompute)
    (handed,) = StartRecorder.started
    assert handed["parallel"]["recompute"] == "none"
    assert spec.parallel.recompute == "auto"  # the job's own spec still plans every placement

    monkeypatch.setattr(recompute_module, "device_mem_gib", lambda device, ranks: 24.0)
    rank_spec = spec_from_dict(handed)
    with caplog.at_level(logging.INFO, logger="tenax.parallel.recompute"):
        level = engine_recompute(rank_spec.parallel.recompute, model, layout, 64, "bfloat16",
                                 torch.device("cpu"), 8)
    assert level == "none"
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "recompute=none" in warned[0], warned
    assert "24 GiB would choose full" in warned[0], warned


def test_engine_without_a_plan_resolves_auto_with_its_own_memory(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from tenax.parallel import engine_recompute
    from tenax.parallel import recompute as recompute_module
    from tenax.parallel.hardware import slot_memory_gib

    layout = ParallelLayout(micro_batch_size=2)
    # A device whose memory the engine cannot read plans like the planner: 80 GiB per slot.
    assert recompute_module.device_mem_gib(torch.device("meta"), 2) == slot_memory_gib("cuda", 2)
    monkeypatch.setattr(recompute_module, "device_mem_gib", lambda device, ranks: 0.01)
    with caplog.at_level(logging.INFO, logger="tenax.parallel.recompute"):
        level = engine_recompute("auto", BIGGER, layout, 2, "float32", torch.device("cpu"), 2)
        named = engine_recompute("full", BIGGER, layout, 2, "float32", torch.device("cpu"), 2)
    assert (level, named) == ("full", "full")
    assert not [r for r in caplog.records if "would choose" in r.getMessage()]
    with pytest.raises(ValueError, match="parallel.recompute: 'most'"):
        engine_recompute("most", BIGGER, layout, 2, "float32", torch.device("cpu"), 2)


# ---- the engine, through the trainer -----------------------------------------------------------
FOUR_LAYERS = ["train.lr=0.5", "model.n_layers=4"]


def recompute_job(rank: int, world: int, layout: dict, level: str, extra: tuple = ()) -> dict:
    """Three SGD steps; the level the engine resolved and how many blocks it checkpointed."""
    from tenax.parallel.layout import ParallelLayout as Layout
    from tenax.workers.trainer import Trainer
    from tests.engine_jobs import tiny_spec

    trainer = Trainer(tiny_spec([*FOUR_LAYERS, *extra, f"parallel.recompute={level}"]),
                      Layout(**layout), optimizer="sgd")
    results = [trainer.run_step() for _ in range(3)]
    params = trainer.full_params()  # collective: every rank calls it
    blocks = [b for part in trainer.parts for b in part.layers.values()]
    return {"loss": [r.loss for r in results], "grad_norm": [r.grad_norm for r in results],
            "params": params if rank == 0 else None,
            "recompute": trainer.pm.recompute,
            "checkpointed": sum(bool(getattr(b.forward, MARK, False)) for b in blocks)}


@functools.lru_cache(maxsize=None)
def none_reference(extra: tuple = ()) -> dict:
    return run_ranks(recompute_job, 1, {"micro_batch_size": 1}, "none", extra)[0]


def assert_same_run(out: dict, ref: dict) -> None:
    for name in ("loss", "grad_norm"):
        got, want = torch.tensor(out[name]), torch.tensor(ref[name])
        assert ((got - want).abs() / want.abs()).max().item() < 1e-5, (name, out[name], ref[name])
    for key, want in ref["params"].items():
        assert (out["params"][key] - want).abs().max().item() < 1e-5, key


@pytest.mark.slow
@pytest.mark.parametrize("level", ["auto", "selective", "full"])
def test_single_rank_engine_runs_each_level(level: str) -> None:
    out = run_ranks(recompute_job, 1, {"micro_batch_size": 1}, level)[0]
    assert out["recompute"] == ("none" if level == "auto" else level)
    assert out["checkpointed"] == (4 if level == "full" else 0)
    assert_same_run(out, none_reference())


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2), dict(dp=2, zero=3), dict(cp=2),
                                    dict(pp=2, pp_schedule="zero_bubble")],
                         ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
@pytest.mark.parametrize("level", ["selective", "full"])
def test_multi_rank_parity_with_recompute(layout: dict, level: str) -> None:
    world = layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1)
    outs = run_ranks(recompute_job, world, {**layout, "micro_batch_size": 1}, level)
    assert all(o["recompute"] == level for o in outs)
    if level == "full":  # every rank checkpoints each block it holds
        assert sum(o["checkpointed"] for o in outs) == 4 * world // layout.get("pp", 1)
    assert_same_run(outs[0], none_reference())


MOE = ("model.moe={num_experts: 4, top_k: 2, capacity_factor: 4.0, aux_loss_coef: 0.05}",)


@pytest.mark.slow
@pytest.mark.parametrize("level", ["selective", "full"])
def test_expert_parallel_parity_with_recompute(level: str) -> None:
    """The MoE aux loss is built inside a checkpointed block: its gradient must survive."""
    outs = run_ranks(recompute_job, 2, {"dp": 2, "ep": 2, "zero": 0, "micro_batch_size": 1},
                     level, MOE)
    assert outs[0]["recompute"] == level
    assert_same_run(outs[0], none_reference(MOE))


HELD_SHAPE = ["model.dim=128", "model.ffn_hidden=344", "model.seq_len=64", "model.vocab_size=256",
              "model.n_layers=3", "model.n_heads=8", "model.n_kv_heads=4"]


def held_job(rank: int, world: int, layout: dict, level: str) -> int:
    """Bytes this rank saves for backward in one micro-batch's forward through the engine."""
    from tenax.parallel import local, zigzag_split
    from tenax.parallel.layout import ParallelLayout as Layout
    from tenax.workers.trainer import Trainer
    from tests.engine_jobs import tiny_spec

    trainer = Trainer(tiny_spec([*HELD_SHAPE, f"parallel.recompute={level}"]), Layout(**layout))
    model = trainer.parts[0]
    tokens = torch.randint(0, 256, (1, 65), generator=torch.Generator().manual_seed(0))
    cp, cp_rank = trainer.layout.cp, trainer.coords["cp"]
    x, y = (zigzag_split(t, cp, cp_rank) if cp > 1 else t for t in (tokens[:, :-1], tokens[:, 1:]))
    with SavedTensorMeter([local(p) for p in model.parameters()]) as meter:
        cross_entropy_sum(model(x), y)
    return meter.nbytes


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(tp=2), dict(cp=2), dict(tp=2, cp=2)],
                         ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
@pytest.mark.parametrize("level", LEVELS)
def test_held_activations_match_the_planner_under_tp_and_cp(layout: dict, level: str) -> None:
    """Sequence-parallel norms, gathered projection inputs, full logits on every tp rank and
    ring attention's own saves: the per-rank formula, not the single-rank one divided."""
    world = layout.get("tp", 1) * layout.get("cp", 1)
    held = run_ranks(held_job, world, {**layout, "micro_batch_size": 1}, level)
    model_args = ModelArgs(dim=128, n_layers=3, n_heads=8, n_kv_heads=4, ffn_hidden=344,
                           seq_len=64, vocab_size=256)
    shape = activation_shape(model_args, ParallelLayout(**layout, micro_batch_size=1), 4)
    predicted = 3 * block_activation_bytes(shape, level) + head_activation_bytes(shape, 256, 16)
    for measured in held:
        assert measured / predicted == pytest.approx(1.0, abs=0.05), (measured, predicted)
