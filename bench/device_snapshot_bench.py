"""Per-step in-memory snapshots on a device: what they cost training, whether each one holds
the state it was taken from, and a restore from them next to one from a local disk.

    python -m bench.device_snapshot_bench [--device cuda|cpu] [--size smoke|gpu] [--steps N]
                                          [--reps R] [--json PATH] [--quick]

What runs is the production path on one rank: a `Trainer` (the 1.26B-parameter model of
`bench/mfu_bench.py` on a GPU, bf16 autocast, AdamW), its `CheckpointManager`, and a
`MemorySnapshotter` asked for a snapshot after every step. On a device the snapshotter copies
the state on a side stream into a pinned host buffer, the optimizer's stream waits for that
copy, and a snapshot whose predecessor is still being written to tmpfs is skipped
(checkpoint/memory/device_staging.py). Figures:
- tokens/s with a snapshot asked for after every step ÷ without, interleaved in blocks of
  `steps` steps (`reps` blocks each; goal >= 0.97), over all steps of a mode and by the
  median step, the training thread's time inside `snapshot()`, and how many of the asked-for
  snapshots were taken (the others were skipped while the host was still writing the last
  one);
- exact: two snapshots in a row read back from tmpfs, byte for byte, against device clones
  of the planned tensors taken at the snapshot call (a wrong fence would tear them: the next
  step's optimizer would have changed the state under the copy);
- restore: the same step from the snapshot (assembled the way an agent does, then loaded)
  ÷ from a storage checkpoint on local disk, its pages in cache (warm) and dropped (cold);
  each load follows a step that changed the state and must bring back, byte for byte, every
  parameter, moment and the step count that were saved.
On CPU (`--quick`) the snapshot path is the host one: the smoke run shows the script works.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

from tenax.testing.scripts import exit_unless_run_as_module

exit_unless_run_as_module(__spec__, __file__)  # a path run stops here, before `bench.`

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

GENERATION = 1
TMPFS = "/dev/shm"


def spec_for(size: str, device: torch.device, storage: str, compile: bool) -> Any:
    """The job spec of the bench's model (bench/mfu_bench.py's sizes) on one rank."""
    from bench.mfu_bench import MODEL_KEYS, SIZES
    from tenax.orchestrator.spec import load_spec

    dims = SIZES[size]
    overrides = [f"model.{k}={dims[k]}" for k in MODEL_KEYS] + [
        f"train.global_batch_size={dims['micro_batch'] * dims['accum']}",
        f"parallel.micro_batch_size={dims['micro_batch']}", "parallel.recompute=none",
        "train.warmup_steps=0", "train.steps=100000", f"resources.device={device.type}",
        "resources.nodes=1", "resources.gpus_per_node=1", f"checkpoint.uri=file://{storage}",
        f"train.dtype={'bfloat16' if device.type == 'cuda' else 'float32'}",
        f"train.compile={str(compile).lower()}"]
    return load_spec(overrides=overrides)


def snapshot_home(state_bytes: int) -> str:
    """/dev/shm when it has room for two buffers and a margin, else the temp dir (logged)."""
    if os.path.isdir(TMPFS) and shutil.disk_usage(TMPFS).free > 3 * state_bytes:
        return tempfile.mkdtemp(prefix="tenax-snapbench-", dir=TMPFS)
    logger.warning("%s has no room for 2 x %d bytes: snapshots go to the temp dir", TMPFS,
                   state_bytes)
    return tempfile.mkdtemp(prefix="tenax-snapbench-")


class Rig:
    """One rank's trainer, checkpoint manager and snapshotter."""

    def __init__(self, size: str, device: torch.device, work: str, compile: bool) -> None:
        from tenax.checkpoint.collectives import all_ranks_agree
        from tenax.checkpoint.manager import CheckpointManager
        from tenax.checkpoint.memory.snapshot import MemorySnapshotter
        from tenax.parallel.layout import ParallelLayout
        from tenax.workers.checkpoint_config import checkpoint_config
        from tenax.workers.trainer import Trainer

        self.spec = spec_for(size, device, os.path.join(work, "storage"), compile)
        self.trainer = Trainer(self.spec, ParallelLayout(
            dp=1, zero=1, micro_batch_size=self.spec.parallel.micro_batch_size), device=device)
        self.mgr = CheckpointManager(checkpoint_config(self.spec), self.trainer, 0, 1,
                                     timeout_s=900)
        self.events: list[dict[str, Any]] = []
        self.state_bytes = sum(t.numel() * t.element_size() for _, t in self.planned().tensors)
        self.snaps = snapshot_home(self.state_bytes)
        self.snap = MemorySnapshotter(self.mgr.config, self.mgr.state, 0, 1, self.snaps,
                                      GENERATION, all_ranks_agree, self.events.append,
                                      plans=self.mgr.plans)

    def planned(self) -> Any:
        """What a snapshot of now copies: the file and the cached plan's views of the live
        tensors at their offsets."""
        from tenax.checkpoint.collectives import all_ranks_agree

        return self.mgr.plans.plan(self.mgr.state, 0, all_ranks_agree, True)

    def step(self) -> float:
        return self.trainer.run_step().loss

    def close(self) -> None:
        self.snap.close()
        self.mgr.close()
        shutil.rmtree(self.snaps, ignore_errors=True)


