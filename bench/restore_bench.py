"""Restore from memory ÷ restore from storage of the same step, side by side on 2 gloo ranks.

    python -m bench.restore_bench [--quick] [--reps N] [--json PATH]

Why: issue 13's in-memory snapshots are only worth their host RAM if resuming from them is much
faster than resuming from the storage checkpoint of the same step (expect well below 1). Both
copies of step 1 come from the same processes: a dp2 ZeRO-1 trainer takes one step, then
`CheckpointManager.save(1)` writes storage and `MemorySnapshotter.snapshot(1)` the per-rank
snapshot into /dev/shm (what each rank's agent holds). Then, in fresh processes with the same
layout (and, as a second pair, resharded into tp2), reps alternate memory/storage/storage/memory:
- memory: rank 0 reads every rank's piece (size + crc32c checked, what the agents' reads do),
  assembles them into a committed version under /dev/shm (checkpoint/restore.py, what one
  agent per node does at placement), then every rank runs `load(source_uri=<that>)`;
- storage: every rank runs `load()` from checkpoint.uri (a local-disk `file://` directory).
Storage is timed twice: *warm* (its files still in the page cache, the best case: the node
that wrote it, moments later) and *cold* (the files' pages dropped with posix_fadvise
DONTNEED before the load, as a replacement node reading local disk would see; remote object
storage would be slower still). Times are the slowest rank's, between barriers.
"""
from __future__ import annotations

import logging
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from bench.common import Report, parse_args, ratio

logger = logging.getLogger(__name__)

FULL = ["model.dim=512", "model.n_layers=6", "model.ffn_hidden=1376", "model.vocab_size=8192"]
QUICK = ["model.dim=256", "model.n_layers=4", "model.ffn_hidden=688", "model.vocab_size=4096"]
COMMON = ["model.n_heads=8", "model.n_kv_heads=4", "model.seq_len=64",
          "train.global_batch_size=4", "train.warmup_steps=0", "train.steps=100",
          "parallel.micro_batch_size=1", "checkpoint.keep_last=2"]
GENERATION = 1


def _spec(dims: list[str], uri: str) -> Any:
    from orchestrator.spec import load_spec

    return load_spec(overrides=dims + COMMON + [f"checkpoint.uri={uri}"])


def save_both_job(rank: int, world: int, root: str, dims: list[str]) -> dict[str, Any]:
    """One dp2 ZeRO-1 step, then step 1 to storage and to this rank's snapshot directory."""
    from checkpoint.manager import CheckpointManager
    from checkpoint.planning import all_ranks_agree
    from checkpoint.snapshot import MemorySnapshotter
    from parallel.layout import ParallelLayout
    from workers.trainer import Trainer

    spec = _spec(dims, f"file://{root}/storage")
    trainer = Trainer(spec, ParallelLayout(dp=2, zero=1, micro_batch_size=1))
    trainer.run_step()
    done: list[dict[str, Any]] = []
    with CheckpointManager(spec, trainer, rank, world, timeout_s=300) as mgr:
        snaps = MemorySnapshotter(spec, mgr.state, rank, world, f"{root}/snap-{rank}",
                                  GENERATION, all_ranks_agree, done.append)
        mgr.save(1)
        snaps.snapshot(1)
        snaps.close()
        mgr.wait()
    return {"snapshot": done}


