"""Experiment tracking's cost: tokens/s with TensorBoard + W&B (offline) on ÷ off.

    python -m bench.tracking_bench [--quick] [--json PATH]

Both sides run the same job on the local launcher (2 gloo ranks, dp2 zero1, the same model, data
and steps); on one, rank 0 also writes every step to a TensorBoard directory and an offline W&B
run (`logging.tensorboard_dir`, `logging.wandb.mode=offline`; workers/tracking). The writes run
on rank 0's tracker thread and, for W&B, in its `wandb-core` process, so what this measures is
what they take from training on a host whose cores the ranks saturate: the queue append on the
training thread, the writer's CPU and wandb-core's (goal >= 0.99).

Two shapes: the peers' workload (Llama-like dim 256, 4 layers, the other benches' shape; a
step of ~0.3-0.4 s here), where the goal applies, and a tiny model (a ~16 ms step) as the worst
case: what tracking costs per step is about constant, so its share grows as the step shrinks.
Runs alternate off/on/on/off... (each pair's ratio is on ÷ off of neighbours, so drift of a
shared host hits both alike); the figure is the median over the pairs. Steady-state steps
only: the first WARMUP steps and the first OPEN_S seconds are skipped on both sides, since
`wandb.init` (~1 s of CPU on rank 0's tracker thread, once per attempt) overlaps the first
seconds of training and would otherwise be charged to every step of a short run. Two
figures: in-step (tokens ÷ the median of the trainer's own step times, what `tokens_per_s`
reports; the median, as other tenants of a shared host stretch single steps) and wall (tokens
of the steady window ÷ the time between its first and last step records: adds what happens
between steps, the record's hand-off included).

Part 2, the writers' CPU, which a loaded host cannot hide: the same backends fed step records
in this process, CPU_CHUNK at a time (each chunk written before the next), the
tracker thread's CPU (`time.thread_time`) and wandb-core's (/proc) per step after their
start-up. On a host whose cores the ranks saturate, a step then costs at most that much more:
the implied ratio is step_s ÷ (step_s + tracking CPU per step), step_s the off runs' median.
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

from bench.common import Report, parse_args, ratio

logger = logging.getLogger(__name__)

WARMUP = 10
MIN_STEADY, STEPS_GROWTH, RETRIES = 10, 3, 2  # see run_once
CPU_CHUNK = 25  # records handed over between waits in the writers' CPU measure
OPEN_S = 3.0  # wandb.init's one-time cost (~1 s of CPU) lands in these seconds (module doc)
MODEL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
         "model.vocab_size=256", "model.seq_len=64", "model.ffn_hidden=128"]
PEERS = ["model.dim=256", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=4",
         "model.vocab_size=512", "model.seq_len=128", "model.ffn_hidden=688"]
# shape -> (model keys, global batch, (steps, pairs) quick, (steps, pairs) full)
SHAPES = {"peers' shape": (PEERS, 16, (40, 2), (120, 4)),
          "tiny model": (MODEL, 8, (100, 2), (300, 5))}


def launch_steps(root: str, tracked: bool, steps: int, shape: str) -> tuple[Any, list[dict]]:
    """One launcher run of `steps` steps; its spec and step records."""
    from tenax.parallel.layout import ParallelLayout
    from tenax.testing.jobs import make_spec
    from tenax.testing.ranks import rank_context
    from tenax.workers.launch import launch

    model, batch = SHAPES[shape][:2]
    extra = model + [f"train.steps={steps}", f"checkpoint.every_steps={steps}",
                     "checkpoint.memory_every_steps=0", f"train.global_batch_size={batch}"]
    if tracked:
        extra += [f"logging.tensorboard_dir={root}/tb-{time.monotonic_ns()}",
                  "logging.wandb={project: tenax-bench, mode: offline}"]
    spec = make_spec(root, extra, name="tracking-bench")
    events: list[dict[str, Any]] = []
    layout = ParallelLayout(dp=2, zero=1, micro_batch_size=1)
    if not launch(spec.to_dict(), layout.to_dict(), 2, events.append, 600, rank_context()):
        raise RuntimeError(f"bench run failed: {events[-3:]}")
    return spec, [e for e in events if e["event"] == "step"]


def run_once(root: str, tracked: bool, steps: int, shape: str) -> dict[str, Any]:
    """One run's steady-state figures. Steady means after the warm-up steps and after OPEN_S
    seconds; a tiny step can finish a short run inside OPEN_S, so a run with fewer than
    MIN_STEADY steady steps is run again with STEPS_GROWTH times the steps."""
    for _ in range(RETRIES + 1):
        spec, records = launch_steps(root, tracked, steps, shape)
        steady = [e for e in records
                  if e["step"] > WARMUP and e["time"] >= records[0]["time"] + OPEN_S]
        if len(steady) >= MIN_STEADY:
            break
        logger.info("%s: %d steady steps of %d; again with %d", shape, len(steady), steps,
                    steps * STEPS_GROWTH)
        steps *= STEPS_GROWTH
    else:
        raise RuntimeError(f"{shape}: {len(steady)} steady steps even in a run of {steps}")
    tokens = spec.train.global_batch_size * spec.model.seq_len
    wall = steady[-1]["time"] - steady[0]["time"]
    return {"tracked": tracked, "steps": len(steady),
            "in_step": tokens / statistics.median(e["step_s"] for e in steady),
            "wall": tokens * (len(steady) - 1) / wall if wall > 0 else None,
            "step_s": statistics.median(e["step_s"] for e in steady)}


def descendants_cpu_s() -> float:
    """User + system CPU seconds of this process's live descendants (Linux /proc)."""
    tick, children, total = os.sysconf("SC_CLK_TCK"), {}, 0.0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append((int(entry), fields))
    todo = [os.getpid()]
    while todo:
        for pid, fields in children.get(todo.pop(), []):
            total += (int(fields[11]) + int(fields[12])) / tick
            todo.append(pid)
    return total


