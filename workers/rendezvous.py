"""Joining and leaving a rank's process group (gloo on CPU, nccl on GPUs).

The rank loop (workers/rank.py) joins through rank 0's TCP store and leaves at its end; the
tests' and benchmarks' own rank processes use the same functions. Torch is imported inside the
functions: the agents import this layer without it.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from datetime import timedelta

logger = logging.getLogger(__name__)

STORE_POLL_S = 0.005


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_for_store(addr: str, port: int, timeout_s: float) -> bool:
    """Until rank 0's rendezvous store accepts connections (False after `timeout_s`).

    Why: a rank that reaches the store before rank 0 has opened it is retried by torch only
    after a back-off of about 0.3-0.5 s; restarted ranks are forked at the same moment, so
    that back-off was a fixed part of every recovery. Polling the port costs nothing."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((addr, port), timeout=min(1.0, timeout_s)):
                return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(STORE_POLL_S)


def join_process_group(rank: int, world: int, addr: str, port: int, timeout_s: float,
                       backend: str = "gloo") -> None:
    import torch.distributed as dist

    from tenax.checkpoint import use_control_group

    if addr in ("127.0.0.1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if rank != 0 and not wait_for_store(addr, port, timeout_s):
        logger.warning("rank %d: the rendezvous store %s:%d did not open in %.0fs; joining "
                       "anyway (torch reports why)", rank, addr, port, timeout_s)
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))
    if backend != "gloo":  # the checkpoint layer's per-step flags must not wait on the device
        try:
            use_control_group(dist.new_group(backend="gloo",
                                             timeout=timedelta(seconds=timeout_s)))
        except Exception as exc:  # an optimisation: the flags then go over the device group
            logger.warning("rank %d: no gloo group beside %s (%s: %s); the checkpoint layer's "
                           "agreements go over %s and wait for the device", rank, backend,
                           type(exc).__name__, exc, backend)


def leave_process_group(failed: bool = False) -> None:
    """Leave the group; `failed`: this rank raised, and its peers may be waiting in another
    collective, so no barrier (it would meet none of theirs and hold the error back until the
    collective timeout, reported as a hang instead of the error)."""
    import torch.distributed as dist

    from tenax.checkpoint import use_control_group

    if dist.is_initialized():
        if not failed:
            dist.barrier()  # without it ranks may abort at exit after DTensor collectives
        dist.destroy_process_group()
    use_control_group(None)
    forget_dtensor_caches()


def forget_dtensor_caches() -> None:
    """Drop DTensor's process-wide dispatch caches after a group is destroyed.

    They are keyed by DeviceMesh equality, which compares ranks and shape but not the process
    groups, so a group re-formed in the same process with the same rank layout would otherwise
    get a cached spec whose mesh points at the destroyed group.
    """
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _redistribute.clear_redistribute_planner_cache()
