"""Launch a job on local gloo ranks without Ray, for tests and debugging.

    python -m tenax.workers.launch JOB.yaml --nproc 4 [--set KEY=VALUE ...] [--log-json PATH]

`run_rank` is the per-rank entry point that `tenax run` reuses inside its Ray workers: join a
process group, build the trainer for the layout, run steps, report each one. The launcher here
only spawns processes on 127.0.0.1 and fails fast: when any rank dies, the others are killed at
once instead of waiting out a collective timeout.
"""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Any, Callable

from tenax.workers.memory_options import MemoryOptions, begin_rank, snapshotter

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_FACTOR = 2.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


STORE_POLL_S = 0.005
# glibc malloc, per training process: freed heap up to this much stays with the process, and
# blocks below MMAP_BYTES come from the heap rather than fresh mappings. By default a step's
# freed activations went back to the kernel and the next step faulted them in again: 100 to
# 6,000 page faults per rank per step here (3-5% of a step's CPU), most with snapshots on.
MALLOC_TRIM_BYTES = 256 << 20
MALLOC_MMAP_BYTES = 64 << 20
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt(3) parameters
MALLOC_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")  # a user's own choice wins


def keep_freed_heap() -> bool:
    """Tune glibc malloc as above; False where there is no glibc or the user tuned it."""
    import ctypes

    own = [n for n in MALLOC_ENV if n in os.environ]
    if own or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        logger.info("malloc left as the environment sets it (%s)", ", ".join(own) or
                    "GLIBC_TUNABLES")
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_TRIM_THRESHOLD, MALLOC_TRIM_BYTES) == 1 and \
        mallopt(M_MMAP_THRESHOLD, MALLOC_MMAP_BYTES) == 1
    logger.info("malloc keeps up to %d MiB of freed heap (no page faults to refill it every "
                "step): %s", MALLOC_TRIM_BYTES >> 20, "set" if ok else "refused by mallopt")
    return ok


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

    if addr in ("127.0.0.1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if rank != 0 and not wait_for_store(addr, port, timeout_s):
        logger.warning("rank %d: the rendezvous store %s:%d did not open in %.0fs; joining "
                       "anyway (torch reports why)", rank, addr, port, timeout_s)
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))


def leave_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()  # without it ranks may abort at exit after DTensor collectives
        dist.destroy_process_group()
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


def run_rank(spec_dict: dict[str, Any], layout_dict: dict[str, Any], rank: int, world: int,
             addr: str, port: int, on_step: Callable[[dict[str, Any]], None] | None = None,
             steps: int | None = None, on_event: Callable[[dict[str, Any]], None] | None = None,
             should_stop: Callable[[], bool] | None = None, resume: bool = True,
             storage_options: dict[str, Any] | None = None,
             slow_factor: Callable[[], float] | None = None,
             memory: MemoryOptions | None = None) -> dict[str, Any]:
    """Train this rank until step `steps` (default train.steps); returns the last record.

    Resumes from the newest committed checkpoint (resharded into this layout), saves every
    checkpoint.every_steps and at the last step, and waits for the last save before returning.
    Records: "started" (with the step it resumed at), "step", and checkpoint events, which go
    to `on_event` (default `on_step`). `should_stop` is polled at every step boundary; when any
    rank says stop, all save at that boundary and return {"event": "stopped", ...}.
    `memory` (from the rank's agent): where per-step in-memory snapshots go, and an assembled
    snapshot to resume from instead of storage (checkpoint/memory/snapshot.py, restore.py).
    """
    import torch

    from tenax.parallel.layout import ParallelLayout
    from tenax.workers.spec import spec_from_dict

    torch.set_num_threads(1)
    keep_freed_heap()
    spec = spec_from_dict(spec_dict)
    layout = ParallelLayout.from_dict(layout_dict)
    # The collective timeout is only a backstop: the controller's hang detection
    # (hang_timeout_s) must fire first so the cause it reports is the hung rank, not a peer's
    # collective timing out.
    backend = "nccl" if torch.cuda.is_available() and spec.resources.device != "cpu" else "gloo"
    join_process_group(rank, world, addr, port,
                       COLLECTIVE_TIMEOUT_FACTOR * spec.fault_tolerance.hang_timeout_s, backend)
    try:
        return _train(spec, layout, rank, world, on_step, on_event or on_step, steps,
                      should_stop, resume, storage_options, slow_factor, memory)
    finally:
        leave_process_group()


