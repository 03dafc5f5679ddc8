"""Activation recompute: held bytes and step time, measured next to the planner's figures.

    python -m bench.recompute_bench [--quick] [--steps N] [--json PATH]

For each level (none, selective, full) and two CPU-sized shapes:
- held: unique storage bytes autograd saves for backward during one micro-batch's forward
  (`SavedTensorMeter`, parameters excluded) / the planner's activation figure for that
  micro-batch (`memory_model.block_activation_bytes` x layers + `head_activation_bytes`, fp32);
- time: forward + backward of one micro-batch on one torch thread, timed as that thread's CPU
  time (a shared host's other load does not count), levels interleaved step by step, median
  of N; its ratio to `none` next to the planner's predicted ratio of compute time
  (`train_flops_per_token` with that level's recompute).
`--quick`: 3 timed steps after 1 warm-up (< 2 min on a shared 2-core host).
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from typing import Any

from tenax.testing.scripts import exit_unless_run_as_module

exit_unless_run_as_module(__spec__, __file__)  # a path run stops here, before `bench.`

import torch

from tenax.parallel import ParallelLayout, SavedTensorMeter, apply_recompute, build_model
from tenax.parallel.config import ModelArgs
from tenax.parallel.cost_model import (block_activation_bytes, head_activation_bytes,
                                       train_flops_per_token)
from tenax.parallel.pricing import activation_shape
from tenax.parallel.model import cross_entropy_sum

logger = logging.getLogger(__name__)

LEVELS = ("none", "selective", "full")
SHAPES = {
    "tiny": (ModelArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=96, seq_len=32,
                       vocab_size=128), 2),
    "bigger": (ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=688,
                         seq_len=256, vocab_size=512), 2),
}


def planner_bytes(model: ModelArgs, level: str, batch: int) -> float:
    shape = activation_shape(model, ParallelLayout(micro_batch_size=batch), 4)
    return (model.n_layers * block_activation_bytes(shape, level)
            + head_activation_bytes(shape, model.vocab_size, model.head_dim))


def predicted_ratio(model: ModelArgs, level: str) -> float:
    args = (model.num_params(active=True), model.n_layers, model.dim, model.seq_len)
    blocks = model.n_layers * model.layer_params(active=True)
    return train_flops_per_token(*args, level, blocks) / train_flops_per_token(*args, "none")


def _step(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    params = list(model.parameters())
    with SavedTensorMeter(params) as meter:
        loss, _ = cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    for p in params:
        p.grad = None
    return meter.nbytes


def measure(name: str, steps: int, warmup: int) -> dict[str, Any]:
    model_args, batch = SHAPES[name]
    models = {}
    for level in LEVELS:
        models[level] = build_model(model_args, seed=0)
        apply_recompute(models[level], level)
    tokens = torch.randint(0, model_args.vocab_size, (batch, model_args.seq_len + 1),
                           generator=torch.Generator().manual_seed(0))
    held = {level: _step(models[level], tokens) for level in LEVELS}
    times: dict[str, list[float]] = {level: [] for level in LEVELS}
    for i in range(warmup + steps):
        for level in LEVELS:
            start = time.thread_time()
            _step(models[level], tokens)
            if i >= warmup:
                times[level].append(time.thread_time() - start)
    base = statistics.median(times["none"])
    return {"shape": name, "model": model_args.to_dict(), "micro_batch": batch, "levels": {
        level: {"held_bytes": held[level], "planner_bytes": planner_bytes(model_args, level, batch),
                "held_ratio": held[level] / planner_bytes(model_args, level, batch),
                "step_s": statistics.median(times[level]),
                "time_ratio": statistics.median(times[level]) / base,
                "predicted_time_ratio": predicted_ratio(model_args, level)}
        for level in LEVELS}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="activation recompute: bytes and time")
    parser.add_argument("--quick", action="store_true", help="3 timed steps, 1 warm-up")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args(argv)
    steps = args.steps or (3 if args.quick else 10)
    torch.manual_seed(0)
    torch.set_num_threads(1)  # thread CPU time then measures all of the step's compute
    results = [measure(name, steps, 1) for name in SHAPES]
    print(f"{'shape':8} {'level':10} {'held MiB':>9} {'planner MiB':>11} {'held/plan':>9} "
          f"{'step s':>8} {'t/t_none':>8} {'predicted':>9}")
    for res in results:
        for level, r in res["levels"].items():
            print(f"{res['shape']:8} {level:10} {r['held_bytes'] / 2**20:9.3f} "
                  f"{r['planner_bytes'] / 2**20:11.3f} {r['held_ratio']:9.3f} {r['step_s']:8.4f} "
                  f"{r['time_ratio']:8.3f} {r['predicted_time_ratio']:9.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
