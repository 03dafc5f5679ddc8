"""Orchestration overhead: tokens/s under the Ray controller ÷ tokens/s of the bare launcher.

    python -m bench.overhead_bench [--quick] [--json PATH]

Why this comparison. Both sides run the same per-rank code (`tenax.workers.rank.run_rank`), the
same model, layout (pinned dp2 zero1 on 2 ranks), data and checkpoint settings, for the same
number of steps; the only difference is what sits around the ranks: on one side `python -m
tenax.workers.launch` (two spawned processes and a queue), on the other the Tenax stack (Ray head
and raylet, a rank actor per slot with a forkserver child, heartbeat polling by the controller,
chaos hooks, event pipes). So the ratio is the price of orchestration (goal >= 0.95).

Measured on steady-state steps only (the first WARMUP steps are skipped: allocator, page cache
and thread-pool warm-up), runs interleaved bare / Ray / bare / Ray ..., each ratio the median of
the back-to-back pairs so that drift of the shared host hits both sides alike. Figures:
- in-step: sum of tokens ÷ sum of the trainer's own step times (what `tokens_per_s` reports);
  this catches CPU stolen from the ranks by Ray's daemons and the controller's polling.
- wall: tokens of the steady window ÷ wall time between the arrival of its first and last step
  records; this adds the time between steps. Ray delivers records with the heartbeat poll, so
  its window edges are quantized by up to `heartbeat_interval_s` (the bound is in the JSON).
- orchestration CPU: cores kept busy by everything that is not a rank's training process
  (Ray's daemons, the rank actors, the controller) over the steady window; on a host whose
  cores the ranks saturate, 1 − that ÷ cores is the throughput ratio it implies, independent
  of what other tenants of the host do.
Checkpoints are written only at the last step (their cost is bench/checkpoint_bench.py's job).

Part 2, in-memory snapshots: the same job under the controller with per-step
snapshots (`checkpoint.memory_every_steps=1`, the default) ÷ without (`=0`), goal >= 0.97.
Two logical nodes x 1 slot on one local Ray, so each step's snapshot is also replicated to the
other node's agent: the whole cost (plan, copy into /dev/shm off the critical path, fence at
the next optimizer step, replica send) lands on the same 2 cores. Runs alternate on/off/off/on
... in one Ray session; each ratio is the median over the pairs. Also reported: the bytes of
one rank's snapshot (the `snapshot` events) and the /dev/shm bytes the job actually held per
rank at its last step (own double buffer + the peer's replica + nothing else).
Beside them, a third run per pair: snapshots off, next to a process that moves the same
bytes every step with no Tenax code (bench/transport_floor.py: copy and checksum, sendfile over
loopback, receive and checksum, for each rank): off beside those moves ÷ off is the least
per-step snapshots with a replica can cost on this host, whatever the implementation.
Both with the host's cores shared by everything (the ranks saturate them, so any work beside
training is taken out of it) and with the ranks' cores apart (bench/core_split.py: training on
one core; the agents, Ray, the controller, a mover and the training processes' own host-side
threads, i.e. the snapshot's copying thread, on the other), the way a GPU node divides its
work: the devices compute while the host's cores feed host memory. Each row's name says which.
`--part snapshots|orchestration` runs one part only; `--cores shared|split` one division.
"""
from __future__ import annotations

import logging
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from tenax.testing.scripts import exit_unless_run_as_module

exit_unless_run_as_module(__spec__, __file__)  # a path run stops here, before `bench.`

from bench.common import Report, parse_args
from tenax.testing.clusters import local_ray
from tenax.testing.jobs import JobRun, make_spec

logger = logging.getLogger(__name__)

MODEL = ["model.dim=256", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=4",
         "model.vocab_size=512", "model.seq_len=128", "model.ffn_hidden=688",
         "parallel.micro_batch_size=2", "parallel.dp=2", "parallel.zero=1",
         "resources.nodes=1", "resources.gpus_per_node=2"]
WARMUP = 5
TIMEOUT_S = 900.0


def _spec(root: str, steps: int, name: str) -> Any:
    return make_spec(root, MODEL + [f"train.steps={steps}", f"checkpoint.every_steps={steps}"],
                     name)


