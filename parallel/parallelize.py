"""Apply the parallelisms of a layout to a model, always in one fixed order.

Order: build on meta -> TP/SP -> data parallel (FSDP2 for zero 3) -> materialise -> init ->
hand-written DP (zero 0-2). TP first because FSDP2 shards DTensors that TP produced (2-D), and
weights are initialised only after every wrapper is in place: `init_weights` fills each shard from
(seed, parameter name), so every layout starts from the same model without ever holding it whole.
The hand-written DP comes last because it takes views of the materialised parameters.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from orchestrator.spec import ModelSpec
from parallel.data_parallel import DataParallel, apply_fsdp
from parallel.layout import ParallelLayout
from parallel.model import Transformer, init_weights
from parallel.tensor_parallel import apply_tp

logger = logging.getLogger(__name__)


@dataclass
class ParallelModel:
    """The model a rank trains, with the data-parallel machinery that goes with it."""
    model: nn.Module
    layout: ParallelLayout
    mesh: DeviceMesh
    dp: DataParallel | None  # None for zero 3, where FSDP2 owns gradient sync

    @property
    def fsdp(self) -> bool:
        return self.dp is None

    def optimizer_params(self) -> list[nn.Parameter]:
        if self.dp is None:
            return [p for p in self.model.parameters() if p.requires_grad]
        return self.dp.optimizer_params()


def parallelize(model_spec: ModelSpec, layout: ParallelLayout, mesh: DeviceMesh, seed: int,
                device: torch.device, dtype: torch.dtype = torch.float32) -> ParallelModel:
    with torch.device("meta"):
        model = Transformer(model_spec)
    apply_tp(model, mesh["tp"])
    if layout.zero == 3:
        apply_fsdp(model, mesh["dp"])
    model.to_empty(device=device)
    init_weights(model, seed)
    if dtype != torch.float32:
        model.to(dtype=dtype)
    dp = None if layout.zero == 3 else DataParallel(model, mesh["dp"].get_group(), layout.zero)
    logger.info("parallelized %s: %s", type(model).__name__, layout.describe())
    return ParallelModel(model, layout, mesh, dp)