def timed_blocks(rig: Rig, steps: int, reps: int) -> dict[str, Any]:
    """Blocks of `steps` steps without and with a snapshot after each, interleaved; tokens/s
    over all blocks of a mode (a taken snapshot's wait at the next optimizer step counts), the
    median step, and the training thread's time inside `snapshot()`."""
    times: dict[str, list[float]] = {"off": [], "every_step": []}
    calls: list[float] = []
    taken_before, asked = len([e for e in rig.events if e["event"] == "snapshot"]), 0
    for _ in range(reps):
        for mode in times:
            for _ in range(steps):
                t0 = time.perf_counter()
                rig.step()
                if mode == "every_step":
                    t1 = time.perf_counter()
                    rig.snap.snapshot(rig.trainer.step)
                    calls.append(time.perf_counter() - t1)
                    asked += 1
                times[mode].append(time.perf_counter() - t0)
            rig.snap.wait()  # the next block starts with no copy in flight
    taken = len([e for e in rig.events if e["event"] == "snapshot"]) - taken_before
    med = {mode: statistics.median(v) for mode, v in times.items()}
    total = {mode: sum(v) for mode, v in times.items()}
    return {"median_step_s": med, "total_s": total,
            "tokens_per_s_every_step_over_off": total["off"] / total["every_step"],
            "median_step_off_over_every_step": med["off"] / med["every_step"],
            "snapshot_call_s": {"median": statistics.median(calls), "max": max(calls)},
            "snapshots_asked": asked, "snapshots_taken": taken,
            "snapshots_skipped": rig.snap.skipped, "steps_per_block": steps, "reps": reps}


def snapshot_bytes(rig: Rig, step: int) -> tuple[Any, dict[str, Any]]:
    from tenax.checkpoint.memory.snapshot_store import SnapshotDir

    return SnapshotDir(rig.snaps).mapped(GENERATION, 0, step)


def same_bytes(data: Any, offset: int, tensor: torch.Tensor) -> bool:
    """Whether the file bytes at `offset` are `tensor`'s (compared where the tensor is: on a
    device 15 GB compare in a second, not in numpy's minute)."""
    import warnings

    nbytes = tensor.numel() * tensor.element_size()
    with warnings.catch_warnings():  # the mapping is read-only and is only read here
        warnings.simplefilter("ignore", UserWarning)
        stored = torch.frombuffer(data, dtype=torch.uint8, offset=offset, count=nbytes)
    mine = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(stored.to(tensor.device), mine)


def exact_snapshots(rig: Rig, count: int = 2) -> dict[str, Any]:
    """`count` snapshots, each compared byte for byte with device clones taken at its call
    (the step after it has run, so its optimizer changed the state behind the fence)."""
    results = []
    for _ in range(count):
        rig.snap.wait()
        rig.step()
        step = rig.trainer.step
        rig.snap.snapshot(step)
        planned = rig.planned()
        clones = [(off, t.detach().clone()) for off, t in planned.tensors]
        rig.step()  # changes every parameter and moment once the copy let it
        rig.snap.wait()
        _, views = snapshot_bytes(rig, step)  # checks the file's crc32c on the way
        same = all(same_bytes(views[planned.file], off, c) for off, c in clones)
        changed = any(not torch.equal(c, t) for (_, c), (_, t) in zip(clones, planned.tensors))
        results.append({"step": step, "equal": same, "state_changed_after": changed})
        del clones
    return {"snapshots": results, "exact": all(r["equal"] for r in results),
            "state_changed_after_each": all(r["state_changed_after"] for r in results)}


def state_clones(rig: Rig) -> dict[str, torch.Tensor]:
    """The whole training state (parameters, moments, step count) by name, copied where it
    lives."""
    from tenax.checkpoint.load.reshard import training_state

    return {k: v.detach().clone() for k, v in training_state(rig.trainer).items()}


def same_state(rig: Rig, want: dict[str, torch.Tensor]) -> bool:
    from tenax.checkpoint.load.reshard import training_state

    got = training_state(rig.trainer)
    return got.keys() == want.keys() and all(torch.equal(got[k].to(want[k].device), want[k])
                                             for k in want)


