"""`train.compile`: per-block torch.compile trains exactly like eager, keeps the plain model's
parameter names, and the spec key takes booleans only."""
from __future__ import annotations

import functools
import logging

import pytest
import torch

from tenax.orchestrator.spec import JobSpec, SpecError, load_spec
from tenax.parallel import Transformer, apply_compile, apply_recompute, build_model
from tenax.parallel.compile import MARK
from tenax.parallel.config import ModelArgs, MoEArgs
from tenax.parallel.pipeline_parallel import build_stage_module
from tests.distributed import run_ranks

TINY = ModelArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=96, seq_len=32,
                 vocab_size=128)


@functools.lru_cache(maxsize=None)
def inductor_problem() -> str:
    """Why the CPU inductor cannot compile on this host ('' when it can): a C++ compiler is
    needed; without one the backend fails and the parity test has nothing to compare."""
    import torch._inductor.config
    from torch._dynamo.exc import BackendCompilerFailed

    torch._inductor.config.compile_threads = 1  # no worker pool on a shared 2-core host
    try:
        torch.compile(lambda x: torch.sin(x) * 2 + 1)(torch.ones(4))
    except BackendCompilerFailed as err:
        return f"the CPU inductor cannot compile here: {str(err).splitlines()[0]}"
    return ""


def train_job(rank: int, world: int, compile: bool, recompute: str,
              layout: dict | None = None) -> dict:
    """Three AdamW steps of the trainer (the CPU per-tensor AdamW the parity tests rely on)."""
    import torch._inductor.config

    from tenax.parallel.layout import ParallelLayout
    from tenax.workers.trainer import Trainer
    from tests.engine_jobs import tiny_spec

    torch._inductor.config.compile_threads = 1  # compile in this process, no worker pool
    trainer = Trainer(tiny_spec([f"train.compile={str(compile).lower()}",
                                 f"parallel.recompute={recompute}"]),
                      ParallelLayout(**{"micro_batch_size": 1, **(layout or {})}),
                      optimizer="adamw")
    results = [trainer.run_step() for _ in range(3)]
    params = trainer.full_params()  # collective: every rank calls it
    return {"loss": [r.loss for r in results], "grad_norm": [r.grad_norm for r in results],
            "names": [n for n, _ in trainer.pm.named_parameters()],
            "compiled": trainer.pm.compiled, "params": params if rank == 0 else None}


@functools.lru_cache(maxsize=None)
def eager_run(recompute: str) -> dict:
    return run_ranks(train_job, 1, False, recompute)[0]


def assert_same_losses(got: dict, want: dict) -> None:
    for key in ("loss", "grad_norm"):
        a, b = torch.tensor(got[key]), torch.tensor(want[key])
        assert ((a - b).abs() / b.abs()).max().item() < 1e-5, (key, a, b)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_compiled_trainer_trains_like_eager(recompute: str) -> None:
    """Same seed, same data, one gloo rank: losses, grad norms and final weights agree to 1e-5
    relative; with full recompute the checkpointed block is traced inside the compiled one."""
    problem = inductor_problem()
    if problem:
        pytest.skip(problem)
    eager = eager_run(recompute)
    compiled = run_ranks(train_job, 1, True, recompute)[0]
    assert (eager["compiled"], compiled["compiled"]) == (0, TINY.n_layers)
    assert compiled["names"] == eager["names"], "compile must not rename parameters"
    assert_same_losses(compiled, eager)
    # AdamW moves each weight by about lr per step whatever its gradient's size (m / sqrt(v)),
    # so where a gradient is near zero a rounding difference of the fused kernels moves the
    # weight by a visible part of lr: weights are held to 1% of the most 3 steps can move them.
    most = 3 * JobSpec().train.lr
    for name, want in eager["params"].items():
        assert (compiled["params"][name] - want).abs().max().item() <= 0.01 * most, name


@pytest.mark.slow
@pytest.mark.parametrize("layout, compiled", [
    (dict(dp=2, zero=3), 2), (dict(pp=2), 1), (dict(cp=2), 2),
    (dict(tp=2), 0)],  # TP blocks stay eager (parallel/compile.py says why)
    ids=lambda v: "-".join(f"{k}{n}" for k, n in v.items()) if isinstance(v, dict) else None)
def test_compile_under_other_layouts_trains_like_eager(layout: dict, compiled: int) -> None:
    """FSDP2 wraps the compiled blocks, a pipeline stage compiles the blocks it holds, ring
    attention breaks the graph around its send/recv only."""
    problem = inductor_problem()
    if problem:
        pytest.skip(problem)
    world = layout.get("dp", 1) * layout.get("pp", 1) * layout.get("cp", 1) * layout.get("tp", 1)
    outs = run_ranks(train_job, world, True, "none", layout)
    assert [o["compiled"] for o in outs] == [compiled] * world
    assert_same_losses(outs[0], eager_run("none"))


def test_compile_keeps_parameter_names_and_compiles_once() -> None:
    model = build_model(TINY, seed=0)
    names, keys = [n for n, _ in model.named_parameters()], list(model.state_dict())
    apply_recompute(model, "full")  # recompute first, as parallelize does
    assert apply_compile(model) == TINY.n_layers
    assert [n for n, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == keys
    assert not any("_orig_mod" in k for k in keys), "no torch.compile wrapper in the names"
    assert all(getattr(b, MARK, False) for b in model.layers.values())
    assert apply_compile(model) == 0, "a block is compiled once"


def test_pipeline_stage_compiles_only_its_blocks() -> None:
    with torch.device("meta"):
        stage = build_stage_module(TINY, [1], first=False, last=True)
    names = [n for n, _ in stage.named_parameters()]
    assert apply_compile(stage) == 1
    assert [n for n, _ in stage.named_parameters()] == names
    assert names[0].startswith("layers.1."), "a stage keeps the whole model's layer keys"


def test_moe_blocks_stay_eager_and_say_why(caplog: pytest.LogCaptureFixture) -> None:
    moe = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, seq_len=16,
                    vocab_size=64, moe=MoEArgs(num_experts=4, top_k=2))
    with torch.device("meta"):
        model = Transformer(moe)
    with caplog.at_level(logging.INFO, logger="tenax.parallel.compile"):
        assert apply_compile(model) == 0
    assert "2 transformer blocks left eager: MoE routing" in caplog.text
    assert "0 of 2 transformer blocks compiled" in caplog.text


def test_spec_key_defaults_off_and_takes_booleans_only() -> None:
    assert JobSpec().train.compile is False
    assert load_spec(overrides=["train.compile=true"]).train.compile is True
    # Lax like every other boolean key of the spec: YAML's yes/on mean true here too.
    both = load_spec(overrides=["train.compile=yes", "data.document_mask=yes"])
    assert both.train.compile is True and both.data.document_mask is True
    for value, shown in (("sometimes", "'sometimes'"), ("2", "2"), ("null", "None")):
        with pytest.raises(SpecError) as err:
            load_spec(overrides=[f"train.compile={value}"])
        assert "train.compile: Input should be a valid boolean" in str(err.value)
        assert f"(got {shown})" in str(err.value)