def summarize(steps: list[dict[str, Any]], side: str) -> dict[str, Any]:
    """Steady-state throughput of one run from its rank-0 step records (each with `t`)."""
    by_step = {e["step"]: e for e in steps}  # the last record of a step wins
    steady = [by_step[s] for s in sorted(by_step) if s > WARMUP]
    tokens = sum(e["tokens_per_s"] * e["step_s"] for e in steady)
    first, last = steady[0], steady[-1]
    # The window opens when step WARMUP+1 starts: its arrival minus its own duration.
    window = last["t"] - (first["t"] - first["step_s"])
    return {"side": side, "steady_steps": len(steady),
            "in_step_tokens_per_s": tokens / sum(e["step_s"] for e in steady),
            "wall_tokens_per_s": tokens / window, "window_s": window,
            "median_step_s": statistics.median(e["step_s"] for e in steady),
            "layout": first["layout"]}


def run_bare(root: str, steps: int) -> dict[str, Any]:
    from tenax.workers.launch import launch
    from tenax.workers.spec import layout_from_spec

    spec = _spec(root, steps, "overhead-bare")
    layout = layout_from_spec(spec, spec.resources.world_size)
    events: list[dict[str, Any]] = []
    ok = launch(spec.to_dict(), layout.to_dict(), spec.resources.world_size,
                lambda e: events.append({**e, "t": time.time()}), TIMEOUT_S)
    if not ok:
        raise RuntimeError(f"bare launcher failed: {events[-3:]}")
    return summarize([e for e in events if e["event"] == "step"], "bare launcher")


def orchestration_cpu() -> dict[str, float]:
    """CPU seconds so far of this driver and every process under it except the ranks' training
    processes (forkserver children share the forkserver's command line): Ray's GCS, raylet,
    agents, the rank actors, and the controller itself."""
    import psutil

    me = psutil.Process()
    out: dict[str, float] = {}
    for proc in [me] + me.children(recursive=True):
        try:
            if "forkserver" in " ".join(proc.cmdline()):
                continue
            cpu = proc.cpu_times()
            name = "controller (driver)" if proc.pid == me.pid else proc.name()
            out[name] = out.get(name, 0.0) + cpu.user + cpu.system
        except psutil.Error:
            continue
    return out


def run_ray(root: str, steps: int) -> dict[str, Any]:
    with local_ray(gpus=2):
        job = JobRun(_spec(root, steps, "overhead-ray")).start()
        job.wait_for(lambda: job.controller.step >= WARMUP, TIMEOUT_S, f"step {WARMUP}")
        cpu0, t0 = orchestration_cpu(), time.monotonic()
        job.wait_for(lambda: job.controller.step >= steps - 1, TIMEOUT_S, f"step {steps - 1}")
        cpu1, t1 = orchestration_cpu(), time.monotonic()
        job.finish(TIMEOUT_S)
    if job.state != "SUCCEEDED":
        raise RuntimeError(f"Ray job {job.state}: {job.controller.cause}")
    out = summarize(job.of("step"), "Ray controller")
    out["quantization_s"] = job.spec.fault_tolerance.heartbeat_interval_s
    used = {k: cpu1[k] - cpu0.get(k, 0.0) for k in cpu1}
    out["orchestration_cores"] = sum(used.values()) / (t1 - t0)
    out["orchestration_cores_by_process"] = {k: round(v / (t1 - t0), 4) for k, v in
                                             sorted(used.items(), key=lambda kv: -kv[1])}
    return out


SNAP_RESOURCES = ["resources.nodes=2", "resources.gpus_per_node=1"]
HOST_SHARED = "cores shared"
HOST_SPLIT = "ranks' cores apart"


def shm_bytes(job_id: str) -> int:
    """Bytes under the job's snapshot directory on this host (local + replica + restore)."""
    from tenax.checkpoint.memory.snapshot_store import snapshot_root

    total = 0
    for base, _, files in os.walk(os.path.join(snapshot_root(), job_id)):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(base, name))
            except OSError:
                pass  # pruned while we walked
    return total


