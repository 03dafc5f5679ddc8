"""Per-step figures that need the device: MFU and the step's peak allocated memory (CUDA only).

MFU = tokens/s of the global batch x training FLOPs per token (parallel/cost_model.py
`train_flops_per_token`: 6 x active params + attention) / (world size x one GPU's dense bf16
peak, parallel/hardware.py). Only for a GPU the hardware table knows; elsewhere no `mfu` field
(a made-up peak would be a made-up MFU). The peak memory is this rank's largest allocation
during the step (the allocator's high-water mark, reset after each read: a host-side call, no
device sync).
"""
from __future__ import annotations

import logging
from typing import Any, Callable

logger = logging.getLogger(__name__)

Figures = Callable[[Any], dict[str, Any]]


def _none(result: Any) -> dict[str, Any]:
    return {}


def device_figures(trainer: Any) -> Figures:
    """A function of a step's StepResult giving `mfu` and `peak_allocated_bytes` ({} on CPU)."""
    if trainer.device.type != "cuda":
        return _none
    import torch
    import torch.distributed as dist

    from tenax.parallel import gpu_from_device_name, train_flops_per_token

    device, model = trainer.device, trainer.spec.model
    gpu = gpu_from_device_name(torch.cuda.get_device_name(device))
    flops = train_flops_per_token(model.num_params(active=True), model.n_layers, model.dim,
                                  model.seq_len)
    peak = gpu.peak_bf16_flops * dist.get_world_size() if gpu is not None else 0.0
    if not peak:
        logger.info("no MFU in step records: %s is not in the hardware table",
                    torch.cuda.get_device_name(device))
    torch.cuda.reset_peak_memory_stats(device)

    def figures(result: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"peak_allocated_bytes": int(torch.cuda.max_memory_allocated(device))}
        torch.cuda.reset_peak_memory_stats(device)
        if peak:
            out["mfu"] = round(result.tokens_per_s * flops / peak, 6)
        return out

    return figures
