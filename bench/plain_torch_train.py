"""The plain-torch baseline for bench/baseline_bench.py: DDP + AdamW + DCP, run under torchrun.

    python -m torch.distributed.run --nproc_per_node N bench/plain_torch_train.py \
        --steps S --ckpt-dir DIR --json OUT

What a careful user writes without Tenax: the same decoder (tenax.parallel.model, so the model code
costs the same on both sides), torch's C++ `DistributedDataParallel`, fused-by-default AdamW,
random tokens of the same shape, a DCP async save every `--every` steps (waiting for the
previous one first). Rank 0 records the wall time at the end of every step; the bench compares
the median step with Tenax's. No Tenax machinery (data loader, trainer, checkpoint manager) is
used, so the ratio is what Tenax costs.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

logger = logging.getLogger(__name__)

SHAPE = dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=512, seq_len=128,
             ffn_hidden=688)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="plain torch DDP baseline")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--json", dest="json_path", required=True)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # async_save's collectives run in a background thread: on the training group they would
    # interleave with DDP's all-reduces (a hang), so checkpoints get a group of their own.
    ckpt_group = dist.new_group(backend="gloo")
    from tenax.parallel.config import ModelArgs
    from tenax.parallel.model import build_model

    cfg = ModelArgs(**SHAPE)
    model = DistributedDataParallel(build_model(cfg, seed=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    per_rank = args.global_batch // world
    gen = torch.Generator().manual_seed(rank)
    ends, cpu, pending = [], [], None
    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, cfg.vocab_size, (per_rank, cfg.seq_len + 1), generator=gen)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size).float(),
                               tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loss.item()  # the loss a training script logs every step
        if step % args.every == 0:
            if pending is not None:
                pending.result()
            state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
            pending = dcp.async_save(state, process_group=ckpt_group,
                                     checkpoint_id=os.path.join(args.ckpt_dir, f"step-{step}"))
        ends.append(time.perf_counter())
        cpu.append(time.process_time())
    if pending is not None:
        pending.result()
    if rank == 0:
        steps = [b - a for a, b in zip(ends, ends[1:])]
        cpu_steps = [b - a for a, b in zip(cpu, cpu[1:])]
        with open(args.json_path, "w") as f:
            json.dump({"world": world, "step_s": steps,
                       "median_step_s": statistics.median(steps[2:]), "cpu_step_s": cpu_steps,
                       "mean_cpu_step_s": statistics.mean(cpu_steps[2:])}, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