def run_snapshot_variant(root: str, steps: int, every: int) -> dict[str, Any]:
    """One job in the current Ray session with memory_every_steps=`every`."""
    spec = make_spec(root, MODEL + SNAP_RESOURCES + [
        f"train.steps={steps}", f"checkpoint.every_steps={steps}",
        f"checkpoint.memory_every_steps={every}"], f"overhead-snap{every}")
    job = JobRun(spec).start()
    job.wait_for(lambda: job.controller.step >= WARMUP, TIMEOUT_S, f"step {WARMUP}")
    cpu0, step0 = orchestration_cpu(), job.controller.step
    job.wait_for(lambda: job.controller.step >= steps - 1, TIMEOUT_S, f"step {steps - 1}")
    cpu1, step1 = orchestration_cpu(), job.controller.step
    held = shm_bytes(job.controller.job_id)
    taken = snapshots_taken(job, step0, step1)
    job.finish(TIMEOUT_S)
    if job.state != "SUCCEEDED":
        raise RuntimeError(f"snapshot variant {every}: {job.state}: {job.controller.cause}")
    out = summarize(job.of("step"), f"memory_every_steps={every}")
    steady = [e for e in job.of("step") if e["step"] > WARMUP and e.get("cpu_time") is not None]
    if len(steady) > 1:
        out["rank_cpu_s_per_step"] = (steady[-1]["cpu_time"] - steady[0]["cpu_time"]) / \
            (steady[-1]["step"] - steady[0]["step"])
    out["snapshot_bytes"] = sorted({e["bytes"] for e in job.of("snapshot") if e.get("bytes")})
    out["snapshot_copy_s"] = [e["seconds"] for e in job.of("snapshot") if "seconds" in e]
    out["shm_bytes_held"], out["world"] = held, spec.resources.world_size
    out["snapshots_taken"], out["snapshot_window_steps"] = taken, step1 - step0
    used = {k: cpu1[k] - cpu0.get(k, 0.0) for k in cpu1}  # agents replicate: their CPU counts
    counted = max(1, step1 - step0)
    out["orchestration_cpu_s_per_step"] = sum(used.values()) / counted
    out["orchestration_cpu_s_per_step_by_process"] = {
        k: round(v / counted, 5) for k, v in sorted(used.items(), key=lambda kv: -kv[1])}
    return out


def snapshots_taken(job: JobRun, first: int, last: int) -> int:
    """How many of steps (first, last] rank 0 snapshotted: its agent's records (the controller
    passes on only a process's first). A snapshot is skipped while the last one's replica is
    still on its way, so this shows whether replication kept up with every step."""
    import ray

    reply = ray.get(job.controller.group.ranks[0].actor.heartbeat.remote(0), timeout=60)
    return len({e["step"] for e in reply["events"]
                if e.get("event") == "snapshot" and first < e["step"] <= last})


def run_beside_moves(root: str, steps: int, nbytes: int, period_s: float,
                     world: int) -> dict[str, Any]:
    """A job without snapshots beside a process that moves `world` snapshots' bytes every
    `period_s` with no Tenax code (bench/transport_floor.py): the least snapshots can cost."""
    from bench.transport_floor import mover

    with mover(nbytes, world, period_s):
        out = run_snapshot_variant(root, steps, 0)
    out["side"] = "bare moves beside, memory_every_steps=0"
    return out


def snapshot_runs(root: str, steps: int, pairs: int) -> tuple[list, list, list]:
    """Per pair: snapshots on, off, and off beside the bare moves (sized and paced by the
    pair's on and off runs); the order flips every pair so the host's drift hits all alike."""
    on: list[dict[str, Any]] = []
    off: list[dict[str, Any]] = []
    moved: list[dict[str, Any]] = []
    with local_ray(gpus=2):
        for i in range(pairs):
            if i % 2 == 0:
                on.append(run_snapshot_variant(root, steps, 1))
                off.append(run_snapshot_variant(root, steps, 0))
            nbytes = max(b for r in on for b in r["snapshot_bytes"])
            moved.append(run_beside_moves(root, steps, nbytes, off[-1]["median_step_s"],
                                          on[-1]["world"]))
            if i % 2 == 1:
                off.append(run_snapshot_variant(root, steps, 0))
                on.append(run_snapshot_variant(root, steps, 1))
    return on, off, moved


