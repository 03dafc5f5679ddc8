"""Checkpoint save/load benchmark: every writer side by side in one run, on 2 gloo ranks.

    python -m bench.checkpoint_bench [--quick] [--out PATH] [--reps N] [--writers a,b,...]

Why side by side: on a CPU-bound host the cost of a save is not its blocked time alone but the
training time it loses = blocked time + the extra time of the steps that run while the write is
in flight. Each writer ("sync", "thread" (the default), "fork" of CheckpointManager; two
ablations of "thread": staging on the training thread instead of behind the optimizer-step
fence, and without lowering the writer's priority; and DCP's own thread-based `async_save` for
reference, on a separate gloo group) saves the same dp2 ZeRO-1 state in the same processes,
right after the same steady-state measurement, so the ratios are comparable. Loads compare the
same layout with resharding into tp2 and into dp2 ZeRO-3.

Goals: async blocked ÷ sync blocked ≤ 0.05; step time while writing ÷ steady ≤ 1.10;
reshard-load ÷ same-layout load ≤ 1.5.
"""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from tenax.testing.scripts import exit_unless_run_as_module

exit_unless_run_as_module(__spec__, __file__)  # a path run stops here, before `bench.`

logger = logging.getLogger(__name__)

FULL = {"model.dim": 512, "model.n_layers": 6, "model.ffn_hidden": 1376,
        "model.vocab_size": 8192}
QUICK = {"model.dim": 256, "model.n_layers": 4, "model.ffn_hidden": 688,
         "model.vocab_size": 4096}
COMMON = {"model.n_heads": 8, "model.n_kv_heads": 4, "model.seq_len": 64,
          "train.global_batch_size": 4, "train.warmup_steps": 0, "train.steps": 1000,
          "parallel.micro_batch_size": 1, "checkpoint.keep_last": 2}
WRITERS = ("sync", "thread", "thread-stage-blocking", "thread-nice0", "fork", "dcp-thread")
DEFAULT_ASYNC = "thread"  # what CheckpointManager uses for checkpoint.async: true
MAX_STEPS_DURING = 40  # a write still in flight after this many steps is reported as such


def _spec(quick: bool, uri: str):
    from tenax.orchestrator.spec import load_spec

    dims = {**(QUICK if quick else FULL), **COMMON, "checkpoint.uri": uri}
    return load_spec(overrides=[f"{k}={v}" for k, v in dims.items()])


def _timed_step(trainer: Any) -> float:
    t0 = time.perf_counter()
    trainer.run_step()
    return time.perf_counter() - t0


