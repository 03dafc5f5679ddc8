"""Where a training step's device time goes: kernel time by kind, from one profiled run.

`kernel_breakdown(run_step)` profiles `run_step()` a few times with torch.profiler and sums the
device kernels' time by kind: matmul (GEMM), attention (flash / memory-efficient kernels),
optimizer (multi-tensor and fused AdamW), fused (kernels torch.compile generated), collective
(NCCL) and other (elementwise, norms, reductions, copies). Set against the step's wall time it
says what the gap between MFU and the matmul peak is made of: idle device time (the host
launching too slowly, or waiting), non-matmul kernels, and matmuls below the peak.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)

# Lower-case substrings of kernel names, first match wins (the order matters: a flash
# attention kernel's name may contain "gemm")
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn_generated_fort_native_sdpa")),
    ("collective", ("nccl",)),
    ("optimizer", ("adam", "multi_tensor_apply", "fused_adamw")),
    ("matmul", ("gemm", "cutlass", "xmma", "sm90_", "sm80_", "cublas", "nvjet")),
    ("fused", ("triton",)),
)


def kind_of(kernel_name: str) -> str:
    name = kernel_name.lower()
    for kind, needles in KINDS:
        if any(n in name for n in needles):
            return kind
    return "other"


def kernel_breakdown(run_step: Callable[[], Any], steps: int = 2) -> dict[str, Any]:
    """Profile `steps` calls of `run_step` (each must end with the device idle, e.g. on a
    loss's .item()); device kernel seconds per step by kind, the step's wall seconds, and
    the share of the wall each kind and the idle device take."""
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return {"available": False, "why": "no CUDA device: kernel times are device times"}
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            run_step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    seconds: dict[str, float] = {}
    top: dict[str, float] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        kind = kind_of(event.name)
        took = event.time_range.elapsed_us() / 1e6 / steps  # a kernel: its own span
        seconds[kind] = seconds.get(kind, 0.0) + took
        key = f"{kind}: {event.name[:80]}"
        top[key] = top.get(key, 0.0) + took
    busy = sum(seconds.values())
    share = {kind: s / wall for kind, s in seconds.items()}
    share["idle"] = max(0.0, 1.0 - busy / wall)
    largest = dict(sorted(top.items(), key=lambda kv: -kv[1])[:12])
    return {"available": True, "wall_s": wall, "kernel_s": seconds, "share_of_wall": share,
            "largest_kernels_s": largest, "steps": steps}
