"""Real-data reading cost: training step time on an indexed dataset, a 3-way blend and with
document masks, each ÷ the same model on synthetic data; and an evaluation's cost.

    python -m bench.data_bench [--quick] [--json PATH]

Why this comparison. The data path must not slow training: the same trainer (one process, gloo,
the same model, layout and batch) steps on `synthetic` (no I/O), on an indexed dataset (ranged
reads of the .bin, token checks), on a blend of three indexed datasets (the assignment and one
read per source) and on the indexed dataset with `data.document_mask` (per-sample positions and
a [b, 1, s, s] mask through scaled_dot_product_attention instead of its causal kernel). Rows
are synthetic step time ÷ the other's (goal >= 0.98). Runs are interleaved in rounds (each
config a few steps per round, after warm-up steps) and each figure is the median of its steps,
so drift of a shared host hits every config alike; every round builds the trainers afresh.
Context rows: each loader's time to read one global batch alone, and the step ratio that
reading alone implies (step ÷ (step + its extra read time)); on a loaded host the measured
step ratios swing by more than the data path costs, and these say what the data path is.

Evaluation: one `data.validation` run of `steps` batches ÷ `steps` training steps on the same
data and model (goal <= 0.5): forward only, no backward, no optimizer.
"""
from __future__ import annotations

import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from tenax.testing.scripts import exit_unless_run_as_module

exit_unless_run_as_module(__spec__, __file__)  # a path run stops here, before `bench.`

from bench.common import Report, parse_args

logger = logging.getLogger(__name__)

MODEL = ["model.dim=128", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2",
         "model.ffn_hidden=344", "model.vocab_size=512", "model.seq_len=256",
         "train.global_batch_size=8", "parallel.micro_batch_size=4", "train.warmup_steps=0",
         "resources.device=cpu"]
EOS = 511
EVAL_STEPS = 4


def write_datasets(root: Path, n_tokens: int) -> list[str]:
    """Three indexed datasets of random documents (mean ~150 tokens) ending in EOS."""
    from tenax.workers.data import IndexedDatasetWriter

    prefixes = []
    for i in range(3):
        rng = np.random.default_rng(i)
        prefix = str(root / f"part{i}")
        with IndexedDatasetWriter(prefix, np.uint16) as writer:
            written = 0
            while written < n_tokens:
                doc = rng.integers(0, EOS, size=int(rng.integers(20, 280)))
                writer.add_document(np.append(doc, EOS))
                written += doc.size + 1
        prefixes.append(prefix)
    return prefixes


def configs(prefixes: list[str]) -> dict[str, list[str]]:
    blend = ", ".join(f"{{uri: '{p}', weight: {w}}}" for p, w in zip(prefixes, (0.5, 0.3, 0.2)))
    return {
        "synthetic": [],
        "indexed": [f"data.source={prefixes[0]}"],
        "blend3": [f"data.sources=[{blend}]"],
        "document_mask": [f"data.source={prefixes[0]}", "data.document_mask=true",
                          f"data.eos_id={EOS}"],
    }


def build(extra: list[str]) -> Any:
    from tenax.parallel.layout import ParallelLayout
    from tenax.workers.spec import load_spec
    from tenax.workers.trainer import Trainer

    spec = load_spec(overrides=MODEL + extra)
    return Trainer(spec, ParallelLayout(micro_batch_size=4))


def time_steps(trainer: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        trainer.run_step()
        out.append(time.perf_counter() - start)
    return out


def read_ms(trainer: Any, reps: int = 20) -> float:
    """Median ms to read one global batch (the loader alone, no model)."""
    out = []
    for i in range(reps):
        start = time.perf_counter()
        trainer.loader.batch(1000 + i, 0, 1)
        out.append(time.perf_counter() - start)
    return statistics.median(out) * 1e3


def step_times(prefixes: list[str], rounds: int, per_round: int,
               warmup: int) -> tuple[dict[str, float], dict[str, float]]:
    """Median step time of each config, and its loader's time to read one global batch.

    Each round builds every config's trainer afresh (in a rotated order): one trainer
    instance can be steadily slower than another of the same config (where its memory
    landed), which a fresh build per round averages out instead of pinning on one config."""
    extras = configs(prefixes)
    names = list(extras)
    times: dict[str, list[float]] = {name: [] for name in names}
    reads: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            trainer = build(extras[name])
            time_steps(trainer, warmup)
            times[name] += time_steps(trainer, per_round)
            reads[name].append(read_ms(trainer, reps=5))
            del trainer
    return ({name: statistics.median(t) for name, t in times.items()},
            {name: statistics.median(t) for name, t in reads.items()})


def eval_ratio(prefixes: list[str], rounds: int) -> tuple[float, float, float]:
    """(eval s, the same number of training steps' s, ratio): medians over `rounds`."""
    from tenax.workers.evaluation import Validator

    val = f"data.validation={{uri: '{prefixes[1]}', steps: {EVAL_STEPS}, every_steps: 100}}"
    trainer = build([f"data.source={prefixes[0]}", val])
    validator = Validator(trainer.spec)
    time_steps(trainer, 2)
    validator.run(trainer)
    evals, trains = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        validator.run(trainer)
        evals.append(time.perf_counter() - start)
        trains.append(sum(time_steps(trainer, EVAL_STEPS)))
    e, t = statistics.median(evals), statistics.median(trains)
    return e, t, e / t


def main() -> None:
    args = parse_args(__doc__)
    import torch

    from tenax.testing.ranks import init_gloo, shutdown_gloo
    from tenax.workers.rendezvous import free_port

    torch.set_num_threads(1)
    rounds, per_round, warmup = (3, 3, 1) if args.quick else (8, 8, 2)
    init_gloo(0, 1, free_port())
    report = Report("Data path: real data ÷ synthetic, evaluation ÷ training")
    try:
        with tempfile.TemporaryDirectory(prefix="tenax-data-bench-") as tmp:
            prefixes = write_datasets(Path(tmp), 400_000 if args.quick else 2_000_000)
            medians, reads = step_times(prefixes, rounds, per_round, warmup)
            eval_s, train_s, ratio = eval_ratio(prefixes, rounds)
    finally:
        shutdown_gloo()
    base = medians["synthetic"]
    report.add("synthetic step time", base * 1e3, unit="ms", note="median, context")
    for name in ("indexed", "blend3", "document_mask"):
        report.add(f"{name}: synthetic step time ÷ its step time", base / medians[name],
                   ">= 0.98", note=f"{medians[name] * 1e3:.1f} ms")
    for name, ms in reads.items():
        report.add(f"{name}: read one global batch", ms, unit="ms", note="loader alone, context")
    for name in ("indexed", "blend3"):
        # What reading alone can cost a step: the step-time rows above carry the host's noise.
        extra_ms = reads[name] - reads["synthetic"]
        report.add(f"{name}: step ÷ (step + extra read time)",
                   base * 1e3 / (base * 1e3 + max(0.0, extra_ms)), note="context")
    report.add(f"eval of {EVAL_STEPS} batches ÷ {EVAL_STEPS} training steps", ratio, "<= 0.5",
               note=f"{eval_s * 1e3:.0f} ms vs {train_s * 1e3:.0f} ms")
    report.context = {"rounds": rounds, "steps_per_round": per_round, "warmup": warmup,
                      "model": MODEL, "step_s": medians, "read_ms": reads}
    report.finish(args.json_path)


if __name__ == "__main__":
    main()
