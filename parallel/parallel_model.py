"""Apply the parallelisms of a layout to a model, always in one fixed order.

Order: build on meta -> PP split into stage modules -> per stage: TP/SP -> CP -> EP ->
activation recompute -> compile -> FSDP2 (zero 3) -> materialise -> init -> hand-written DP
(zero 0-2).
TP first because CP, EP and FSDP2 all work on the DTensors TP produced or leave them alone;
FSDP2 last among the wrappers because it shards whatever parameters the others left; recompute
just before it, so checkpointing runs inside each FSDP unit and wraps whatever attention core
CP installed. Compile (per block, in place: parallel/compile.py) comes after recompute so the
checkpointing is traced inside each compiled block, and before FSDP2 so FSDP2 wraps the compiled
block and its hooks stay eager. Weights are initialised only after every wrapper is in place:
`init_weights` fills each shard from (seed, parameter name), so every layout starts from the
same model without ever holding it whole. The hand-written DP comes last because it takes views
of the materialised parameters.

Process groups: data parallelism spans dp*cp ranks (context-parallel ranks hold the same
weights); experts are sharded over `ep` ranks carved from them and their grads are reduced
over `edp`, the ranks holding the same experts.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tenax.parallel.compile import apply_compile
from tenax.parallel.config import ModelArgs, tie_problems
from tenax.parallel.data_parallel import DataParallel
from tenax.parallel.fully_sharded import apply_fsdp
from tenax.parallel.layout import ParallelLayout
from tenax.parallel.model import Transformer, init_weights, tie_output
from tenax.parallel.pipeline_parallel import build_stage_module, split_layers, stage_ids
from tenax.parallel.recompute import apply_recompute
from tenax.parallel.tensor_parallel import apply_tp

logger = logging.getLogger(__name__)


@dataclass
class ParallelGroups:
    """The process groups one rank needs beyond the mesh's own dims."""
    dp_cp_mesh: DeviceMesh  # 1-D mesh over dp*cp ranks (FSDP2 shards over it)
    dp_cp: dist.ProcessGroup
    ep: dist.ProcessGroup | None = None
    edp: dist.ProcessGroup | None = None


def _my_subgroup(groups: list[list[int]]) -> dist.ProcessGroup:
    # Every rank must create every group, in the same order: group creation is collective.
    mine, _ = dist.new_subgroups_by_enumeration(groups)
    return mine


def build_groups(layout: ParallelLayout, mesh: DeviceMesh) -> ParallelGroups:
    if layout.cp > 1:
        dp_cp_mesh = mesh["dp", "cp"]._flatten("dp_cp")
    else:
        dp_cp_mesh = mesh["dp"]
    groups = ParallelGroups(dp_cp_mesh, dp_cp_mesh.get_group())
    if layout.ep > 1:
        groups.ep = _my_subgroup(layout.groups("ep"))
        groups.edp = _my_subgroup(layout.groups("edp"))
    return groups


@dataclass
class ParallelModel:
    """The model chunks a rank trains, with the data-parallel machinery that goes with them."""
    parts: list[nn.Module]  # one per pipeline stage held here; [whole model] without PP
    stage_ids: list[int]
    layout: ParallelLayout
    mesh: DeviceMesh
    groups: ParallelGroups
    dps: list[DataParallel] = field(default_factory=list)  # empty for zero 3 (FSDP2)
    recompute: str = "none"  # the resolved activation recompute level (parallel/recompute.py)
    compiled: int = 0  # transformer blocks compiled on this rank (parallel/compile.py)

    @property
    def fsdp(self) -> bool:
        return self.layout.zero == 3

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Canonical names are unique across parts: stages keep their layers' keys."""
        return [item for part in self.parts for item in part.named_parameters()]

    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_parameters()]

    def optimizer_params(self) -> list[nn.Parameter]:
        if self.fsdp:
            return [p for p in self.parameters() if p.requires_grad]
        return [p for dp in self.dps for p in dp.optimizer_params()]