def _train(spec: Any, layout: Any, rank: int, world: int, on_step: Callable | None,
           emit: Callable | None, steps: int | None, should_stop: Callable[[], bool] | None,
           resume: bool, storage_options: dict[str, Any] | None,
           slow_factor: Callable[[], float] | None = None,
           memory: MemoryOptions | None = None) -> dict[str, Any]:
    from tenax.checkpoint.manager import CheckpointManager
    from tenax.workers.events import stamp
    from tenax.workers.trainer import Trainer

    # A resuming rank loads every weight: initialising them first would be wasted (~45 ms).
    trainer = Trainer(spec, layout, initialise=not resume)
    base = {"rank": rank, "world_size": world, "layout": layout.degrees()}

    def report(events: list[dict[str, Any]]) -> None:
        for event in events:
            if emit is not None:
                emit(stamp({**event, "rank": rank}))

    with CheckpointManager(spec, trainer, rank, world, storage_options=storage_options) as mgr:
        resumed, source = begin_rank(mgr, trainer, memory, resume, rank, world)
        report(mgr.drain_events())
        snaps = snapshotter(spec, mgr, rank, world, memory)
        if on_step is not None:
            on_step(stamp({"event": "started", "step": trainer.step, "resumed_from": resumed,
                           "source": source, **base}))
        record: dict[str, Any] = {"event": "step", "step": trainer.step, "loss": None, **base}
        target, every = steps or spec.train.steps, spec.checkpoint.every_steps
        try:
            while trainer.step < target:
                if should_stop is not None and _any_rank_says(should_stop()):
                    return _stop_at_boundary(mgr, trainer.step, report, base)
                if slow_factor is not None:  # chaos `slow`: this rank computes F times slower
                    trainer.slow_factor = slow_factor()
                record = _step_record(trainer.run_step(), base)
                if on_step is not None:
                    on_step(record)
                if trainer.step % every == 0 or trainer.step == target:
                    mgr.save(trainer.step)
                if snaps is not None and snaps.due(trainer.step) and trainer.step < target:
                    snaps.snapshot(trainer.step)
                report(mgr.drain_events())
        finally:
            if snaps is not None:
                snaps.close()
        mgr.close()
        report(mgr.drain_events())
    return record


def _stop_at_boundary(mgr: Any, step: int, report: Callable[[list[dict[str, Any]]], None],
                      base: dict[str, Any]) -> dict[str, Any]:
    """A planned stop: every rank saves this step (skipped when it is saved or resumed from)."""
    mgr.save(step)
    mgr.close()  # waits; a failed or timed-out save becomes an event, not an error
    report(mgr.drain_events())
    return {"event": "stopped", "step": step, **base}


def _step_record(result: Any, base: dict[str, Any]) -> dict[str, Any]:
    return {"event": "step", "step": result.step, "loss": result.loss,
            "tokens_per_s": result.tokens_per_s, **base,
            "rank_tokens_per_s": result.rank_tokens_per_s, "grad_norm": result.grad_norm,
            "lr": result.lr, "step_s": result.step_s, "time": round(time.time(), 6),
            "cpu_time": round(time.process_time(), 6)}  # this rank's CPU seconds so far


def _any_rank_says(flag: bool) -> bool:
    """One-element all-reduce so every rank stops at the same step boundary."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _rank_process(spec_dict: dict, layout_dict: dict, rank: int, world: int, port: int,
                  queue: Any) -> None:
    def report(record: dict[str, Any]) -> None:
        if rank == 0:
            queue.put(record)

    try:
        run_rank(spec_dict, layout_dict, rank, world, "127.0.0.1", port, report)
        queue.put({"event": "rank_done", "rank": rank})
    except BaseException as err:  # report every failure with its cause, DCP errors included
        queue.put({"event": "failure", "rank": rank, "cause": f"{type(err).__name__}: {err}"})
        raise


def launch(spec_dict: dict[str, Any], layout_dict: dict[str, Any], nproc: int,
           on_event: Callable[[dict[str, Any]], None], timeout_s: float,
           context: Any = None) -> bool:
    """Spawn `nproc` ranks; True when every rank finished. Kills all ranks on the first failure.
    `context`: the multiprocessing context to start them from (default: spawn)."""
    ctx = context or mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_process, args=(spec_dict, layout_dict, r, nproc, port, queue))
             for r in range(nproc)]
    for p in procs:
        p.start()
    done, ok, deadline = 0, True, time.monotonic() + timeout_s
    try:
        while done < nproc:
            event = _next_event(queue, procs, deadline)
            if event["event"] == "rank_done":
                done += 1
                continue
            on_event(event)
            if event["event"] == "failure":
                ok = False
                break
    finally:
        for p in procs:
            p.join(timeout=5 if ok else 0.1)
            if p.is_alive():
                p.kill()
    return ok


def _next_event(queue: Any, procs: list, deadline: float) -> dict[str, Any]:
    import queue as queue_mod

    while True:
        try:
            return queue.get(timeout=0.5)
        except queue_mod.Empty:
            pass
        dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if dead:
            return {"event": "failure", "rank": dead[0],
                    "cause": f"process exited with code {procs[dead[0]].exitcode}"}
        if time.monotonic() > deadline:
            return {"event": "failure", "rank": -1, "cause": "launcher timeout"}


def main(argv: list[str] | None = None) -> int:
    from tenax.parallel.layout import LayoutError
    from tenax.workers.events import human
    from tenax.workers.spec import SpecError, layout_from_spec, load_spec

    parser = argparse.ArgumentParser(prog="python -m tenax.workers.launch", description=__doc__.split("\n")[0])
    parser.add_argument("spec", nargs="?", help="job spec (YAML/JSON); default: the embedded tiny job")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--log-json", help="write one JSON object per line to this path")
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        spec = load_spec(args.spec, args.overrides)
        layout = layout_from_spec(spec, args.nproc)
    except (SpecError, LayoutError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    sink = open(args.log_json, "a") if args.log_json else None

    def on_event(event: dict[str, Any]) -> None:
        print(human(event), flush=True)
        if sink:
            sink.write(json.dumps(event) + "\n")
            sink.flush()

    ok = launch(spec.to_dict(), layout.to_dict(), args.nproc, on_event, args.timeout_s)
    if sink:
        sink.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
