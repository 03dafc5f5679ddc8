"""A layout the user pins runs: rules of thumb become warnings that name their cost."""
from __future__ import annotations

import math

from tenax.orchestrator.spec import plan_for_spec
from tests.distributed import run_ranks
from tests.engine_jobs import tiny_spec, train_job

PINNED_PP = ["parallel.pp=2", "parallel.micro_batch_size=2"]  # global batch 8: 4 micro-batches


def test_pipeline_with_four_micro_batches_plans_warns_and_trains() -> None:
    """Used to fail with "no layout of 2 GPUs fits a 0.000218B-parameter model" (m < 4*pp)."""
    spec = tiny_spec(PINNED_PP)
    result = plan_for_spec(spec, 2, 2)
    assert result.layout.pp == 2 and result.best.microbatches == 4
    assert result.best.warnings[0].startswith(
        "pipeline bubble 20% with 4 micro-batches; 8 would give 11%")
    out = run_ranks(train_job, 2, result.layout.to_dict(), "adamw", 2, PINNED_PP)
    losses = out[0]["loss"]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
