"""Activation recompute (`parallel.recompute`): what the engine stores for backward, and why.

Levels (the planner charges exactly these; see memory_model.block_activation_bytes):
- none: every tensor autograd saves is kept until backward.
- selective: the attention core (`Attention.attention_fn`: scores, softmax and their product
  with V — torch's SDPA, or ring attention under context parallelism) runs under
  `torch.utils.checkpoint`; it keeps only its inputs q, k, v (saved by the projections and
  rotary anyway) and reruns in backward. What it stops holding: the core's output and its
  float32 log-sum-exp (flash-style kernels), plus every per-hop block under ring attention.
  Recompute cost: the core's forward, 4*s*h FLOPs per token per layer.
- full: each transformer block runs under `torch.utils.checkpoint` and keeps only its inputs
  (the residual stream x, and the rotary cos/sin shared by all blocks); the whole block's
  forward reruns in its backward (2 * block params + 4*s*h FLOPs per token per layer).

Both are applied by replacing an instance attribute (the block's `forward`, the attention's
`attention_fn`), never by wrapping modules: parameter names stay exactly those of the plain
model, so checkpoints and the init-by-name are identical whatever the level. `parallelize`
applies recompute after TP, CP and EP and before FSDP2, so checkpointing runs inside the FSDP
unit (the unit's hooks gather the block's weights once; the recompute reuses them).

Which level runs: the controller's plan chooses and prints one (`auto`: the planner's rule,
with the planner's memory per GPU) and hands the ranks that level, never `auto`; the engine
runs it as handed. Since the plan may assume other GPUs than those the ranks find (80 GiB when
it is not told), each rank also resolves `auto` with its own memory and, where that would choose
another level, warns naming both, without switching. Only a path with no plan (`python -m
tenax.workers.launch`) hands the engine `auto`, resolved by the same rule (`resolve_recompute`)
with this rank's memory: the GPU's own, a CPU slot's share of the host's RAM, or for any other
device the planner's assumption.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tenax.parallel.config import ModelArgs
from tenax.parallel.errors import PlanError
from tenax.parallel.layout import ParallelLayout
from tenax.parallel.model import Attention

logger = logging.getLogger(__name__)

LEVELS = ("none", "selective", "full")
CHOICES = ("auto",) + LEVELS
MARK = "tenax_recompute"  # set on a wrapped callable so a level is never applied twice


def _checkpointed(fn: Callable[..., Any]) -> Callable[..., Any]:
    # Generic arguments: attention cores may take more than q, k, v (an attention mask).
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)

    setattr(run, MARK, True)
    return run


def _blocks(part: nn.Module) -> list[nn.Module]:
    layers = getattr(part, "layers", None)
    return list(layers.values()) if layers is not None else []


def apply_recompute(part: nn.Module, level: str) -> int:
    """Apply `level` to a model or pipeline stage in place; returns how many callables were
    wrapped (blocks for full, attention cores for selective)."""
    if level not in LEVELS:
        raise ValueError(f"parallel.recompute: {level!r} must be one of {CHOICES} "
                         f"(resolve 'auto' first)")
    wrapped = 0
    if level == "full":
        for block in _blocks(part):
            if not getattr(block.forward, MARK, False):
                block.forward = _checkpointed(block.forward)
                wrapped += 1
    elif level == "selective":
        for module in part.modules():
            if isinstance(module, Attention) and not getattr(module.attention_fn, MARK, False):
                module.attention_fn = _checkpointed(module.attention_fn)
                wrapped += 1
    logger.debug("recompute=%s: %d callables checkpointed", level, wrapped)
    return wrapped


# ---- what a forward saves for backward -------------------------------------------------------
class SavedTensorMeter:
    """Unique storage bytes autograd saves for backward during a forward (parameters excluded).

    `with SavedTensorMeter(model.parameters()) as meter: loss = f(x)` then `meter.nbytes`.
    Views count once per storage; under checkpointing only what the checkpoint keeps is seen
    (the recomputed tensors are saved later, inside backward)."""

    def __init__(self, params: Iterable[torch.Tensor] = ()) -> None:
        self.exclude = {_storage_key(_plain(p)) for p in params}
        self.storages: dict[tuple[int, str], int] = {}
        self._hooks: Any = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        plain = _plain(t)
        key = _storage_key(plain)
        if key not in self.exclude and plain.device.type != "meta":
            self.storages[key] = plain.untyped_storage().nbytes()
        return t

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns the memory: a DTensor's local shard, a pending collective's buffer."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.elem if isinstance(t, AsyncCollectiveTensor) else t


def _storage_key(t: torch.Tensor) -> tuple[int, str]:
    return t.untyped_storage().data_ptr(), str(t.device)


# ---- auto ------------------------------------------------------------------------------------
def device_mem_gib(device: torch.device, ranks_per_node: int) -> float:
    """Memory one rank may plan with: the GPU's own, a CPU slot's share of the host's RAM, or
    where neither is known the planner's assumption (`hardware.slot_memory_gib`)."""
    from tenax.parallel.hardware import slot_memory_gib

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2 ** 30
    return slot_memory_gib(device.type, ranks_per_node)