def _drop_page_cache(path: str) -> None:
    """Evict the clean pages of every file under `path` (only these files; nobody else's)."""
    for base, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(base, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _assemble(root: str, world: int, rep: int) -> tuple[str, float]:
    """Read every rank's piece (checksummed) and commit them as one version in /dev/shm."""
    from checkpoint.restore import assemble_version
    from checkpoint.snapshot_store import SnapshotDir, snapshot_root

    t0 = time.perf_counter()
    pieces = [SnapshotDir(f"{root}/snap-{r}").read(GENERATION, r, 1) for r in range(world)]
    target = os.path.join(snapshot_root(), f"bench-restore-{os.getpid()}-{rep}")
    return assemble_version(target, pieces), time.perf_counter() - t0


def _timed(fn: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def load_reps_job(rank: int, world: int, root: str, dims: list[str], layout: dict[str, Any],
                  reps: int) -> dict[str, Any]:
    """Alternate memory / storage-warm / storage-cold loads of step 1 into `layout`."""
    import shutil

    import torch.distributed as dist

    from checkpoint.manager import CheckpointManager
    from parallel.layout import ParallelLayout
    from workers.trainer import Trainer

    spec = _spec(dims, f"file://{root}/storage")
    trainer = Trainer(spec, ParallelLayout.from_dict(layout))
    times: dict[str, list[float]] = {"memory": [], "assemble": [], "storage_warm": [],
                                     "storage_cold": []}
    with CheckpointManager(spec, trainer, rank, world, timeout_s=300) as mgr:
        for rep in range(reps):
            order = ["memory", "storage_warm", "storage_cold"]
            for kind in order if rep % 2 == 0 else order[::-1]:
                if kind == "memory":
                    box: list[Any] = [None, 0.0]
                    if rank == 0:
                        box = list(_assemble(root, world, rep))
                    dist.broadcast_object_list(box, src=0)
                    times["assemble"].append(box[1])
                    times["memory"].append(_timed(lambda: mgr.load(source_uri=box[0])))
                    dist.barrier()
                    if rank == 0:
                        shutil.rmtree(box[0][len("file://"):], ignore_errors=True)
                    continue
                if kind == "storage_cold" and rank == 0:
                    _drop_page_cache(f"{root}/storage")
                times[kind].append(_timed(mgr.load))
        events = mgr.drain_events()
    sources = sorted({e.get("source") for e in events if e["event"] == "checkpoint_loaded"})
    return {"times": times, "sources": sources, "step": trainer.step} if rank == 0 else {}


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def add_rows(report: Report, name: str, t: dict[str, list[float]]) -> None:
    mem_total = [a + m for a, m in zip(t["assemble"], t["memory"])]
    for storage in ("storage_warm", "storage_cold"):
        label = storage.split("_")[1]
        report.add(f"{name}: memory load ÷ storage load ({label})",
                   ratio(_med(t["memory"]), _med(t[storage])), "<= 1",
                   f"median {_med(t['memory']):.3f} s vs {_med(t[storage]):.3f} s")
        report.add(f"{name}: memory read+assemble+load ÷ storage load ({label})",
                   ratio(_med(mem_total), _med(t[storage])), "<= 1",
                   f"{_med(t['assemble']):.3f} s read+assemble + {_med(t['memory']):.3f} s load "
                   f"vs {_med(t[storage]):.3f} s")


def main() -> int:
    args = parse_args(__doc__, lambda p: p.add_argument("--reps", type=int, default=0))
    from tests.distributed import run_ranks

    dims = QUICK if args.quick else FULL
    reps = args.reps or (4 if args.quick else 8)
    report = Report("Restore from memory vs from storage, same step, side by side")
    context: dict[str, Any] = {"quick": args.quick, "dims": dims, "reps": reps,
                               "load_avg_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="tenax-restore-", dir="/var/tmp") as root:
        saved = run_ranks(save_both_job, 2, root, dims, timeout_s=900)
        sizes = [e["bytes"] for r in saved for e in r["snapshot"]]
        report.add("snapshot of one rank (dp2 ZeRO-1)", max(sizes) / 2**20, unit="MiB",
                   note=f"ranks: {[round(s / 2**20, 1) for s in sizes]} MiB")
        for name, layout in (("same layout dp2", {"dp": 2, "zero": 1, "micro_batch_size": 1}),
                             ("resharded into tp2", {"tp": 2, "micro_batch_size": 1})):
            out = run_ranks(load_reps_job, 2, root, dims, layout, reps, timeout_s=1800)[0]
            if out["step"] != 1 or out["sources"] != ["memory", "storage"]:
                raise RuntimeError(f"{name}: loaded step {out['step']} from {out['sources']}")
            add_rows(report, name, out["times"])
            context[name] = out
    context["load_avg_after"] = os.getloadavg()
    report.context = context
    report.finish(args.json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