def snapshot_part(root: str, quick: bool, report: Report, split: bool) -> list[dict[str, Any]]:
    """`split`: the ranks on a core of their own, the rest of the host on the others
    (bench/core_split.py: the way a GPU node divides its work); the rows' names say which."""
    from bench.core_split import split_cores

    steps, pairs = (30, 3) if quick else (40, 6)
    if split:
        with split_cores() as cores:
            on, off, moved = snapshot_runs(root, steps, pairs)
        where = f" [{HOST_SPLIT}]"
        on_cores = ", ".join(map(str, sorted(cores.rank_cores)))
        report.add(f"threads placed{where}", cores.moved, note=f"{len(cores.training_pids)} "
                   f"training processes and forkservers on core(s) {on_cores}")
    else:
        on, off, moved = snapshot_runs(root, steps, pairs)
        where = f" [{HOST_SHARED}]"
    ratio_rows(report, on, off, where)
    sizes = [b for r in on for b in r["snapshot_bytes"]]
    held = [r["shm_bytes_held"] / r["world"] for r in on]
    copies = [c for r in on for c in r["snapshot_copy_s"]]
    report.add(f"host memory: one rank's snapshot{where}", max(sizes) / 2**20 if sizes else None,
               unit="MiB", note="from rank 0's first snapshot event of each run; its copy took "
               f"{statistics.median(copies):.3f} s (median)" if copies else "no snapshot event")
    report.add(f"host memory held per rank in /dev/shm{where}", max(held) / 2**20, unit="MiB",
               note=f"measured at the last step: {max(held) / max(sizes or [1]):.2f} x one "
               f"snapshot (double buffer + the peer's double-buffered replica)")
    if sizes:
        floor_rows(report, off, moved, max(sizes), where)
    return [{**r, "cores": where.strip(" []")} for trio in zip(on, off, moved) for r in trio]


def ratio_rows(report: Report, on: list[dict[str, Any]], off: list[dict[str, Any]],
               where: str) -> None:
    """Snapshots on ÷ off: tokens/s, the ranks' CPU, the CPU beside them, snapshots taken."""
    for key, label in (("in_step_tokens_per_s", "in-step"), ("wall_tokens_per_s", "wall")):
        pair = sorted(a[key] / b[key] for a, b in zip(on, off))
        report.add(f"{label} tokens/s: snapshots every step ÷ off{where}", statistics.median(pair),
                   ">= 0.97", f"median of {len(pair)} pairs (range {pair[0]:.3f}-{pair[-1]:.3f}); "
                   f"{statistics.mean(r[key] for r in on):.0f} vs "
                   f"{statistics.mean(r[key] for r in off):.0f} tokens/s")
    cpu = sorted(b["rank_cpu_s_per_step"] / a["rank_cpu_s_per_step"] for a, b in zip(on, off)
                 if "rank_cpu_s_per_step" in a and "rank_cpu_s_per_step" in b)
    if cpu:
        report.add(f"rank CPU per step: off ÷ snapshots{where}", statistics.median(cpu),
                   note=f"rank 0's CPU seconds per step (copy thread included), pairs "
                   f"{cpu[0]:.3f}-{cpu[-1]:.3f}; less load-sensitive than tokens/s")
    extra = sorted(a["orchestration_cpu_s_per_step"] - b["orchestration_cpu_s_per_step"]
                   for a, b in zip(on, off))
    steps_cpu = statistics.mean(r["rank_cpu_s_per_step"] for r in off if "rank_cpu_s_per_step" in r)
    report.add(f"CPU outside the ranks per step: snapshots − off{where}",
               statistics.median(extra), unit="s", note="Ray's daemons and the agents (who "
               f"replicate), pairs {extra[0]:.4f}-{extra[-1]:.4f}; a rank's step costs "
               f"{steps_cpu:.3f} CPU s")
    taken = [r["snapshots_taken"] / max(1, r["snapshot_window_steps"]) for r in on]
    report.add(f"snapshots taken per step (steady window){where}", min(taken),
               note=f"lowest of {len(taken)} runs ({', '.join(f'{t:.2f}' for t in taken)}): "
               "below 1, replicas fell behind and steps went without a snapshot")


