"""Layout-free training state: what a checkpoint holds, and how it lands in any other layout.

A checkpoint must load into whatever layout the surviving GPUs allow, so nothing in it may be
specific to the layout that wrote it:

- model: every parameter under its canonical name (pipeline stages keep their layers' names),
  as the DTensor or plain tensor the rank holds; DCP records global shapes and shard offsets
  and reshards on load — TP, FSDP2, EP, PP and any mix.
- optimizer: AdamW's moments in each parameter's *own* shape and placement, keyed
  `optim.<name>.<state>`. ZeRO-1/2 keep moments as flat 1/N chunks, so they are all-gathered
  into parameter shape on save and sliced back to this rank's chunk on load.
- step, data cursor and LR position are plain numbers and travel in the manifest.

Since data order is a function of (seed, global sample index) and init of (seed, name), these
are all the state there is: a run resumed in another layout continues exactly.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from tenax.checkpoint.collectives import max_across_ranks
from tenax.parallel import DataParallel, canonical_param_name, local


class TrainerLike(Protocol):
    """What resharding reads of a `tenax.workers.trainer.Trainer`; a protocol, because checkpoint/
    sits below workers/ and must not import it (imports point one way)."""
    pm: Any  # tenax.parallel.parallel_model.ParallelModel: named_parameters(), dps
    optimizer: torch.optim.Optimizer

logger = logging.getLogger(__name__)

MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's per-element state; SGD (no momentum) has none


def model_state(trainer: TrainerLike) -> dict[str, torch.Tensor]:
    """Canonical name -> the parameter itself (DCP saves from it and loads into it in place)."""
    return {canonical_param_name(n): p for n, p in trainer.pm.named_parameters()}


def _dp_of(trainer: TrainerLike) -> dict[nn.Parameter, DataParallel]:
    return {p: dp for dp in trainer.pm.dps for p in dp.params}


def _has_moments(trainer: TrainerLike) -> bool:
    return isinstance(trainer.optimizer, torch.optim.AdamW)


@dataclass(frozen=True)
class ParamState:
    """One parameter as every reader of the optimizer state sees it."""
    name: str  # the engine's name
    key: str  # `optim.<canonical name>`: the prefix of its moments' checkpoint keys
    param: nn.Parameter
    dp: DataParallel | None  # the ZeRO-1/2 owner that keeps its moments as flat chunks
    state: dict[str, torch.Tensor]  # the optimizer's state for it; {} where this rank has none


def param_states(trainer: TrainerLike) -> Iterator[ParamState]:
    """Every parameter, its ZeRO-1/2 owner and the optimizer state this rank holds for it: the
    one walk that saving, snapshot planning and loading share, so they cannot disagree on
    which tensor holds a parameter's moments."""
    owners = _dp_of(trainer) if trainer.layout.zero in (1, 2) else {}
    for name, p in trainer.pm.named_parameters():
        dp = owners.get(p)
        holder = dp.shard_of(p) if dp is not None else p
        state = trainer.optimizer.state.get(holder, {}) if holder is not None else {}
        yield ParamState(name, f"optim.{canonical_param_name(name)}", p, dp, state)


def local_step(states: list[ParamState], on_host: bool = True) -> torch.Tensor:
    """This rank's optimizer step count: the last parameter's that has one (0 if none), a
    copy of its own; the callers take the largest over ranks (`agree_on_step`). With
    `on_host` False a device optimizer's count stays on its device (reading it would make the
    host wait for the optimizer step that counts it)."""
    step = next((s.state["step"] for s in reversed(states) if "step" in s.state), None)
    if step is None:
        return torch.zeros((), dtype=torch.float32)
    step = step.detach().float()
    return (step.cpu() if on_host else step).clone()