def _any_rank(flag: bool) -> bool:
    import torch
    import torch.distributed as dist

    t = torch.tensor([1 if flag else 0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _max_over_ranks(value: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


class _NoFence:
    """A state provider without `fence_before_update`: the manager stages while blocking."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "fence_before_update":
            raise AttributeError(name)
        return getattr(self._inner, name)


class _DcpThread:
    """DCP's async_save (thread executor) behind the manager's save/in_flight interface."""

    def __init__(self, trainer: Any, root: str) -> None:
        import torch.distributed as dist

        self.trainer, self.root, self.future = trainer, root, None
        # its background collectives must not interleave with training's on the same group
        self.group = dist.new_group(backend="gloo")

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        from tenax.checkpoint.load.reshard import training_state

        self.future = dcp.async_save(training_state(self.trainer),
                                     checkpoint_id=f"{self.root}/dcp-{step}",
                                     process_group=self.group)

    def in_flight(self) -> bool:
        return self.future is not None and not self.future.done()

    def close(self) -> None:
        if self.future is not None:
            self.future.result(timeout=600)


def _measure_save(trainer: Any, saver: Any) -> dict[str, Any]:
    """One save: blocked time, then steps until the write is done, against a fresh baseline.

    The baseline is the median of steps taken right before the save, so load from other
    processes on a shared host hits the baseline and the steps during the write alike.
    """
    steady = statistics.median(_max_over_ranks(_timed_step(trainer)) for _ in range(3))
    t0 = time.perf_counter()
    saver.save(trainer.step)
    blocked = _max_over_ranks(time.perf_counter() - t0)
    t_write = time.perf_counter()
    during: list[float] = []
    while _any_rank(saver.in_flight()) and len(during) < MAX_STEPS_DURING:
        during.append(_max_over_ranks(_timed_step(trainer)))
    while _any_rank(saver.in_flight()):
        time.sleep(0.01)  # only when the cap was hit; training is not measured meanwhile
    call_s = blocked
    if hasattr(saver, "drain_events"):  # the committed event's blocked_s (max over ranks)
        # also counts a wait at the next optimizer step for the copy (the fence)
        events = [e for e in saver.drain_events() if e["event"] == "checkpoint"]
        blocked = max(blocked, _max_over_ranks(events[-1]["blocked_s"] if events else 0.0))
    mean = statistics.mean(during) if during else steady
    return {"blocked_s": blocked, "save_call_s": call_s, "steps_during": len(during),
            "steady_step_s": steady,
            "during_step_s": mean, "slowdown": mean / steady,
            "lost_s": call_s + max(sum(d - steady for d in during), 0.0),
            "write_s": time.perf_counter() - t_write}


def _make_saver(trainer: Any, spec: Any, rank: int, world: int, writer: str, root: str) -> Any:
    from tenax.checkpoint.manager import CheckpointManager
    from tenax.workers.checkpoint_config import checkpoint_config

    if writer == "dcp-thread":
        return _DcpThread(trainer, root)
    saver = CheckpointManager(checkpoint_config(spec), trainer, rank, world,
                              writer=writer.split("-")[0], timeout_s=600)
    if writer == "thread-stage-blocking":  # ablation: copy on the training thread, no fence
        saver.state = _NoFence(saver.state)
    return saver


def _save_once(trainer: Any, saver: Any, writer: str) -> dict[str, Any]:
    import tenax.checkpoint.save.writer as writer_mod

    nice = writer_mod.WRITER_NICE
    if writer == "thread-nice0":  # ablation: the same writer without lowering its priority
        writer_mod.WRITER_NICE = 0
    try:
        return _measure_save(trainer, saver)
    finally:
        writer_mod.WRITER_NICE = nice


def _run_writers(trainer: Any, spec: Any, rank: int, world: int, root: str, reps: int,
                 writers: tuple[str, ...]) -> dict[str, Any]:
    """Round-robin over the writers, so a noisy neighbour disturbs every writer alike."""
    savers = {w: _make_saver(trainer, spec, rank, world, w, root) for w in writers}
    for w, saver in savers.items():  # warm-up: first plan, buffer allocation
        _save_once(trainer, saver, w)
    runs: dict[str, list] = {w: [] for w in writers}
    for _ in range(reps):
        for w, saver in savers.items():
            runs[w].append(_save_once(trainer, saver, w))
    for saver in savers.values():
        saver.close()
    med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
    return {w: {"blocked_s": med(rs, "blocked_s"), "slowdown": med(rs, "slowdown"),
                "lost_s": med(rs, "lost_s"), "write_s": med(rs, "write_s"),
                "steps_during": med(rs, "steps_during"), "runs": rs} for w, rs in runs.items()}


def _measure_loads(spec: Any, rank: int, world: int, reps: int) -> dict[str, float]:
    from tenax.checkpoint.manager import CheckpointManager
    from tenax.parallel.layout import ParallelLayout
    from tenax.workers.checkpoint_config import checkpoint_config
    from tenax.workers.trainer import Trainer

    out = {}
    for name, layout in (("same_dp2_zero1", dict(dp=2, zero=1)), ("reshard_tp2", dict(tp=2)),
                         ("reshard_dp2_zero3", dict(dp=2, zero=3))):
        trainer = Trainer(spec, ParallelLayout(micro_batch_size=1, **layout))
        times = []
        for _ in range(reps):
            mgr = CheckpointManager(checkpoint_config(spec), trainer, rank, world, timeout_s=600)
            t0 = time.perf_counter()
            mgr.load()
            times.append(_max_over_ranks(time.perf_counter() - t0))
            mgr.close()
        out[name] = statistics.median(times)
        del trainer
    return out


def bench_rank(rank: int, world: int, port: int, cfg: dict[str, Any], root: str,
               queue: Any) -> None:
    import torch

    from tenax.parallel.layout import ParallelLayout
    from tenax.workers.rendezvous import join_process_group, leave_process_group
    from tenax.workers.trainer import Trainer

    try:
        torch.set_num_threads(1)
        join_process_group(rank, world, "127.0.0.1", port, 600.0)
        spec = _spec(cfg["quick"], f"file://{root}/ckpt")
        trainer = Trainer(spec, ParallelLayout(dp=2, zero=1, micro_batch_size=1))
        for _ in range(2):
            _timed_step(trainer)
        steady = statistics.median(_max_over_ranks(_timed_step(trainer)) for _ in range(4))
        reps = cfg["reps"] or (3 if cfg["quick"] else 5)
        writers = _run_writers(trainer, spec, rank, world, root, reps, cfg["writers"])
        loads = _measure_loads(spec, rank, world, min(reps, 5))
        doc = {"steady_step_s": steady, "writers": writers, "loads": loads,
               "state_bytes": spec.model.num_params() * 12, "params": spec.model.num_params()}
        leave_process_group()
        queue.put((rank, doc))
    except BaseException as exc:
        queue.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))
        raise


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    w, loads = doc["writers"], doc["loads"]
    sync = w["sync"]
    ratios = {f"{name}_blocked_over_sync": r["blocked_s"] / sync["blocked_s"]
              for name, r in w.items() if name != "sync"}
    ratios.update({f"{name}_step_slowdown": r["slowdown"] for name, r in w.items()
                   if name != "sync"})
    ratios.update({f"{name}_lost_over_sync_lost": r["lost_s"] / sync["lost_s"]
                   for name, r in w.items() if name != "sync"})
    ratios["reshard_tp2_load_over_same"] = loads["reshard_tp2"] / loads["same_dp2_zero1"]
    ratios["reshard_zero3_load_over_same"] = loads["reshard_dp2_zero3"] / loads["same_dp2_zero1"]
    return ratios


def print_table(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Checkpoint writers: {doc['state_bytes'] / 1e6:.0f} MB of model+AdamW "
                        f"state, dp2 ZeRO-1 on 2 ranks, steady step {doc['steady_step_s']:.3f}s")
    for col in ("writer", "blocked s", "÷ sync", "steps during", "step ÷ steady",
                "lost s/save", "lost ÷ sync", "write s"):
        table.add_column(col, justify="left" if col == "writer" else "right",
                         no_wrap=col == "writer")
    sync = doc["writers"]["sync"]
    for name, r in doc["writers"].items():
        table.add_row(name, f"{r['blocked_s']:.4f}", f"{r['blocked_s'] / sync['blocked_s']:.3f}",
                      f"{r['steps_during']:g}", f"{r['slowdown']:.3f}", f"{r['lost_s']:.3f}",
                      f"{r['lost_s'] / sync['lost_s']:.3f}", f"{r['write_s']:.3f}")
    Console(width=130).print(table)
    loads = Table(title="Loads (max over ranks, median of runs)")
    for col in ("target layout", "seconds", "÷ same layout"):
        loads.add_column(col)
    same = doc["loads"]["same_dp2_zero1"]
    for name, secs in doc["loads"].items():
        loads.add_row(name, f"{secs:.3f}", f"{secs / same:.3f}")
    Console(width=130).print(loads)


def run(quick: bool, timeout_s: float, reps: int = 0,
        writers: tuple[str, ...] = WRITERS) -> dict[str, Any]:
    from tenax.workers.rendezvous import free_port

    root = tempfile.mkdtemp(prefix="tenax-ckpt-bench-")
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    cfg = {"quick": quick, "reps": reps, "writers": ("sync",) + tuple(w for w in writers
                                                                     if w != "sync")}
    procs = [ctx.Process(target=bench_rank, args=(r, 2, port, cfg, root, queue))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        docs = dict(queue.get(timeout=timeout_s) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        shutil.rmtree(root, ignore_errors=True)
    errors = [d["error"] for d in docs.values() if "error" in d]
    if errors:
        raise RuntimeError("; ".join(errors))
    doc = docs[0]  # every reported number is already the max over ranks
    doc["ratios"] = summarize(doc)
    doc["quick"] = quick
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a ~60 MB state instead of ~310 MB")
    parser.add_argument("--out", default="checkpoint_bench.json", help="JSON results path")
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--reps", type=int, default=0, help="saves per writer (default 5, 3)")
    parser.add_argument("--writers", default=",".join(WRITERS),
                        help=f"comma-separated subset of {','.join(WRITERS)} (sync always runs)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    writers = tuple(w for w in args.writers.split(",") if w)
    unknown = sorted(set(writers) - set(WRITERS))
    if unknown:
        parser.error(f"--writers: unknown {unknown}; choose from {list(WRITERS)}")
    doc = run(args.quick, args.timeout_s, args.reps, writers)
    print_table(doc)
    for name, value in doc["ratios"].items():
        print(f"{name:>36}: {value:.3f}")
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
