"""Tenax vs plain torch: tokens/s of the same model, data shape and checkpoint cadence.

    python -m bench.baseline_bench [--quick] [--json PATH] [--worlds 2,4] [--reps R]

Why: users compare Tenax with the script they would write themselves. The baseline is
`bench/plain_torch_train.py` under torchrun (torch's C++ DDP reducer, AdamW, DCP async save
every 10 steps); Tenax runs the same shape (dim 256, 4 layers, 8 heads, vocab 512, seq 128,
global batch 16, AdamW, a checkpoint every 10 steps) through `python -m tenax.workers.launch`, with
one micro-batch per rank (the same matmul sizes as DDP) and ZeRO 0 (DDP's own sharding). Runs
are interleaved (plain, Tenax, plain, Tenax, ...) so a noisy shared host hits both alike; each
run's median step (wall time between consecutive step ends at rank 0, checkpoint steps
included) gives tokens/s, and the figure is the median over reps of Tenax ÷ plain.
Goal: >= 0.97 at 2 ranks, >= 0.95 at 4.
"""
from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from tenax.testing.scripts import exit_unless_run_as_module

exit_unless_run_as_module(__spec__, __file__)  # a path run stops here, before `bench.`

from bench.common import Report, parse_args

logger = logging.getLogger(__name__)

GLOBAL_BATCH, EVERY = 16, 10
GOALS = {2: 0.97, 4: 0.95}


def _env() -> dict[str, str]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get(
        "PYTHONPATH")])), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")


def run_plain(world: int, steps: int, tmp: str) -> tuple[float, float]:
    out = os.path.join(tmp, f"plain-{world}.json")
    script = os.path.join(os.path.dirname(__file__), "plain_torch_train.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={world}", script,
           "--steps", str(steps), "--global-batch", str(GLOBAL_BATCH), "--every", str(EVERY),
           "--ckpt-dir", tempfile.mkdtemp(dir=tmp), "--json", out]
    subprocess.run(cmd, env=_env(), check=True, capture_output=True, timeout=900)
    with open(out) as f:
        doc = json.load(f)
    return doc["median_step_s"], doc["mean_cpu_step_s"]


def run_tenax(world: int, steps: int, tmp: str, zero: int) -> tuple[float, float]:
    log = os.path.join(tmp, f"tenax-{world}-{zero}-{os.getpid()}.jsonl")
    if os.path.exists(log):
        os.remove(log)
    sets = [f"parallel.dp={world}", f"parallel.zero={zero}",
            f"parallel.micro_batch_size={GLOBAL_BATCH // world}",
            f"train.global_batch_size={GLOBAL_BATCH}", f"train.steps={steps}",
            "train.warmup_steps=0", f"checkpoint.every_steps={EVERY}",
            f"checkpoint.uri=file://{tempfile.mkdtemp(dir=tmp)}", "resources.device=cpu",
            "resources.nodes=1", f"resources.gpus_per_node={world}"]
    cmd = [sys.executable, "-m", "tenax.workers.launch", "--nproc", str(world), "--log-json", log]
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, env=_env(), check=True, capture_output=True, timeout=900)
    times, cpu = [], []
    with open(log) as f:
        for line in f:
            event = json.loads(line)
            if event.get("event") == "step":
                times.append(event["time"])
                cpu.append(event["cpu_time"])
    deltas = [b - a for a, b in zip(times, times[1:])]
    cpu_deltas = [b - a for a, b in zip(cpu, cpu[1:])]
    return statistics.median(deltas[2:]), statistics.mean(cpu_deltas[2:])


def measure(world: int, steps: int, reps: int, tmp: str) -> dict[str, Any]:
    """Wall: median step. CPU: rank 0's mean CPU seconds per step (checkpoint steps included),
    which a shared, oversubscribed host distorts far less than wall time."""
    plain, tenax = [], []
    for rep in range(reps):
        plain.append(run_plain(world, steps, tmp))
        tenax.append(run_tenax(world, steps, tmp, zero=0))
        logger.info("world %d rep %d: plain %s, tenax %s (wall s, cpu s)", world, rep, plain[-1],
                    tenax[-1])
    # tokens/s ratio = inverse step-time ratio
    wall = [p[0] / t[0] for p, t in zip(plain, tenax)]
    cpu = [p[1] / t[1] for p, t in zip(plain, tenax)]
    return {"plain": plain, "tenax": tenax, "ratios": wall, "ratio": statistics.median(wall),
            "cpu_ratios": cpu, "cpu_ratio": statistics.median(cpu)}


def main() -> int:
    args = parse_args(__doc__, lambda p: (p.add_argument("--worlds", default="2,4"),
                                          p.add_argument("--reps", type=int, default=None)))
    steps = 25 if args.quick else 50
    reps = args.reps or (2 if args.quick else 3)
    report = Report("Tenax ÷ plain torch DDP, tokens/s of the same model and data (interleaved)")
    results = {}
    with tempfile.TemporaryDirectory(prefix="tenax-baseline-") as tmp:
        for world in (int(w) for w in args.worlds.split(",")):
            r = measure(world, steps, reps, tmp)
            results[world] = r
            report.add(f"tokens/s Tenax (tenax.workers.launch, zero 0) ÷ plain DDP, {world} ranks",
                       r["ratio"], f">= {GOALS.get(world, 0.95)}",
                       f"median steps plain {statistics.median(p[0] for p in r['plain']):.3f} s, "
                       f"Tenax {statistics.median(t[0] for t in r['tenax']):.3f} s; per rep "
                       + "/".join(f"{x:.3f}" for x in r["ratios"]))
            report.add(f"CPU s per step plain ÷ Tenax (rank 0), {world} ranks", r["cpu_ratio"],
                       f">= {GOALS.get(world, 0.95)}", "per rep " + "/".join(
                           f"{x:.3f}" for x in r["cpu_ratios"]))
    report.context = {"steps": steps, "reps": reps, "results": results}
    report.finish(args.json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
