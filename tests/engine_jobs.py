"""Per-rank jobs shared by the engine's multi-process tests (importable by spawned ranks)."""
from __future__ import annotations

from typing import Any

TINY = ["model.n_layers=2", "model.dim=64", "model.n_heads=8", "model.n_kv_heads=4",
        "model.ffn_hidden=96", "model.seq_len=32", "model.vocab_size=128",
        "train.global_batch_size=8", "train.warmup_steps=0", "parallel.micro_batch_size=1"]


def tiny_spec(extra: list[str] | None = None):
    from tenax.orchestrator.spec import load_spec

    return load_spec(overrides=TINY + (extra or []))


def train_job(rank: int, world: int, layout: dict[str, Any], optimizer: str, steps: int,
              extra: list[str]) -> dict[str, Any]:
    """Train `steps` and return losses, grad norms and the full final parameters."""
    from tenax.parallel.layout import ParallelLayout
    from tenax.workers.trainer import Trainer

    trainer = Trainer(tiny_spec(extra), ParallelLayout(**layout), optimizer=optimizer)
    results = [trainer.run_step() for _ in range(steps)]
    params = trainer.full_params()
    return {"loss": [r.loss for r in results], "grad_norm": [r.grad_norm for r in results],
            "params": params if rank == 0 else None}


def memory_job(rank: int, world: int, layout: dict[str, Any]) -> dict[str, int]:
    """Per-rank bytes of params, grads and optimizer state right after a step."""
    from tenax.parallel.data_parallel import local
    from tenax.parallel.layout import ParallelLayout
    from tenax.workers.trainer import Trainer

    trainer = Trainer(tiny_spec(), ParallelLayout(**layout), optimizer="adamw")
    trainer.run_step()
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    params = sum(nbytes(local(p)) for p in trainer.pm.parameters())
    if layout.get("zero") == 2:
        grads = sum(nbytes(g) for dp in trainer.pm.dps for _, g in dp.owned_grads())
    else:
        grads = sum(nbytes(local(p.grad)) for p in trainer.pm.parameters() if p.grad is not None)
    opt = sum(nbytes(local(v)) for state in trainer.optimizer.state.values()
              for k, v in state.items() if k != "step")
    return {"params": params, "grads": grads, "optimizer": opt,
            "n_params": trainer.spec.model.num_params()}


def comm_job(rank: int, world: int, layout: dict[str, Any], extra: list[str]) -> dict[str, Any]:
    """Collective counts and bytes of one step (after a warm-up step)."""
    from tenax.parallel.comm_counter import CommCounter
    from tenax.parallel.layout import ParallelLayout
    from tenax.workers.trainer import Trainer

    trainer = Trainer(tiny_spec(extra), ParallelLayout(**layout))
    trainer.run_step()
    with CommCounter() as counter:
        trainer.run_step()
    return counter.summary()


DP_BATCH = 16  # global batch of the ZeRO accounting jobs: 1 or 4 micro-batches at dp 2 and 4


def zero_accounting_job(rank: int, world: int, configs: list[tuple[int, int]]) -> dict[str, Any]:
    """Per (zero, micro-batches m): collective input bytes of one counted step (after a warm-up
    step) and the grad bytes held when the last micro-batch begins, on `world` dp ranks."""
    from tenax.parallel.comm_counter import CommCounter
    from tenax.parallel.layout import ParallelLayout
    from tenax.workers.trainer import Trainer

    out: dict[str, Any] = {}
    for zero, m in configs:
        layout = ParallelLayout(dp=world, zero=zero, micro_batch_size=DP_BATCH // (world * m))
        trainer = Trainer(tiny_spec([f"train.global_batch_size={DP_BATCH}"]), layout)
        trainer.run_step()
        held: list[int] = []

        def watch(index: int, last: bool, trainer: Any = trainer) -> None:
            if last and index > 0:
                held.append(sum(dp.held_grad_bytes() for dp in trainer.pm.dps))

        trainer.on_micro_batch = watch
        with CommCounter() as counter:
            trainer.run_step()
        out[f"zero{zero} m{m}"] = {"comm": counter.summary(), "accum": trainer.accum,
                                   "held_grads": held[0] if held else None,
                                   "n_params": trainer.spec.model.num_params()}
    return out