def floor_rows(report: Report, off: list[dict[str, Any]], moved: list[dict[str, Any]],
               nbytes: int, where: str) -> None:
    """What moving the snapshots' bytes costs with no Tenax code (bench/transport_floor.py):
    beside a job, and alone in CPU seconds."""
    from bench.transport_floor import measure

    for key, label in (("in_step_tokens_per_s", "in-step"), ("wall_tokens_per_s", "wall")):
        pair = sorted(a[key] / b[key] for a, b in zip(moved, off))
        report.add(f"{label} tokens/s: off beside the bare moves ÷ off{where}",
                   statistics.median(pair),
                   note=f"median of {len(pair)} pairs (range {pair[0]:.3f}-{pair[-1]:.3f}): "
                   "the least per-step snapshots with a replica can cost on this host with its "
                   "cores divided so")
    floor = measure(nbytes)
    report.add("CPU to move one snapshot, no Tenax code", floor["total_s"], unit="s",
               note=f"{nbytes / 2**20:.1f} MiB: copy + checksum "
               f"{floor['copy_and_checksum_s']:.4f}, sendfile over loopback "
               f"{floor['send_s']:.4f}, receive + checksum {floor['receive_and_checksum_s']:.4f}"
               f" s (median of {floor['reps']}, idle host)")


def orchestration_part(root: str, quick: bool, report: Report) -> list[dict[str, Any]]:
    steps, pairs = (30, 2) if quick else (40, 4)
    runs: list[dict[str, Any]] = []
    for _ in range(pairs):
        runs.append(run_bare(root, steps))
        runs.append(run_ray(root, steps))
    bare = [r for r in runs if r["side"] == "bare launcher"]
    ray_ = [r for r in runs if r["side"] == "Ray controller"]
    if {str(r["layout"]) for r in runs} != {str(bare[0]["layout"])}:
        raise RuntimeError(f"layouts differ: {[r['layout'] for r in runs]}")

    def mean(rs: list[dict[str, Any]], key: str) -> float:
        return statistics.mean(r[key] for r in rs)

    for key, label in (("in_step_tokens_per_s", "in-step"), ("wall_tokens_per_s", "wall")):
        pair = sorted(r[key] / b[key] for b, r in zip(bare, ray_))
        report.add(f"{label} tokens/s: Ray ÷ bare", statistics.median(pair), ">= 0.95",
                   f"median of {len(pair)} back-to-back pairs "
                   f"(range {pair[0]:.3f}-{pair[-1]:.3f}); "
                   f"{mean(ray_, key):.0f} vs {mean(bare, key):.0f} tokens/s")
    worst = max(r["quantization_s"] / r["window_s"] for r in ray_)
    report.add("wall window quantization bound", worst,
               note="± share of the Ray window from heartbeat-poll delivery")
    cores = mean(ray_, "orchestration_cores")
    top = ", ".join(f"{k} {v:.2f}" for k, v in list(ray_[-1]["orchestration_cores_by_process"]
                                                   .items())[:3])
    report.add("orchestration CPU (cores busy)", cores,
               note=f"of {os.cpu_count()} cores, steady window; top: {top}")
    report.add("ratio implied by that CPU: 1 − cores busy ÷ cores",
               1 - cores / (os.cpu_count() or 1),
               ">= 0.95", "load-independent estimate when the ranks saturate every core")
    report.add("median step (bare)", mean(bare, "median_step_s"), unit="s",
               note=f"{bare[0]['layout']}, {bare[0]['steady_steps']} steady steps x {pairs} run(s)")
    report.add("median step (Ray)", mean(ray_, "median_step_s"), unit="s")
    return runs


def _extra(parser: Any) -> None:
    parser.add_argument("--part", choices=("all", "snapshots", "orchestration"), default="all")
    parser.add_argument("--cores", choices=("both", "shared", "split"), default="both",
                        help="snapshot part: the ranks share every core with the agents and "
                        "Ray (shared), have a core of their own as on a GPU node (split), or "
                        "one after the other (both)")


def main() -> int:
    args = parse_args(__doc__, _extra)
    report = Report("Overhead: in-memory snapshots and orchestration, side by side")
    context: dict[str, Any] = {"quick": args.quick, "warmup": WARMUP, "model": MODEL,
                               "load_avg_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="tenax-overhead-") as root:
        if args.part in ("all", "snapshots"):
            context["snapshot_runs"] = []
            for split in {"shared": [False], "split": [True], "both": [False, True]}[args.cores]:
                context["snapshot_runs"] += snapshot_part(root, args.quick, report, split)
        if args.part in ("all", "orchestration"):
            context["orchestration_runs"] = orchestration_part(root, args.quick, report)
    context["load_avg_after"] = os.getloadavg()
    report.context = context
    report.finish(args.json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