def optimizer_state(trainer: TrainerLike, for_load: bool = False) -> dict[str, torch.Tensor]:
    """`optim.<name>.<moment>` tensors in parameter shape, plus `optim.step`.

    With `for_load`, every moment is a zero tensor to load into: the load overwrites every
    element, so ZeRO-1/2 moments are not gathered (that was ~300 all-gathers, 0.18 s of each
    restart's load on 2 ranks). Otherwise collective for ZeRO-1/2 (an all-gather per
    parameter and moment): every rank must call it.
    """
    if not _has_moments(trainer):
        return {}
    out: dict[str, torch.Tensor] = {}
    states = list(param_states(trainer))
    for s in states:
        for moment in MOMENTS:
            value, key = s.state.get(moment), f"{s.key}.{moment}"
            if s.dp is not None and for_load:  # DCP overwrites every element: nothing to gather
                out[key] = _as_param_shaped(s.param, torch.zeros_like(local(s.param)))
            elif s.dp is not None:
                out[key] = _as_param_shaped(s.param, s.dp.gather_full(s.param, value))
            elif value is not None:
                out[key] = value
            elif for_load:
                out[key] = torch.zeros_like(s.param)
    out["optim.step"] = agree_on_step(local_step(states))
    return out


def agree_on_step(step: torch.Tensor) -> torch.Tensor:
    # A ZeRO rank whose chunks are all empty has no optimizer state of its own; the step
    # count is global, so every rank takes the largest.
    # max_across_ranks puts the value where the backend takes it (nccl takes no CPU tensor)
    step.fill_(max_across_ranks(int(step.item())))
    return step


def _as_param_shaped(p: nn.Parameter, full_local: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        return DTensor.from_local(full_local, p.device_mesh, p.placements, run_check=False)
    return full_local


def apply_optimizer_state(trainer: TrainerLike, loaded: dict[str, torch.Tensor]) -> None:
    """Install moments loaded (in parameter shape) into the optimizer of this layout."""
    if not _has_moments(trainer):
        return
    owners = _dp_of(trainer)
    step = loaded["optim.step"].detach().float().cpu().reshape(())
    for name, p in trainer.pm.named_parameters():
        key = f"optim.{canonical_param_name(name)}"
        dp = owners.get(p) if trainer.layout.zero in (1, 2) else None
        if dp is None:
            state = {m: loaded[f"{key}.{m}"] for m in MOMENTS}
            trainer.optimizer.state[p] = {"step": step_for(trainer.optimizer, step, p), **state}
            continue
        shard = dp.shard_of(p)
        if shard is not None:
            trainer.optimizer.state[shard] = {"step": step_for(trainer.optimizer, step, shard), **{
                m: dp.chunk_view(p, local(loaded[f"{key}.{m}"])).clone() for m in MOMENTS}}


def step_for(optimizer: torch.optim.Optimizer, step: torch.Tensor,
             param: torch.Tensor) -> torch.Tensor:
    """The step count as `optimizer` keeps it for `param`: on the parameter's device for a
    fused or capturable AdamW (its kernels read it there), else a host scalar (the others
    refuse a device one)."""
    on_device = optimizer.defaults.get("fused") or optimizer.defaults.get("capturable")
    return step.clone().to(param.device) if on_device else step.clone()


def training_state(trainer: TrainerLike, for_load: bool = False) -> dict[str, torch.Tensor]:
    """Everything DCP saves or loads for one rank: model + optimizer, layout-free keys."""
    return {**{f"model.{k}": v for k, v in model_state(trainer).items()},
            **optimizer_state(trainer, for_load)}


def apply_training_state(trainer: TrainerLike, loaded: dict[str, torch.Tensor]) -> None:
    """After DCP loaded into `training_state(trainer, for_load=True)`: finish the install.

    Parameters were loaded in place already; optimizer moments need installing (and slicing to
    this rank's chunk under ZeRO-1/2).
    """
    apply_optimizer_state(trainer, {k: v for k, v in loaded.items() if k.startswith("optim.")})
    logger.debug("installed training state: %d tensors", len(loaded))
