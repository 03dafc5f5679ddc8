"""The rank side of the preflight's links check: one probe process per rank slot times each
parallel dimension's collective in that dimension's process groups.

Why a probe of its own: the check must not depend on (or disturb) the training loop; it forms a
fresh world on the job's slots, runs every group of a dimension at once (as training does, so
groups share the links they would share), and leaves. The orchestrator side
(`tenax.orchestrator.preflight.links`) chooses the sizes and judges the figures. Torch is
imported inside the methods: importing this module costs nothing.
"""
from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

logger = logging.getLogger(__name__)

KINDS = ("all_reduce", "all_to_all", "ring")  # ring: send/recv to the next rank of the group


@dataclass(frozen=True)
class LinkTask:
    """One dimension's check: its groups (global ranks), the collective and its size."""
    dim: str
    kind: str
    groups: tuple[tuple[int, ...], ...]
    nbytes: int  # the message of one collective (per rank)
    repeats: int = 5

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind: {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.nbytes < 4:
            raise ValueError(f"nbytes: must be at least 4, got {self.nbytes}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class LinkProbe:
    """Ray actor body, one per rank slot: `info()`, then `run(...)` on every probe at once."""

    def info(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(),
                "pid": os.getpid()}

    def free_port(self) -> int:
        from tenax.workers.rendezvous import free_port

        return free_port("0.0.0.0")

    def run(self, rank: int, world: int, addr: str, port: int, tasks: list[dict[str, Any]],
            timeout_s: float, slow_factor: float = 1.0, device: str = "auto") -> dict[str, Any]:
        """{"cuda": bool, "seconds": {dim: seconds of one collective as this rank saw it
        (median of the repeats)}}; `device` is the spec's auto | cpu | cuda.

        `slow_factor` > 1 is a drill (chaos `slow` aimed at this rank): each collective is
        held F times as long, as the drill holds each training step."""
        import torch
        import torch.distributed as dist

        from tenax.workers.rendezvous import join_process_group

        cuda = device != "cpu" and torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(0)  # Ray shows each probe its one GPU
        join_process_group(rank, world, addr, port, timeout_s, "nccl" if cuda else "gloo")
        try:
            seconds = {t["dim"]: self._time_task(LinkTask(**_tuple_groups(t)), rank,
                                                 slow_factor, cuda) for t in tasks}
        finally:
            dist.barrier()
            dist.destroy_process_group()
        return {"cuda": cuda, "seconds": seconds}

    def _time_task(self, task: LinkTask, rank: int, slow_factor: float, cuda: bool) -> float:
        import torch
        import torch.distributed as dist

        # every rank creates every group, in the same order (new_group is collective)
        groups = [(g, dist.new_group(list(g))) for g in task.groups]
        mine = [(g, pg) for g, pg in groups if rank in g]
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else None
        times: list[float] = []
        for i in range(task.repeats + 1):  # the first is a warm-up (connections, buffers)
            dist.barrier()
            t0 = time.perf_counter()
            if mine:
                _collective(task, mine[0][0], mine[0][1], rank, device)
                if cuda:
                    torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            if slow_factor > 1.0:
                time.sleep((slow_factor - 1.0) * elapsed)
                elapsed *= slow_factor
            if i:
                times.append(elapsed)
        return statistics.median(times)


def _tuple_groups(task: dict[str, Any]) -> dict[str, Any]:
    """Groups cross Ray as lists; the dataclass holds tuples."""
    return {**task, "groups": tuple(tuple(g) for g in task["groups"])}


def _collective(task: LinkTask, group: tuple[int, ...], pg: Any, rank: int,
                device: Any) -> None:
    import torch
    import torch.distributed as dist

    n = len(group)
    elems = max(n, task.nbytes // 4 // n * n)  # all_to_all splits evenly
    buf = torch.ones(elems, dtype=torch.float32, device=device)
    if task.kind == "all_reduce":
        dist.all_reduce(buf, group=pg)
    elif task.kind == "all_to_all":
        out = torch.empty_like(buf)
        dist.all_to_all_single(out, buf, group=pg)
    else:
        pos = group.index(rank)
        nxt, prev = group[(pos + 1) % n], group[(pos - 1) % n]
        out = torch.empty_like(buf)
        ops = [dist.P2POp(dist.isend, buf, nxt, group=pg),
               dist.P2POp(dist.irecv, out, prev, group=pg)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