def resolve_recompute(requested: str, model: ModelArgs, layout: ParallelLayout,
                      global_batch_size: int, dtype: str, mem_gib: float) -> tuple[str, str]:
    """(level, why) for `parallel.recompute`: a level the user named is kept; `auto` takes the
    planner's rule for this layout (`planner.estimate_layout`): the lightest level whose
    estimated memory fits `mem_gib` per rank, full when none does."""
    from tenax.parallel.planner import Cluster, PlanOptions, estimate_layout, precision

    if requested not in CHOICES:
        raise ValueError(f"parallel.recompute: {requested!r} must be one of {CHOICES}")
    if requested != "auto":
        return requested, "set by parallel.recompute"
    world = layout.world_size
    est = estimate_layout(model, layout, Cluster(world, world, mem_gib), PlanOptions(
        global_batch_size, model.seq_len, **precision(dtype)))
    gib = 2 ** 30
    verdict = ("fits" if est.recompute == "none" else "the lightest level that fits"
               ) if est.fits else "nothing fits; full needs the least"
    why = (f"auto: the planner's estimate for {layout.describe()}: {est.memory.total / gib:.3g} "
           f"of {est.budget_bytes / gib:.3g} GiB per rank ({verdict})")
    return est.recompute, why


def engine_recompute(requested: str, model: ModelArgs, layout: ParallelLayout,
                     global_batch_size: int, dtype: str, device: torch.device,
                     ranks_per_node: int) -> str:
    """The level a rank trains with, logged. A named level (the one the controller's plan chose,
    or the spec's) is kept; when this rank's own `auto` estimate with its real memory would
    choose another, a warning names both. `auto` (no plan) resolves with this rank's memory."""
    if requested not in CHOICES:
        raise ValueError(f"parallel.recompute: {requested!r} must be one of {CHOICES}")
    mem = device_mem_gib(device, env_ranks_per_node(ranks_per_node))
    try:
        own, why = resolve_recompute("auto", model, layout, global_batch_size, dtype, mem)
    except PlanError as err:  # a named level runs anyway; only the comparison is lost
        if requested == "auto":
            raise
        logger.info("parallel.recompute=%s as handed (no estimate to compare: %s)", requested, err)
        return requested
    if requested == "auto":
        log = logger.warning if "nothing fits" in why else logger.info
        log("parallel.recompute=auto -> %s: %s", own, why)
        return own
    if own != requested:
        logger.warning("parallel.recompute=%s runs as handed (the plan's level, or the spec's); "
                       "this rank's own estimate with %.3g GiB would choose %s: %s",
                       requested, mem, own, why)
    else:
        logger.info("parallel.recompute=%s as handed; this rank's own estimate agrees: %s",
                    requested, why)
    return requested


def env_ranks_per_node(default: int) -> int:
    """Ranks sharing this node (LOCAL_WORLD_SIZE when a launcher set it)."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else default