def writer_cpu(root: str, records: int) -> dict[str, float]:
    """CPU seconds per step record of the tracker thread and of wandb-core, after start-up."""
    from tenax.testing.jobs import make_spec
    from tenax.workers.tracking import Tracker, backends_for

    spec = make_spec(root, MODEL + [f"logging.tensorboard_dir={root}/tb-cpu",
                                    "logging.wandb={project: tenax-bench, mode: offline}"],
                     name="tracking-cpu").to_dict()
    tracker = Tracker(backends_for(spec, "tracking-cpu"), 0, spec)
    core_start = 0.0
    for step in range(1, records + 1):
        tracker.submit({"event": "step", "step": step, "loss": 4.0 - step * 1e-4, "lr": 3e-4,
                        "grad_norm": 0.5, "tokens_per_s": 7000.0, "step_s": 0.07,
                        "rank": 0, "time": time.time()})
        if step % CPU_CHUNK == 0 or step == 10:  # as many as a batch takes at a fast step
            while tracker.stats.written < step:
                time.sleep(0.0005)
        if step == 10:
            core_start, thread_start = descendants_cpu_s(), tracker.stats.cpu_s
    core = descendants_cpu_s() - core_start
    stats = tracker.close()
    return {"writer_cpu_s_per_step": (stats.cpu_s - thread_start) / (records - 10),
            "wandb_core_cpu_s_per_step": core / (records - 10),
            "open_cpu_s": stats.open_cpu_s, "failed": len(stats.failed)}


def paired_runs(shape: str, quick: bool) -> list[dict[bool, dict[str, Any]]]:
    """Off/on pairs of `shape`, alternating which runs first."""
    steps, pairs = SHAPES[shape][2 if quick else 3]
    runs = []
    with tempfile.TemporaryDirectory(prefix="tenax-tracking-") as root:
        os.environ["WANDB_DIR"] = root
        for i in range(pairs):
            order = (False, True) if i % 2 == 0 else (True, False)
            pair = {tracked: run_once(root, tracked, steps, shape) for tracked in order}
            runs.append(pair)
            logger.info("%s, pair %d: %s", shape, i, pair)
    return runs


def add_ratios(report: Report, shape: str, runs: list[dict[bool, dict[str, Any]]]) -> None:
    """The in-step and wall ratios of `shape`'s pairs (the goal: the peers' shape)."""
    goal = ">= 0.99" if shape == "peers' shape" else ""
    step_ms = 1e3 * statistics.median(p[False]["step_s"] for p in runs)
    for figure in ("in_step", "wall"):
        ratios = [ratio(p[True][figure], p[False][figure]) for p in runs]
        ratios = [r for r in ratios if r is not None]
        report.add(f"{shape}: {figure} tokens/s, tracking on ÷ off",
                   statistics.median(ratios) if ratios else None, goal,
                   f"step {step_ms:.0f} ms; median of {len(ratios)} pairs: "
                   + ", ".join(f"{r:.3f}" for r in ratios))


def main() -> int:
    args = parse_args(__doc__)
    report = Report("Tracking: tokens/s with TensorBoard + W&B offline on ÷ off")
    os.environ.update({"WANDB_SILENT": "true", "WANDB_MODE": "offline",
                       "WANDB_DISABLE_GIT": "true"})
    runs = {shape: paired_runs(shape, args.quick) for shape in SHAPES}
    with tempfile.TemporaryDirectory(prefix="tenax-tracking-cpu-") as root:
        os.environ["WANDB_DIR"] = root
        cpu = writer_cpu(root, 200 if args.quick else 1000)
    per_step = cpu["writer_cpu_s_per_step"] + cpu["wandb_core_cpu_s_per_step"]
    for shape, shape_runs in runs.items():
        add_ratios(report, shape, shape_runs)
        step_s = statistics.median(p[False]["step_s"] for p in shape_runs)
        report.add(f"{shape}: implied tokens/s ratio from the writers' CPU",
                   step_s / (step_s + per_step), ">= 0.99" if shape == "peers' shape" else "",
                   f"{1e3 * per_step:.2f} ms CPU per step (tracker thread "
                   f"{1e3 * cpu['writer_cpu_s_per_step']:.2f}, wandb-core "
                   f"{1e3 * cpu['wandb_core_cpu_s_per_step']:.2f}) vs step "
                   f"{1e3 * step_s:.0f} ms")
    report.context = {"quick": args.quick, "shapes": {k: v[:2] for k, v in SHAPES.items()},
                      "warmup": WARMUP, "open_s": OPEN_S, "runs": runs, "writer_cpu": cpu,
                      "load_avg": os.getloadavg()}
    report.finish(args.json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