def _build_parts(spec: ModelArgs, layout: ParallelLayout,
                 pp_rank: int) -> tuple[list[nn.Module], list[int]]:
    if layout.pp == 1:
        with torch.device("meta"):
            return [Transformer(spec)], [0]
    n_stages = layout.pp * layout.pp_virtual_stages
    split = split_layers(spec.n_layers, n_stages, uneven=n_stages > 2)
    ids = stage_ids(pp_rank, layout.pp, layout.pp_virtual_stages, layout.pp_schedule)
    with torch.device("meta"):
        parts = [build_stage_module(spec, split[i], i == 0, i == n_stages - 1) for i in ids]
    return parts, ids


def _wrap_part(part: nn.Module, spec: ModelArgs, layout: ParallelLayout, mesh: DeviceMesh,
               groups: ParallelGroups, recompute: str, compile: bool) -> int:
    """Wrap one part in the fixed order; returns how many blocks were compiled."""
    apply_tp(part, mesh["tp"])
    if layout.cp > 1:
        from tenax.parallel.context_parallel import apply_cp

        apply_cp(part, mesh["cp"].get_group())
    if spec.moe is not None and layout.ep > 1:
        from tenax.parallel.expert_parallel import apply_ep

        apply_ep(part, groups.ep)
    apply_recompute(part, recompute)
    compiled = apply_compile(part) if compile else 0
    if layout.zero == 3:
        apply_fsdp(part, groups.dp_cp_mesh)
    return compiled


def _build_dps(pm: ParallelModel) -> list[DataParallel]:
    from tenax.parallel.expert_parallel import is_expert_param

    layout, groups = pm.layout, pm.groups
    overlap = layout.pp == 1  # pipeline schedules run backward outside our micro-batch loop
    named = pm.named_parameters()
    dense = [p for n, p in named if not (layout.ep > 1 and is_expert_param(n))]
    dps = [DataParallel(dense, groups.dp_cp, layout.zero, overlap=overlap)]
    experts = [p for n, p in named if layout.ep > 1 and is_expert_param(n)]
    if experts:
        dps.append(DataParallel(experts, groups.edp, layout.zero, divisor=layout.dp * layout.cp,
                                overlap=overlap))
    return dps


def adamw_impl(device: torch.device) -> dict[str, bool]:
    """AdamW's implementation flags. On GPUs fused: the whole update (moments, decay, step) is
    one multi-tensor kernel that reads each tensor once; foreach launched one kernel per
    elementwise op, each a pass over all the state, and per-tensor launches would dominate a
    large model's step. On CPU the plain per-tensor loop: grouping buys nothing there, and
    per-tensor ops keep every layout's arithmetic identical to the single-process run."""
    if device.type == "cuda":
        return {"fused": True}
    return {"foreach": False}


def parallelize(model_spec: ModelArgs, layout: ParallelLayout, mesh: DeviceMesh, seed: int,
                device: torch.device, dtype: torch.dtype = torch.float32,
                initialise: bool = True, recompute: str = "none",
                compile: bool = False) -> ParallelModel:
    """`initialise=False` leaves the parameters' memory as allocated (not initialised): for a
    rank that loads every one of them next (`init_weights` later gives the same values).
    `recompute`: none, selective or full (resolve "auto" first: `recompute.resolve_recompute`).
    `compile`: torch.compile each dense transformer block (parallel/compile.py)."""
    problems = tie_problems(model_spec, layout.pp, layout.zero)
    if problems:
        raise ValueError("; ".join(problems))
    groups = build_groups(layout, mesh)
    pp_rank = layout.coords(dist.get_rank())["pp"]
    parts, ids = _build_parts(model_spec, layout, pp_rank)
    compiled = 0
    for part in parts:
        compiled += _wrap_part(part, model_spec, layout, mesh, groups, recompute, compile)
        part.to_empty(device=device)
        tie_output(part)  # TP and to_empty replaced the parameters
        if initialise:
            init_weights(part, seed)
        if dtype != torch.float32:
            part.to(dtype=dtype)
    pm = ParallelModel(parts, ids, layout, mesh, groups, recompute=recompute, compiled=compiled)
    if layout.zero != 3:
        pm.dps = _build_dps(pm)
    logger.info("parallelized: %s, stages %s on this rank, recompute=%s, compiled blocks=%d",
                layout.describe(), ids, recompute, compiled)
    return pm
