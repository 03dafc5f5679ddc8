"""ZeRO-3: FSDP2 units per transformer block, plus the embedding, final norm and head.

Why a unit of their own for the embedding, norm and head: FSDP2 keeps the root module's own
parameters unsharded from forward to backward, so left in the root they would be held whole
for the whole step (parallel/data_parallel.py covers zero 0-2, written by hand).
"""
from __future__ import annotations

import logging

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

logger = logging.getLogger(__name__)

ROOT_UNITS = ("tok_embeddings", "norm", "output")


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, block_names: str = "layers") -> nn.Module:
    """ZeRO-3: shard each transformer block, the embedding, final norm and head, then the root.

    `dp_mesh` spans dp*cp ranks: context-parallel ranks hold the same weights, so they shard
    them like data-parallel ranks do. The embedding, norm and head get units of their own
    because FSDP2 never reshards the root's own parameters between forward and backward; as
    separate units they are resharded after forward like the blocks, so ZeRO-3 holds 1/N of
    every parameter outside the layer being computed and moves exactly (2m+1)(N-1)/N of the
    parameter bytes per step (the cost model's figure).
    """
    from torch.distributed.fsdp import fully_shard

    blocks = getattr(model, block_names)
    for block in blocks.values():
        fully_shard(block, mesh=dp_mesh)
    units = [name for name in ROOT_UNITS if getattr(model, name, None) is not None]
    for name in units:
        fully_shard(getattr(model, name), mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    logger.info("applied FSDP2 (zero 3) over dp=%d: %d blocks + %s as own units + root",
                dp_mesh.size(), len(blocks), units)
    return model
