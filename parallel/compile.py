"""`train.compile`: compile each transformer block with torch.compile (inductor).

Why per block and not the whole model: every block runs the same code on the same shapes, so
one compiled graph serves them all (dynamo lifts the parameters to graph inputs instead of
guarding on each block), and compile time does not grow with depth. What it buys: the norms,
rotary, SwiGLU and residual adds fuse into a few kernels instead of one launch and one round
trip through memory per elementwise op.

Why `module.compile()` and not `torch.compile(module)`: the latter wraps the block in an
`OptimizedModule` that inserts `_orig_mod.` into every parameter name; `compile()` compiles the
block's own call in place, so checkpoints, the init-by-name and FSDP2 see the names of the plain
model.

Order (`parallel_model.parallelize`): after activation recompute, before FSDP2. Recompute
replaces the block's `forward` (or its attention core) in place, and the compiled call runs
whatever `forward` is, so checkpointing is traced inside the compiled region; FSDP2 then wraps
the compiled block, and its hooks (dynamo-disabled by torch) run eagerly around the graph.

Blocks that stay eager, with a warning naming why:
- MoE blocks: routing reads per-expert token counts back to the host (`.tolist()`, `nonzero`) to
  size the dispatch, which breaks the graph six times per block and recompiles the pieces for
  every new set of counts.
- Tensor-parallel blocks (DTensor parameters): with torch 2.13 on gloo the compiled block's
  backward hands DTensor's redistribute a plain tensor as gradient (AttributeError
  `_local_tensor`) on the first step.
Context parallelism compiles and trains like eager, but ring attention's send/recv break the
graph around the attention core (the norms, projections and MLP are still compiled).
"""
from __future__ import annotations

import logging

from torch import nn

from tenax.parallel.model import TransformerBlock

logger = logging.getLogger(__name__)

MARK = "tenax_compiled"  # set on a compiled block so it is never compiled twice


def eager_reason(block: nn.Module) -> str:
    """Why `block` stays eager ('' when it compiles)."""
    from torch.distributed.tensor import DTensor

    from tenax.parallel.expert_parallel import MoEFeedForward

    if isinstance(getattr(block, "feed_forward", None), MoEFeedForward):
        return "MoE routing reads token counts back to the host (a recompile per new count)"
    if any(isinstance(p, DTensor) for p in block.parameters()):
        return "tensor-parallel blocks fail in the compiled backward (DTensor redistribute)"
    return ""


def apply_compile(part: nn.Module) -> int:
    """Compile each transformer block of a model or pipeline stage in place, except those
    `eager_reason` keeps eager; returns how many blocks this call compiled."""
    blocks = [m for m in part.modules() if isinstance(m, TransformerBlock)]
    fresh = [b for b in blocks if not getattr(b, MARK, False)]
    reasons = {id(b): eager_reason(b) for b in fresh}
    chosen = [b for b in fresh if not reasons[id(b)]]
    for block in chosen:
        block.compile()
        setattr(block, MARK, True)
    for why in sorted({r for r in reasons.values() if r}):
        count = sum(r == why for r in reasons.values())
        logger.warning("train.compile: %d transformer blocks left eager: %s", count, why)
    logger.info("train.compile: %d of %d transformer blocks compiled (%d already were); the "
                "first step pays the compile time", len(chosen), len(blocks),
                len(blocks) - len(fresh))
    return len(chosen)