def restore_times(rig: Rig, work: str, reps: int) -> dict[str, Any]:
    """One step saved to local disk and snapshotted; loads from each source, interleaved, each
    after a step that changed the state and checked against the state that was saved."""
    from bench.restore_bench import drop_page_cache
    from tenax.checkpoint.memory.restore import assemble_version
    from tenax.checkpoint.memory.snapshot_store import SnapshotDir

    rig.snap.wait()
    rig.step()
    step = rig.trainer.step
    rig.mgr.save(step)
    rig.snap.snapshot(step)
    rig.snap.wait()
    rig.mgr.wait()
    saved = state_clones(rig)
    times: dict[str, list[float]] = {"memory": [], "disk_warm": [], "disk_cold": []}
    exact: dict[str, bool] = {}
    checked: dict[str, float] = {}
    store = SnapshotDir(rig.snaps)
    for rep in range(reps):
        for mode in times:
            rig.step()  # the load must bring the saved state back
            target = os.path.join(rig.snaps, f"assembled-{rep}")
            if mode == "disk_cold":
                drop_page_cache(os.path.join(work, "storage"))
            t0 = time.perf_counter()
            if mode == "memory":
                stamp, _ = store.paths(GENERATION, 0, step)  # what an agent's `locate` checks
                uri = assemble_version(target, [(stamp, os.path.join(
                    store.series(GENERATION, 0), f"s{step}"))])
                loaded = rig.mgr.load(source_uri=uri)
            else:
                loaded = rig.mgr.load()
            times[mode].append(time.perf_counter() - t0)
            if rep == reps - 1 and mode in ("memory", "disk_warm"):  # what the check costs alone
                checked[mode] = check_seconds(uri if mode == "memory" else None, rig, step)
            shutil.rmtree(target, ignore_errors=True)
            if loaded != step:
                raise RuntimeError(f"restore from {mode}: loaded step {loaded}, expected {step}")
            exact[mode] = exact.get(mode, True) and same_state(rig, saved)
    del saved
    med = {mode: statistics.median(v) for mode, v in times.items()}
    return {"median_s": med, "memory_over_disk_warm": med["memory"] / med["disk_warm"],
            "memory_over_disk_cold": med["memory"] / med["disk_cold"], "reps": reps,
            "step": step, "exact": exact, "check_alone_s": checked}


def check_seconds(uri: str | None, rig: Rig, step: int) -> float:
    """Seconds to re-read and checksum the version of `step` (at `uri`, else checkpoint.uri)."""
    from tenax.checkpoint.format.catalog import Catalog
    from tenax.checkpoint.format.storage import Storage

    catalog = rig.mgr.catalog if uri is None else Catalog(Storage(uri, timeout_s=60.0))
    t0 = time.perf_counter()
    problems = catalog.verify(step)
    if problems:
        raise RuntimeError(f"step {step} does not verify: {problems}")
    return time.perf_counter() - t0


def run(device: torch.device, size: str, steps: int, reps: int, compile: bool = False,
        record: Callable[[dict[str, Any]], None] = lambda _: None,
        restore_reps: int | None = None) -> dict[str, Any]:
    """Every phase's figures; `record` is given them after each phase (a run cut short by a
    host's time limit still leaves what it reached)."""
    work = tempfile.mkdtemp(prefix="tenax-snapbench-work-")
    rig = Rig(size, device, work, compile)
    try:
        warmup_s = []
        for _ in range(2):  # warm-up: allocator, kernels, the moments' creation, compiling
            t0 = time.perf_counter()
            rig.step()
            warmup_s.append(time.perf_counter() - t0)
        rig.snap.snapshot(rig.trainer.step)  # the first allocates the pinned and tmpfs buffers
        rig.snap.wait()
        result: dict[str, Any] = {"device": str(device), "size": size, "compile": compile,
                                  "state_bytes": rig.state_bytes, "snapshot_dir": rig.snaps,
                                  "staged_on_device": rig.snap.staging.nbytes() > 0,
                                  "step_s_warmup": warmup_s}
        record(result)
        result.update(timed_blocks(rig, steps, reps))
        record(result)
        result["exactness"] = exact_snapshots(rig)
        record(result)
        result["restore"] = restore_times(rig, work, restore_reps or (
            1 if device.type == "cuda" else reps))
        record(result)
        return result
    finally:
        rig.close()
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=("smoke", "gpu"), default=None)
    parser.add_argument("--steps", type=int, default=None, help="per block (default 6)")
    parser.add_argument("--reps", type=int, default=None, help="blocks per mode (default 2)")
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--quick", action="store_true", help="smoke size, 2 steps, 1 rep")
    parser.add_argument("--compile", action="store_true", help="train.compile: blocks compiled")
    parser.add_argument("--restore-reps", type=int, default=None,
                        help="restores from each source (default 1 on cuda, else --reps)")
    args = parser.parse_args(argv)
    quick = {"size": "smoke", "steps": 2, "reps": 1} if args.quick else {"steps": 6, "reps": 2}
    for name, value in quick.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    logging.basicConfig(level=logging.WARNING)
    from bench.mfu_bench import one_rank_group

    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    one_rank_group(device)
    start = time.monotonic()

    def record(figures: dict[str, Any]) -> None:
        print(f"[{time.monotonic() - start:6.1f}s] reached: {sorted(figures)[-3:]}",
              file=sys.stderr, flush=True)
        if args.json_path:
            with open(args.json_path, "w") as f:
                json.dump(figures, f, indent=2)

    result = run(device, args.size or ("gpu" if device.type == "cuda" else "smoke"),
                 args.steps, args.reps, args.compile, record, args.restore_reps)
    print(json.dumps(result, indent=2))
    dist.destroy_process_group()
    restored = all(result["restore"]["exact"].values())
    return 0 if result["exactness"]["exact"] and restored else 1


if __name__ == "__main__":
    sys.exit(main())
