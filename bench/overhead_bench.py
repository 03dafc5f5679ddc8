"""Orchestration overhead: tokens/s under the Ray controller ÷ tokens/s of the bare launcher.

    python -m bench.overhead_bench [--quick] [--json PATH]

Why this comparison. Both sides run the same per-rank code (`workers.launch.run_rank`), the same
model, layout (pinned dp2 zero1 on 2 ranks), data and checkpoint settings, for the same number
of steps; the only difference is what sits around the ranks: on one side `python -m
workers.launch` (two spawned processes and a queue), on the other the Tenax stack (Ray head and
raylet, a rank actor per slot with a forkserver child, heartbeat polling by the controller,
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
"""
from __future__ import annotations

import logging
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from bench.common import Report, TimedJob, local_ray, make_spec, parse_args

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
    from workers.launch import launch
    from workers.spec import layout_from_spec

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
        job = TimedJob(_spec(root, steps, "overhead-ray")).start()
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


def main() -> int:
    args = parse_args(__doc__)
    steps, pairs = (30, 2) if args.quick else (40, 4)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tenax-overhead-") as root:
        for _ in range(pairs):
            runs.append(run_bare(root, steps))
            runs.append(run_ray(root, steps))
    bare = [r for r in runs if r["side"] == "bare launcher"]
    ray_ = [r for r in runs if r["side"] == "Ray controller"]
    if {str(r["layout"]) for r in runs} != {str(bare[0]["layout"])}:
        raise RuntimeError(f"layouts differ: {[r['layout'] for r in runs]}")

    def mean(rs: list[dict[str, Any]], key: str) -> float:
        return statistics.mean(r[key] for r in rs)

    report = Report("Orchestration overhead: Ray controller vs bare launcher (same rank code)")
    for key, label in (("in_step_tokens_per_s", "in-step"), ("wall_tokens_per_s", "wall")):
        pair = sorted(r[key] / b[key] for b, r in zip(bare, ray_))
        report.add(f"{label} tokens/s: Ray ÷ bare", statistics.median(pair), ">= 0.95",
                   f"median of {len(pair)} back-to-back pairs (range {pair[0]:.3f}-{pair[-1]:.3f}); "
                   f"{mean(ray_, key):.0f} vs {mean(bare, key):.0f} tokens/s")
    worst = max(r["quantization_s"] / r["window_s"] for r in ray_)
    report.add("wall window quantization bound", worst,
               note="± share of the Ray window from heartbeat-poll delivery")
    cores = mean(ray_, "orchestration_cores")
    top = ", ".join(f"{k} {v:.2f}" for k, v in list(ray_[-1]["orchestration_cores_by_process"]
                                                   .items())[:3])
    report.add("orchestration CPU (cores busy)", cores,
               note=f"of {os.cpu_count()} cores, steady window; top: {top}")
    report.add("ratio implied by that CPU: 1 − cores busy ÷ cores", 1 - cores / (os.cpu_count() or 1),
               ">= 0.95", "load-independent estimate when the ranks saturate every core")
    report.add("median step (bare)", mean(bare, "median_step_s"), unit="s",
               note=f"{bare[0]['layout']}, {bare[0]['steady_steps']} steady steps x {pairs} run(s)")
    report.add("median step (Ray)", mean(ray_, "median_step_s"), unit="s")
    report.context = {"quick": args.quick, "steps": steps, "warmup": WARMUP, "runs": runs,
                      "model": MODEL}
    report.finish(args.json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
