"""GPU models the planner knows: peak dense bf16 FLOP/s, HBM size and bandwidth, links per GPU.

Why a table: a layout's step time, MFU and memory fit depend on the card and on the links
between cards; `tenax plan layout --gpu h100` should answer for the hardware the user will
rent, not for an implicit H100. Figures are the vendors' published datasheet values for the SXM
parts in 8-GPU HGX/DGX servers (dense, i.e. without 2:4 sparsity; NVLink per direction, which
is half the quoted bidirectional figure; one InfiniBand/RoCE NIC per GPU). Every figure can be
overridden from the CLI, since real clusters differ (PCIe parts, 200 vs 400 Gb/s NICs).
"""
from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, replace
from typing import Any

from tenax.parallel.cost_model import Link, Network

logger = logging.getLogger(__name__)

GB = 1e9
NVLINK_ALPHA_S = 1e-6
IB_ALPHA_S = 5e-6


@dataclass(frozen=True)
class GpuModel:
    name: str
    peak_bf16_flops: float      # dense
    hbm_gb: float               # vendor GB (10^9 bytes)
    hbm_bandwidth_Bps: float
    nvlink_Bps: float           # per GPU, per direction
    internode_Bps: float        # per GPU (its NIC), per direction

    @property
    def hbm_gib(self) -> float:
        return self.hbm_gb * GB / 2 ** 30

    def network(self) -> Network:
        return Network(Link(NVLINK_ALPHA_S, self.nvlink_Bps), Link(IB_ALPHA_S, self.internode_Bps))

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "hbm_gib": round(self.hbm_gib, 2)}


GPUS: dict[str, GpuModel] = {
    # A100 SXM4 80GB: 312 TFLOPS bf16, 2.039 TB/s HBM2e, NVLink 3 600 GB/s bidir, HDR 200 Gb/s.
    "a100": GpuModel("a100", 312e12, 80, 2.039e12, 300 * GB, 25 * GB),
    # H100 SXM5: 989 TFLOPS bf16, 80 GB HBM3 at 3.35 TB/s, NVLink 4 900 GB/s bidir, NDR 400 Gb/s.
    "h100": GpuModel("h100", 989e12, 80, 3.35e12, 450 * GB, 50 * GB),
    # H200 SXM: the H100 die with 141 GB HBM3e at 4.8 TB/s.
    "h200": GpuModel("h200", 989e12, 141, 4.8e12, 450 * GB, 50 * GB),
    # B200 (HGX): 2.25 PFLOPS dense bf16, 180 GB HBM3e at 8 TB/s, NVLink 5 1.8 TB/s bidir,
    # ConnectX-7 400 Gb/s.
    "b200": GpuModel("b200", 2.25e15, 180, 8e12, 900 * GB, 50 * GB),
}


def gpu_model(name: str, **overrides: float | None) -> GpuModel:
    """The table's entry for `name` with any non-None field of `overrides` replacing it."""
    key = name.lower()
    if key not in GPUS:
        raise ValueError(f"gpu: {name!r} is not one of {sorted(GPUS)}")
    changed = {k: v for k, v in overrides.items() if v is not None}
    unknown = sorted(set(changed) - set(GpuModel.__dataclass_fields__))
    if unknown:
        raise ValueError(f"gpu overrides: unknown field(s) {unknown}")
    bad = {k: v for k, v in changed.items() if not v > 0}
    if bad:
        raise ValueError(f"gpu overrides: every value must be > 0, got {bad}")
    gpu = replace(GPUS[key], **changed)
    if changed:
        logger.info("gpu %s with overrides %s", key, changed)
    return gpu


def gpu_from_device_name(device_name: str) -> GpuModel | None:
    """Recognise a CUDA device name ("NVIDIA H200", "NVIDIA A100-SXM4-80GB"); None if unknown."""
    lowered = device_name.lower()
    for key, gpu in GPUS.items():
        if key in lowered:
            return gpu
    return None


def planner_options(gpu: GpuModel) -> dict[str, Any]:
    """`planner.Cluster` keyword arguments for this GPU (peak, links, the figures to report)."""
    return {"peak_flops": gpu.peak_bf16_flops, "network": gpu.network(),
            "hardware": gpu.to_dict()}


def host_memory_bytes() -> int:
    """Physical memory of this host: CPU ranks plan with their share of it (no GPU memory)."""
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:  # psutil is optional; POSIX reports pages
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def slot_memory_gib(device: str, ranks_per_node: int, gpu_mem_gib: float = 80.0) -> float:
    """GiB one rank plans with: a CPU slot (`resources.device: cpu`) its share of the host's
    RAM (total / ranks per node), anything else the GPU's `gpu_mem_gib`."""
    if device == "cpu":
        return host_memory_bytes() / max(1, ranks_per_node) / 2 ** 30
    return gpu_mem_gib


# What Ray names a node's GPUs (its `accelerator_type:<label>` resource, set from the device
# name) -> their memory in vendor GB. Ray labels every A100 "A100" whatever its memory, so an
# unqualified A100 plans with the smaller part's 40 GB: a plan too small for an 80 GB card runs
# slower, one too large for a 40 GB card runs out of memory at the first step.
RAY_GPU_GB: dict[str, float] = {"A100": 40, "A100-40G": 40, "A100-80G": 80, "H100": 80,
                                "H200": 141, "H20": 96, "B200": 180, "L4": 24, "L40S": 48,
                                "A10G": 24, "T4": 16, "V100": 16}
RAY_ACCELERATOR_PREFIX = "accelerator_type:"


@dataclass(frozen=True)
class DetectedGpus:
    """The GPUs the planner plans with, read from the cluster (the smallest of its nodes)."""
    label: str            # Ray's accelerator type, e.g. "H200"
    gpu_mem_gib: float
    model: GpuModel | None  # the table's entry when there is one (peak FLOP/s, links)

    def options(self) -> dict[str, Any]:
        """`planner.Cluster` keyword arguments beyond the memory (none for an unknown model)."""
        return planner_options(self.model) if self.model is not None else {}


def gpus_from_ray_resources(resources: list[dict[str, float]]) -> DetectedGpus | None:
    """The smallest known GPU among nodes' Ray resources (dicts with `GPU` slots and
    `accelerator_type:<label>`); None when no node with GPUs names a type this table knows,
    or one names a type it does not (its memory is unknown: plan as for none)."""
    found: list[DetectedGpus] = []
    for res in resources:
        if not res.get("GPU"):
            continue
        labels = [k[len(RAY_ACCELERATOR_PREFIX):] for k in res
                  if k.startswith(RAY_ACCELERATOR_PREFIX)]
        known = [label for label in labels if label in RAY_GPU_GB]
        if not known:
            return None
        label = min(known, key=RAY_GPU_GB.__getitem__)
        found.append(DetectedGpus(label, RAY_GPU_GB[label] * GB / 2 ** 30,
                                  gpu_from_device_name(label)))
    return min(found, key=lambda d: d.gpu_mem_gib) if found else None
