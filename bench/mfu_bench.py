"""MFU of the engine on one device, next to the planner's prediction for the same model/layout.

    python -m bench.mfu_bench [--device cpu|cuda] [--dtype float32|bfloat16] [--size smoke|gpu]
                              [--steps N] [--peak-flops F] [--json PATH] [--quick] [--compile]

`--quick`: the smoke size, 3 timed steps after 1 warm-up (explicit flags win).
`--compile`: torch.compile each transformer block (`train.compile`, parallel/compile.py). The
first step compiles, so the untimed warm-up is at least 2 steps with it (the first pays the
compile, shown in "warmup_step_s"; the timed steps start after a compiled one); the JSON records
"compile" and "compiled_blocks".

What runs: the real engine path (`tenax.parallel.parallel_model`: model built on meta,
initialised from the seed, the hand-written DataParallel over a one-rank group) and the
trainer's step recipe (micro-batches, loss scaled to the global-batch mean, finish_grads, AdamW
fused on GPUs like the trainer's, after_optimizer_step).
It deliberately imports nothing from orchestrator/ (no pydantic, no Ray) so it also runs on a
bare GPU host with only torch.

MFU = model FLOPs per token x tokens/s / peak, with FLOPs per token from
`cost_model.train_flops_per_token` (6N + 12·L·h·s: matmuls plus attention scores), the same
count the planner uses. Peak: on CPU a measured fp32 matmul rate (a smoke test: the figure
says how much of the machine's own matmul speed a training step keeps); on a GPU the vendor's
dense bf16 figure for the recognised card (`tenax.parallel.hardware`), else a measured bf16 matmul.
The planner's prediction for one GPU is its assumed sustained efficiency times the compute
share of its step-time estimate.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from tenax.testing.scripts import exit_unless_run_as_module

exit_unless_run_as_module(__spec__, __file__)  # a path run stops here, before `bench.`

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

SIZES: dict[str, dict[str, int]] = {
    # The bench shape: small enough for a shared 2-core host.
    "smoke": dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=512, seq_len=128,
                  ffn_hidden=688, micro_batch=4, accum=2),
    # ~1.3B parameters, fp32 master weights + AdamW (16 B/param, ~20 GB) and bf16 activations
    # of 8 x 2048 tokens: fills a useful part of an 80-141 GB GPU while a step stays < 1 s.
    "gpu": dict(dim=2048, n_layers=24, n_heads=16, n_kv_heads=8, vocab_size=32000, seq_len=2048,
                ffn_hidden=5632, micro_batch=8, accum=1),
}
# With --compile the first step compiles every block; a second untimed one runs compiled.
MIN_COMPILE_WARMUP = 2
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MODEL_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len", "ffn_hidden")


def model_config(dims: dict[str, int]) -> Any:
    """The engine's plain model config (the engine never sees the pydantic spec)."""
    from tenax.parallel.config import ModelArgs

    return ModelArgs(**{k: dims[k] for k in MODEL_KEYS})


@dataclass
class EngineLoop:
    """One rank's engine and the trainer's step recipe, without the job spec or data loader."""
    model_cfg: Any
    device: torch.device
    autocast: torch.dtype | None
    micro_batch: int
    accum: int
    dp: int
    zero: int = 1
    seed: int = 0
    optimizer_kind: str = "adamw"
    lr: float = 3e-4
    compile: bool = False  # torch.compile each transformer block (train.compile)
    parts: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        from tenax.parallel.layout import ParallelLayout
        from tenax.parallel.parallel_model import parallelize

        self.layout = ParallelLayout(dp=self.dp, zero=self.zero, micro_batch_size=self.micro_batch)
        self.mesh = self.layout.build_mesh(self.device.type)
        self.pm = parallelize(self.model_cfg, self.layout, self.mesh, self.seed, self.device,
                              compile=self.compile)
        self.model = self.pm.parts[0]
        params = self.pm.optimizer_params()
        if self.optimizer_kind == "sgd":
            self.optimizer: torch.optim.Optimizer = torch.optim.SGD(params, lr=self.lr)
        else:
            from tenax.parallel.parallel_model import adamw_impl  # the trainer's choice

            self.optimizer = torch.optim.AdamW(params, lr=self.lr, betas=(0.9, 0.95),
                                               weight_decay=0.1, **adamw_impl(self.device))
        self.global_batch = self.micro_batch * self.accum * self.dp
        self.global_tokens = self.global_batch * self.model_cfg.seq_len
        self.loss_scale = self.dp / self.global_tokens

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """One optimizer step on this rank's [micro*accum, seq] slice; the global mean loss."""
        from tenax.parallel.model import cross_entropy_sum

        for dp in self.pm.dps:
            dp.zero_grad()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        mb = self.micro_batch
        for i in range(self.accum):
            last = i == self.accum - 1
            for dp in self.pm.dps:
                dp.begin_micro_batch(last)
            if self.pm.fsdp:
                self.model.set_requires_gradient_sync(last)
            with torch.autocast(self.device.type, dtype=self.autocast or torch.float32,
                                enabled=self.autocast is not None):
                logits = self.model(inputs[i * mb:(i + 1) * mb])
            micro_sum, _ = cross_entropy_sum(logits, targets[i * mb:(i + 1) * mb])
            (micro_sum * self.loss_scale).backward()
            loss_sum += micro_sum.detach().double()
        for dp in self.pm.dps:
            dp.finish_grads()
        self.optimizer.step()
        for dp in self.pm.dps:
            dp.after_optimizer_step()
        dist.all_reduce(loss_sum)
        return loss_sum.item() / self.global_tokens


