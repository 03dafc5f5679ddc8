"""ParallelLayout: the single source of truth for which rank does what.

Every other component (planner, worker group placement, meshes, checkpoint manifests) asks the
layout, never recomputes coordinates itself. Ranks are ordered (pp, dp, cp, tp) with tp varying
fastest, so a tp group is a run of consecutive ranks and — because the worker group packs
`gpus_per_node` consecutive ranks on a node — tp stays inside a node, where bandwidth is highest,
while pp and dp (the least chatty dimensions) span nodes.

The layout holds no process-group state: `build_mesh` makes a fresh DeviceMesh from whatever
default group is current, so a worker can destroy its groups and build a mesh of another size in
the same process.
"""
from __future__ import annotations

import itertools
import logging
import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from tenax.parallel.config import ModelArgs
from tenax.parallel.errors import LayoutError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

logger = logging.getLogger(__name__)

MESH_DIMS = ("pp", "dp", "cp", "tp")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")


@dataclass(frozen=True)
class ParallelLayout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 1
    micro_batch_size: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    _shape: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp", "ep", "micro_batch_size", "pp_virtual_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"layout.{name}: {value!r} must be a positive integer")
        if self.zero not in (0, 1, 2, 3):
            raise LayoutError(f"layout.zero: {self.zero!r} must be 0, 1, 2 or 3")
        if self.pp_schedule not in SCHEDULES:
            raise LayoutError(f"layout.pp_schedule: {self.pp_schedule!r} must be one of "
                              f"{SCHEDULES}")
        if (self.dp * self.cp) % self.ep:
            raise LayoutError(f"layout.ep: {self.ep} does not divide dp*cp={self.dp * self.cp}")
        object.__setattr__(self, "_shape", (self.pp, self.dp, self.cp, self.tp))

    # ---- sizes -----------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def degrees(self) -> dict[str, int]:
        """The dict form used in logs, events and metrics (DESIGN.md's `layout` field)."""
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep,
                "zero": self.zero}

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ParallelLayout":
        known = {k: d[k] for k in cls.__dataclass_fields__ if not k.startswith("_") and k in d}
        return cls(**known)

    def describe(self) -> str:
        return " x ".join(f"{k}{v}" for k, v in self.degrees().items() if k != "zero" and v > 1) \
            + f" zero{self.zero}" if self.world_size > 1 else f"single rank zero{self.zero}"

    # ---- validation ------------------------------------------------------------------------
    def problems(self, model: ModelArgs, world_size: int | None = None,
                 global_batch_size: int | None = None) -> list[str]:
        """Every reason this layout cannot train `model`; empty when it can."""
        out = []
        if world_size is not None and self.world_size != world_size:
            out.append(f"dp*tp*pp*cp = {self.dp}*{self.tp}*{self.pp}*{self.cp} = {self.world_size} "
                       f"!= world size {world_size}")
        out.extend(degree_problems(model, self.to_dict()))
        out.extend(self.engine_problems(model))
        if global_batch_size is not None:
            out.extend(self.batch_problems(global_batch_size))
        return out

    def engine_problems(self, model: ModelArgs) -> list[str]:
        """Combinations the engine rejects up front rather than train wrongly."""
        out = []
        if (model.seq_len // self.cp) % self.tp:
            out.append(f"tp={self.tp} does not divide the per-rank sequence "
                       f"seq_len/cp={model.seq_len // self.cp} (sequence parallelism splits it)")
        if model.moe is not None:
            for dim in ("tp", "pp", "cp"):
                if getattr(self, dim) > 1:
                    out.append(f"{dim}={getattr(self, dim)} with an MoE model is not supported "
                               f"(experts shard over ep; router statistics need whole sequences)")
            if self.ep > 1 and self.zero == 3:
                out.append(f"zero=3 with ep={self.ep} is not supported (FSDP2 cannot shard the "
                           "ep-sharded experts); use zero 0-2")
        return out

    def batch_problems(self, global_batch_size: int) -> list[str]:
        return batch_problems(global_batch_size, self.micro_batch_size, self.dp, self.pp,
                              self.pp_virtual_stages)

    def validate(self, model: ModelArgs, world_size: int | None = None,
                 global_batch_size: int | None = None) -> "ParallelLayout":
        problems = self.problems(model, world_size, global_batch_size)
        if problems:
            raise LayoutError(f"layout {self.degrees()} is invalid: " + "; ".join(problems))
        return self

    def accumulation_steps(self, global_batch_size: int) -> int:
        """Micro-batches each dp rank runs per optimizer step (the pipeline's m when pp > 1)."""
        self_problems = self.batch_problems(global_batch_size)
        if self_problems:
            raise LayoutError(self_problems[0])
        return global_batch_size // (self.dp * self.micro_batch_size)

    # ---- rank <-> coordinates --------------------------------------------------------------
    def coords(self, rank: int) -> dict[str, int]:
        """Rank -> {pp, dp, cp, tp}; tp varies fastest."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside [0, {self.world_size})")
        out = {}
        for name, size in zip(reversed(MESH_DIMS), reversed(self._shape)):
            out[name] = rank % size
            rank //= size
        return {name: out[name] for name in MESH_DIMS}

    def rank(self, pp: int = 0, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
        r = 0
        for name, value, size in zip(MESH_DIMS, (pp, dp, cp, tp), self._shape):
            if not 0 <= value < size:
                raise LayoutError(f"coordinate {name}={value} is outside [0, {size})")
            r = r * size + value
        return r

    def ep_rank(self, rank: int) -> int:
        """Position of `rank` in its expert-parallel group, carved from the (dp, cp) ranks."""
        c = self.coords(rank)
        return (c["dp"] * self.cp + c["cp"]) % self.ep

    # ---- groups ----------------------------------------------------------------------------
    def groups(self, dim: str) -> list[list[int]]:
        """The rank groups of one dimension; they partition the ranks.

        Besides the mesh dims (pp, dp, cp, tp): `ep`, expert-parallel groups carved as runs of
        `ep` consecutive ranks of each flattened (dp, cp) group, and `edp`, the ranks that hold
        the same experts (one per ep group), over which expert gradients are reduced.
        """
        if dim in ("ep", "edp"):
            return self._ep_groups(dim == "edp")
        if dim not in MESH_DIMS:
            raise LayoutError(f"unknown dimension {dim!r}; expected one of "
                              f"{MESH_DIMS + ('ep', 'edp')}")
        axis = MESH_DIMS.index(dim)
        others = [range(s) for i, s in enumerate(self._shape) if i != axis]
        out = []
        for rest in itertools.product(*others):
            group = []
            for v in range(self._shape[axis]):
                point = list(rest)
                point.insert(axis, v)
                group.append(self.rank(*point))
            out.append(group)
        return out

    def _ep_groups(self, expert_dp: bool) -> list[list[int]]:
        out = []
        for pp, tp in itertools.product(range(self.pp), range(self.tp)):
            flat = [self.rank(pp, dp, cp, tp) for dp in range(self.dp) for cp in range(self.cp)]
            if expert_dp:
                out.extend(flat[j::self.ep] for j in range(self.ep))
            else:
                out.extend(flat[i:i + self.ep] for i in range(0, len(flat), self.ep))
        return out

    def group_of(self, dim: str, rank: int) -> list[int]:
        for group in self.groups(dim):
            if rank in group:
                return group
        raise LayoutError(f"rank {rank} is in no {dim} group")

    # ---- nodes -----------------------------------------------------------------------------
    def node_of(self, rank: int, gpus_per_node: int) -> int:
        """Worker groups pack `gpus_per_node` consecutive ranks per node."""
        if gpus_per_node < 1:
            raise LayoutError(f"gpus_per_node: {gpus_per_node} must be >= 1")
        self.coords(rank)  # range check
        return rank // gpus_per_node

    def num_nodes(self, gpus_per_node: int) -> int:
        return math.ceil(self.world_size / gpus_per_node)

    def crosses_nodes(self, dim: str, gpus_per_node: int) -> bool:
        """True when some group of `dim` has ranks on more than one node."""
        return any(len({self.node_of(r, gpus_per_node) for r in g}) > 1 for g in self.groups(dim))

    def topology(self, gpus_per_node: int) -> dict[str, dict[str, Any]]:
        """Per dimension: size, number of groups and whether it crosses nodes (for `plan`)."""
        return {dim: {"size": len(self.groups(dim)[0]), "groups": len(self.groups(dim)),
                      "crosses_nodes": self.crosses_nodes(dim, gpus_per_node)}
                for dim in MESH_DIMS + ("ep",)}

    # ---- torch -----------------------------------------------------------------------------
    def build_mesh(self, device_type: str = "cpu") -> "DeviceMesh":
        """A 4-D DeviceMesh (pp, dp, cp, tp) over the current default process group.

        Every rank must call this in the same order with the same layout: mesh construction
        creates sub-groups collectively. Nothing is cached here, so after
        `destroy_process_group()` and a new `init_process_group()` a new call builds a mesh of
        the new size.
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise LayoutError("build_mesh needs an initialized default process group")
        if dist.get_world_size() != self.world_size:
            raise LayoutError(f"layout {self.degrees()} needs world size {self.world_size}, "
                              f"process group has {dist.get_world_size()}")
        return init_device_mesh(device_type, self._shape, mesh_dim_names=MESH_DIMS)


def layout_for(parallel: Mapping[str, Any], model: ModelArgs, global_batch_size: int,
               world_size: int | None = None) -> ParallelLayout:
    """The layout the spec's `parallel` section asks for (as a plain mapping); fails if any
    degree is "auto" (ask the planner instead), except dp when `world_size` fixes it."""
    degrees = {k: parallel[k] for k in ("dp", "tp", "pp", "cp", "ep")}
    auto = [k for k, v in degrees.items() if v == "auto"]
    if auto and world_size is not None and auto == ["dp"]:
        fixed = degrees["tp"] * degrees["pp"] * degrees["cp"]
        if world_size % fixed:
            raise LayoutError(f"parallel.dp: auto cannot fill world size {world_size} with "
                              f"tp*pp*cp={fixed}")
        degrees["dp"] = world_size // fixed
        logger.info("parallel.dp auto -> %d: fills world size %d with tp*pp*cp=%d",
                    degrees["dp"], world_size, fixed)
    elif auto:
        raise LayoutError(f"parallel.{auto[0]}: 'auto' needs the planner (or a world size for dp)")
    layout = ParallelLayout(**degrees, zero=parallel["zero"],
                            micro_batch_size=parallel["micro_batch_size"],
                            pp_schedule=parallel["pp_schedule"],
                            pp_virtual_stages=parallel["pp_virtual_stages"])
    return layout.validate(model, world_size, global_batch_size)


def degree_problems(model: ModelArgs, degrees: Mapping[str, Any],
                    global_batch_size: int | None = None) -> list[str]:
    """The one home of every rule between parallel degrees and the model (and the batch).

    The spec checks what the user pinned (a degree that is "auto" or absent is skipped: the
    planner picks it later, through ParallelLayout.problems, i.e. through this same function),
    so each message names the spec field and its value whoever asks.
    """
    def known(name: str) -> int | None:
        value = degrees.get(name, "auto")
        return None if value == "auto" else value

    out = []
    tp, pp, cp, ep = known("tp"), known("pp"), known("cp"), known("ep")
    virtual, schedule = degrees.get("pp_virtual_stages", 1), degrees.get("pp_schedule", "1f1b")
    for f in ("n_heads", "n_kv_heads") if tp is not None else ():
        if getattr(model, f) % tp:
            out.append(f"parallel.tp: {tp} does not divide model.{f}={getattr(model, f)}")
    if pp is not None and pp * virtual > model.n_layers:
        out.append(f"parallel.pp: {pp} x pp_virtual_stages={virtual} exceeds "
                   f"model.n_layers={model.n_layers}")
    if virtual > 1 and schedule not in ("interleaved_1f1b", "zero_bubble"):
        out.append(f"parallel.pp_virtual_stages: {virtual} needs pp_schedule interleaved_1f1b "
                   f"or zero_bubble, not {schedule!r}")
    if cp is not None and model.seq_len % (2 * cp):
        out.append(f"parallel.cp: 2*{cp} does not divide model.seq_len={model.seq_len}")
    if ep is not None and ep > 1 and model.moe is None:
        out.append(f"parallel.ep: {ep} needs model.moe to be set")
    elif ep is not None and model.moe is not None and model.moe.num_experts % ep:
        out.append(f"parallel.ep: {ep} does not divide "
                   f"model.moe.num_experts={model.moe.num_experts}")
    if global_batch_size is not None and "micro_batch_size" in degrees:
        out.extend(batch_problems(global_batch_size, degrees["micro_batch_size"], known("dp"),
                                  pp or 1, virtual))
    return out


def batch_problems(global_batch_size: int, micro_batch_size: int, dp: int | None = None,
                   pp: int = 1, pp_virtual_stages: int = 1) -> list[str]:
    """Whether the global batch splits into whole micro-batches (dp None = not chosen yet)."""
    if dp is None:
        if global_batch_size % micro_batch_size:
            return [f"parallel.micro_batch_size: {micro_batch_size} does not divide "
                    f"train.global_batch_size={global_batch_size}"]
        return []
    if global_batch_size % (dp * micro_batch_size):
        return [f"parallel.micro_batch_size: dp*micro_batch_size = {dp}*{micro_batch_size} does "
                f"not divide train.global_batch_size={global_batch_size}"]
    micro = global_batch_size // (dp * micro_batch_size)
    if pp > 1 and micro < pp:
        return [f"parallel.pp: {pp} needs at least {pp} micro-batches per step, "
                f"train.global_batch_size={global_batch_size} gives {micro}"]
    if pp > 1 and pp_virtual_stages > 1 and micro % pp:
        return [f"parallel.pp_virtual_stages: interleaved schedules need micro-batches ({micro}) "
                f"divisible by pp={pp}"]
    return []
