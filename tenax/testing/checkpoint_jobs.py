"""Rank functions that leave a checkpoint behind, shared by tests and benches (run them with
`tenax.testing.ranks.run_ranks`; they are module-level so the rank processes can import them)."""
from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)


def save_one_step(rank: int, world: int, uri: str, layout: dict[str, Any],
                  overrides: list[str], timeout_s: float = 600.0) -> dict[str, torch.Tensor] | None:
    """Train one step in `layout` (micro-batch 1 unless given), save it synchronously under
    `uri`; rank 0 returns the full parameters, to compare with what is later read back."""
    from tenax.checkpoint import CheckpointManager
    from tenax.parallel import ParallelLayout
    from tenax.workers.checkpoint_config import checkpoint_config
    from tenax.workers.spec import load_spec
    from tenax.workers.trainer import Trainer

    spec = load_spec(overrides=overrides + [f"checkpoint.uri={uri}"])
    trainer = Trainer(spec, ParallelLayout(**{"micro_batch_size": 1, **layout}))
    trainer.run_step()
    with CheckpointManager(checkpoint_config(spec), trainer, rank, world, writer="sync",
                           timeout_s=timeout_s) as mgr:
        mgr.save(trainer.step)
        mgr.wait()
    full = trainer.full_params()
    return full if rank == 0 else None