def synthetic_batch(n: int, seq: int, vocab: int, seed: int,
                    step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, seq] inputs and next-token targets from a seeded repeating pattern (learnable)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    period = 16
    base = torch.randint(0, vocab, (n, period), generator=g)
    tokens = base.repeat(1, (seq + 1) // period + 1)[:, :seq + 1]
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def measured_matmul_peak(device: torch.device, dtype: torch.dtype, n: int, reps: int = 10,
                         trials: int = 5) -> float:
    """FLOP/s of a square matmul, the best of `trials`: the device's practical dense peak for
    this dtype (the best, because a shared host only ever makes a trial slower)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    best = 0.0
    for _ in range(trials):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        sync(device)
        best = max(best, 2 * n ** 3 * reps / (time.perf_counter() - t0))
    return best


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def vendor_peak(device: torch.device) -> tuple[float, str]:
    """Dense bf16 FLOP/s of the recognised GPU from the hardware table; (0, '') if unknown."""
    if device.type != "cuda":
        return 0.0, ""
    try:
        from tenax.parallel.hardware import gpu_from_device_name
    except ImportError:
        return 0.0, ""
    gpu = gpu_from_device_name(torch.cuda.get_device_name(device))
    return (gpu.peak_bf16_flops, gpu.name) if gpu is not None else (0.0, "")


def planner_prediction(cfg: Any, loop: EngineLoop, peak: float,
                       gpu_mem_gib: float) -> dict[str, Any]:
    """The planner's estimate for this model pinned to one GPU and this micro-batch."""
    from tenax.parallel.cost_model import FP32_ADAMW
    from tenax.parallel.planner import Cluster, PlanOptions, plan_layout

    fixed = {"dp": 1, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero": loop.zero,
             "micro_batch_size": loop.micro_batch}
    try:
        plan = plan_layout(cfg, Cluster(1, 1, gpu_mem_gib, peak_flops=peak), PlanOptions(
            loop.global_batch, cfg.seq_len, fixed=fixed, state=FP32_ADAMW,
            dtype_bytes=2 if loop.autocast is not None else 4))
    except (ValueError, AttributeError) as exc:  # a config without the planner's methods
        return {"error": f"{type(exc).__name__}: {exc}"}
    est = plan.best.to_dict()
    return {"step_s": est["step_time"]["total_s"], "tokens_per_s": est["tokens_per_s"],
            "mfu": est.get("mfu"), "memory_gib": est["memory"]["total_gib"],
            "recompute": est["recompute"]}


def run_mfu(device: torch.device, dtype: str, size: str, steps: int, warmup: int,
            peak_flops: float | None, compile: bool = False,
            breakdown: bool = False) -> dict[str, Any]:
    """Build the engine on a one-rank group, time `steps` steps after `warmup`; the figures.
    With `compile` the warm-up is at least 2 steps: the first one compiles. `breakdown`: then
    profile 2 more steps for the device time by kernel kind (bench/step_breakdown.py)."""
    from tenax.parallel.cost_model import train_flops_per_token

    dims = SIZES[size]
    cfg = model_config(dims)
    autocast = DTYPES[dtype] if dtype != "float32" else None
    loop = EngineLoop(cfg, device, autocast, dims["micro_batch"], dims["accum"], dp=1,
                      compile=compile)
    if compile and warmup < MIN_COMPILE_WARMUP:
        logger.warning("--compile: warm-up raised from %d to %d steps (the first compiles)",
                       warmup, MIN_COMPILE_WARMUP)
        warmup = MIN_COMPILE_WARMUP
    n_params = sum(p.numel() for p in loop.pm.parameters())
    batch = loop.global_batch
    times, losses, warmup_s = [], [], []
    for step in range(warmup + steps):
        x, y = synthetic_batch(batch, cfg.seq_len, cfg.vocab_size, 0, step)
        sync(device)
        t0 = time.perf_counter()
        losses.append(loop.step(x.to(device), y.to(device)))
        sync(device)
        (times if step >= warmup else warmup_s).append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    tokens_per_s = loop.global_tokens / step_s
    flops_per_token = train_flops_per_token(n_params, cfg.n_layers, cfg.dim, cfg.seq_len)
    matmul_dtype = DTYPES[dtype]
    measured = measured_matmul_peak(device, matmul_dtype, 8192 if device.type == "cuda" else 1024)
    vendor, gpu_name = vendor_peak(device)
    peak = peak_flops or vendor or measured
    out = {"device": str(device), "device_name": torch.cuda.get_device_name(device)
           if device.type == "cuda" else "cpu", "dtype": dtype, "size": size, "model": dims,
           "params": n_params, "compile": compile, "compiled_blocks": loop.pm.compiled,
           "steps": steps, "warmup": warmup, "warmup_step_s": warmup_s, "median_step_s": step_s,
           "tokens_per_s": tokens_per_s, "flops_per_token": flops_per_token,
           "achieved_flops": flops_per_token * tokens_per_s, "peak_flops": peak,
           "peak_source": "flag" if peak_flops else (gpu_name or "measured matmul"),
           "measured_matmul_flops": measured, "mfu": flops_per_token * tokens_per_s / peak,
           "mfu_vs_measured_matmul": flops_per_token * tokens_per_s / measured,
           "losses": losses, "loss_finite": all(l == l and abs(l) != float("inf") for l in losses)}
    out.update(device_figures(device, cfg, loop, peak))
    if breakdown:
        from bench.step_breakdown import kernel_breakdown

        x, y = x.to(device), y.to(device)
        out["breakdown"] = kernel_breakdown(lambda: loop.step(x, y))
    return out


def device_figures(device: torch.device, cfg: Any, loop: EngineLoop, peak: float
                   ) -> dict[str, Any]:
    """Peak memory held (on a GPU) and the planner's prediction for the same model."""
    out: dict[str, Any] = {}
    if device.type == "cuda":
        out["max_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    mem = (torch.cuda.get_device_properties(device).total_memory / 2 ** 30
           if device.type == "cuda" else 64.0)
    out["planner"] = planner_prediction(cfg, loop, peak, mem)
    return out


def one_rank_group(device: torch.device) -> None:
    """A world-size-1 process group on loopback (nccl on cuda, gloo on cpu)."""
    from tenax.workers.rendezvous import free_port, join_process_group

    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    join_process_group(0, 1, "127.0.0.1", free_port(), 300.0, backend=backend)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="engine MFU on one device")
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None)
    parser.add_argument("--size", choices=tuple(SIZES), default=None)
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 5)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (default 2)")
    parser.add_argument("--peak-flops", type=float, default=None)
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--quick", action="store_true", help="smoke size, 3 steps, 1 warm-up")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile each transformer block (warm-up >= 2 steps)")
    parser.add_argument("--breakdown", action="store_true",
                        help="then profile 2 steps: device time by kernel kind")
    args = parser.parse_args(argv)
    quick = {"size": "smoke", "steps": 3, "warmup": 1} if args.quick else {"steps": 5, "warmup": 2}
    for name, value in quick.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    logging.basicConfig(level=logging.WARNING)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    size = args.size or ("gpu" if device.type == "cuda" else "smoke")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    one_rank_group(device)
    result = run_mfu(device, dtype, size, args.steps, args.warmup, args.peak_flops,
                     compile=args.compile, breakdown=args.breakdown)
    print(json.dumps({k: v for k, v in result.items() if k != "losses"}, indent=2))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=2)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
