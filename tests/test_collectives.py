"""The checkpoint layer's tiny agreements, over the default group and over a registered CPU
control group (what a rank of an nccl job registers, so the flags never wait on the device)."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tests.distributed import free_port, run_ranks


def agreements(rank: int) -> dict[str, Any]:
    """Every agreement with rank-dependent inputs (rank 1 disagrees and holds the larger step)."""
    from tenax.checkpoint.collectives import (agree_taking_max_step, all_ranks_agree,
                                              max_across_ranks, same_round)

    step = torch.tensor(3.0 + 4 * rank)  # a copy of its own, as a fingerprint's count is
    flags = agree_taking_max_step([True, rank == 0], step)
    # rank 0 is not ready and takes no part in the step (it never reads its count)
    other = None if rank == 0 else torch.tensor(5.0)
    not_ready = agree_taking_max_step([rank == 1], other)
    return {"flags": flags, "step": float(step), "not_ready": not_ready,
            "other": None if other is None else float(other),
            "max": max_across_ranks(10 * rank + 1),
            "agree_all": all_ranks_agree(True), "agree_one": all_ranks_agree(rank == 0),
            "round_same": same_round(True, 7), "round_differs": same_round(True, 7 + rank)}


def counted(twin: Any, rank: int) -> tuple[dict[str, Any], list[str]]:
    """The agreements, and which group each of their all-reduces went to."""
    calls: list[str] = []
    real = dist.all_reduce

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append("twin" if kwargs.get("group") is twin else "default")
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        return agreements(rank), calls
    finally:
        dist.all_reduce = real


def with_control_group(rank: int, world: int) -> dict[str, Any]:
    """The agreements over the default group, then over a registered twin, then after the
    default group was replaced (the twin of the destroyed one must not be used)."""
    from tenax.checkpoint.collectives import use_control_group
    from tenax.workers.rendezvous import join_process_group

    plain = agreements(rank)
    twin = dist.new_group(backend="gloo")
    use_control_group(twin)
    routed, calls = counted(twin, rank)
    port = agreed_port(rank)
    dist.destroy_process_group()  # as a link probe leaves: the twin stays registered
    join_process_group(rank, world, "127.0.0.1", port, 60.0)
    rejoined, calls_after = counted(twin, rank)
    return {"plain": plain, "routed": routed, "calls": calls, "rejoined": rejoined,
            "calls_after": calls_after}


def agreed_port(rank: int) -> int:
    """A port every rank agrees on for the second group (rank 0's pick, broadcast)."""
    pick = torch.tensor([free_port() if rank == 0 else 0])
    dist.broadcast(pick, src=0)
    return int(pick)


def test_agreements_over_a_control_group_match_the_default_groups() -> None:
    out = run_ranks(with_control_group, 2, timeout_s=120)
    want = {"flags": [True, False], "step": 7.0, "not_ready": [False], "max": 11,
            "agree_all": True, "agree_one": False, "round_same": True, "round_differs": False}
    for rank in (0, 1):
        mine = {**want, "other": None if rank == 0 else 5.0}
        assert out[rank]["plain"] == mine, out[rank]["plain"]
        assert out[rank]["routed"] == mine, out[rank]["routed"]
        assert out[rank]["rejoined"] == mine, out[rank]["rejoined"]
    # Flags over the twin; the step count over the default group, where a device keeps it
    assert out[0]["calls"].count("default") == 2, out[0]["calls"]
    assert out[0]["calls"].count("twin") == 7, out[0]["calls"]
    # without a twin (or with a stale one) flags and step go in one all-reduce
    assert out[0]["calls_after"] == ["default"] * 7, out[0]["calls_after"]
