"""Tiny agreements among a job's ranks: one small all-reduce each, and alone without a group.

Every rank takes the same branch after one of these (save, skip, load which step), so no rank
waits in a collective the others never enter.
"""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist


def dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _collective_device() -> torch.device:
    """Where a tiny collective's tensor must live: the current GPU under nccl, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_taking_max_step(flags: list[bool], step: torch.Tensor) -> list[bool]:
    """For each flag, whether every rank passed True; `step` becomes the largest any rank
    holds. One tiny all-reduce for all of them (on the collective's device: nccl takes no CPU
    tensor); alone without a group. Why one: each all-reduce at a step boundary waits for the
    slowest rank and costs ~0.5 ms of the training thread on a loaded host."""
    if not dist_on():
        return list(flags)
    values = [0 if ok else 1 for ok in flags] + [int(step.item())]
    t = torch.tensor(values, dtype=torch.int64, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    *worst, largest = (int(v) for v in t.tolist())
    step.fill_(largest)
    return [w == 0 for w in worst]


def max_across_ranks(value: int) -> int:
    """The largest `value` any rank passed (one tiny all-reduce; `value` alone without a group)."""
    if not dist_on():
        return value
    device = _collective_device()
    flag = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def same_round(ok: bool, token: int) -> bool:
    """True only if every rank says ok and passed the same `token` (one tiny all-reduce): every
    rank's cached part then comes from one global plan, even where some were handed over from
    a previous process (a rank's part of another round would write or skip the wrong chunks)."""
    if not dist_on():
        return ok
    device = _collective_device()
    flags = torch.tensor([0 if ok else 1, token, -token], dtype=torch.int64, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    worst, high, low = (int(v) for v in flags.tolist())
    return worst == 0 and high == -low != 0


def all_ranks_agree(ok: bool) -> bool:
    """True only if every rank says ok (one tiny all-reduce; `ok` alone without a group)."""
    if not dist_on():
        return ok
    device = _collective_device()
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """DCP warns on every call without a process group; world-1 providers use none on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*unavailable")
        yield
