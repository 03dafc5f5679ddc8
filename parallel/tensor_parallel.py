"""Tensor parallelism with sequence parallelism (Megatron-style) on torch's `parallelize_module`.

Attention: wq/wk/wv column-parallel (each rank owns whole heads), wo row-parallel. MLP: w1/w3
column-parallel, w2 row-parallel. Between blocks the residual stream stays sharded along the
sequence (SP), so norms and residual adds run on s/tp tokens and activations cost 1/tp; each
column-parallel entry all-gathers the sequence and each row-parallel exit reduce-scatters it.
That is 2 all-gathers + 2 reduce-scatters forward per layer (= 2 all-reduce equivalents) and the
same backward: the 4 all-reduces per layer of the cost model.

The residual stream is kept as plain local tensors (each module converts at its own boundary),
which keeps the model code unaware of DTensor.
"""
from __future__ import annotations

import logging

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

logger = logging.getLogger(__name__)


def _block_plan() -> dict:
    return {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                        desired_input_layouts=(Replicate(), None, None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                           desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }


def _root_plan(model: nn.Module) -> dict:
    """Plans for the parts a pipeline stage may lack (embedding, final norm, head)."""
    plan = {}
    if getattr(model, "tok_embeddings", None) is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if getattr(model, "norm", None) is not None:
        plan["norm"] = SequenceParallel()
    if getattr(model, "output", None) is not None:
        # Full logits on every tp rank: the loss and its global-batch average stay layout-free.
        plan["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    return plan


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Shard `model` (a Transformer or a pipeline stage of one) over `tp_mesh`, in place."""
    if tp_mesh.size() == 1:
        return model
    parallelize_module(model, tp_mesh, _root_plan(model))
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, _block_plan())
    logger.info("applied TP+SP over tp=%d to %d blocks", tp_mesh.size(), len(model.layers))
    return model
