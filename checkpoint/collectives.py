"""Tiny agreements among a job's ranks: one small all-reduce each, and alone without a group.

Every rank takes the same branch after one of these (save, skip, load which step), so no rank
waits in a collective the others never enter.

Under a device backend (nccl) a flag all-reduced on the device makes the host wait for every
kernel queued before it; at a step boundary that is the optimizer's, so the device idles while
the host prepares the next step, at every step a snapshot or a save is asked for. A rank that
joined such a group registers a CPU (gloo) twin of it (`use_control_group`), and the flags go
there; the step count of a device optimizer stays on the device (`agree_taking_max_step`).
"""
from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# The default group the registered twin serves, and the twin: a twin of a destroyed default
# group must never be used (an elastic restart joins a new one)
_control: dict[str, Any] = {}


def dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def use_control_group(group: Any) -> None:
    """Register `group` (gloo, over every rank of the current default group) for the
    agreements here; None forgets the registered one."""
    _control.clear()
    if group is not None:
        _control.update(world=dist.group.WORLD, group=group)
        logger.info("tiny agreements go over a CPU group: the default group's backend is %s",
                    dist.get_backend())


def _control_group() -> Any:
    """The registered twin of the current default group, else None (the default group)."""
    if _control and _control["world"] is dist.group.WORLD:
        return _control["group"]
    return None


def _collective_device() -> torch.device:
    """Where a tiny collective's tensor must live: the current GPU under nccl, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _flags_reduced(values: list[int], op: Any) -> list[int]:
    """`values` all-reduced with `op` over the control group (on the CPU) when one is
    registered, else over the default group on its device."""
    group = _control_group()
    device = torch.device("cpu") if group is not None else _collective_device()
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=op, group=group)
    return [int(v) for v in t.tolist()]


def agree_taking_max_step(flags: list[bool], step: torch.Tensor | None) -> list[bool]:
    """For each flag, whether every rank passed True; `step` (a float32 scalar of its own, on
    the host or the optimizer's device) becomes the largest any rank holds; None: this rank
    takes no part in the step (it passed a False flag). One tiny all-reduce for all of them;
    with a control group, the flags there and the step on the default group's device (queued
    behind the optimizer, never read by the host). Alone without a group. Why one: each
    all-reduce at a step boundary waits for the slowest rank and costs ~0.5 ms of the training
    thread on a loaded host."""
    if not dist_on():
        return list(flags)
    worst = [0 if ok else 1 for ok in flags]
    if _control_group() is None:
        count = 0 if step is None else int(step.item())
        *worst, largest = _flags_reduced(worst + [count], dist.ReduceOp.MAX)
        if step is not None:
            step.fill_(largest)
        return [w == 0 for w in worst]
    worst = _flags_reduced(worst, dist.ReduceOp.MAX)
    device = _collective_device()
    on_device = torch.zeros((), device=device) if step is None else step.to(device)
    dist.all_reduce(on_device, op=dist.ReduceOp.MAX)
    if step is not None and on_device is not step:  # no device count yet (before step 1)
        step.copy_(on_device)
    return [w == 0 for w in worst]


def max_across_ranks(value: int) -> int:
    """The largest `value` any rank passed (one tiny all-reduce; `value` alone without a group)."""
    if not dist_on():
        return value
    return _flags_reduced([value], dist.ReduceOp.MAX)[0]


def same_round(ok: bool, token: int) -> bool:
    """True only if every rank says ok and passed the same `token` (one tiny all-reduce): every
    rank's cached part then comes from one global plan, even where some were handed over from
    a previous process (a rank's part of another round would write or skip the wrong chunks)."""
    if not dist_on():
        return ok
    worst, high, low = _flags_reduced([0 if ok else 1, token, -token], dist.ReduceOp.MAX)
    return worst == 0 and high == -low != 0


def all_ranks_agree(ok: bool) -> bool:
    """True only if every rank says ok (one tiny all-reduce; `ok` alone without a group)."""
    if not dist_on():
        return ok
    return bool(_flags_reduced([1 if ok else 0], dist.ReduceOp.MIN)[0])


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """DCP warns on every call without a process group; world-1 providers use none on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*unavailable")
        yield
