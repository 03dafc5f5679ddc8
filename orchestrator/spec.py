"""The job spec as the orchestrator sees it.

The pydantic models live in `workers/spec.py`: the rank launcher (`python -m tenax.workers.launch
JOB.yaml`) must parse specs too, and imports point one way (orchestrator -> workers ->
parallel). This module keeps `tenax.orchestrator.spec` importable for its callers and adds the
conversions only the orchestrator needs (the planner's plain inputs).
"""
from __future__ import annotations

import logging
from typing import Any

from tenax.parallel import (DEFAULT_MFU, Cluster, DetectedGpus, PlanResult, plan_pinned,
                            slot_memory_gib)
from tenax.workers import (CheckpointSpec, DataSpec, Degree, FaultToleranceSpec, JobSpec, ModelSpec,
                           MoESpec, ParallelSpec, ResourcesSpec, SpecError, TrainSpec,
                           apply_overrides, cross_field_problems, format_validation_error,
                           layout_from_spec, load_spec, parse_spec_text, spec_from_dict)

logger = logging.getLogger(__name__)

__all__ = ["CheckpointSpec", "DataSpec", "Degree", "FaultToleranceSpec", "JobSpec", "ModelSpec",
           "MoESpec", "ParallelSpec", "ResourcesSpec", "SpecError", "TrainSpec", "apply_overrides",
           "cross_field_problems", "format_validation_error", "layout_from_spec", "load_spec",
           "parse_spec_text", "plan_for_spec", "spec_for_ranks", "spec_from_dict"]


def plan_for_spec(spec: JobSpec, gpus: int, gpus_per_node: int, gpu_mem_gib: float | None = None,
                  pin_zero: bool = False, detected: DetectedGpus | None = None,
                  mfu: float = DEFAULT_MFU, **options: Any) -> PlanResult:
    """The planner's best layout honoring the spec (see `tenax.parallel.planner.plan_pinned`).
    GiB per rank: `gpu_mem_gib`, else `resources.gpu_mem_gib`, else for `resources.device:
    cpu` each slot's share of the host's RAM, else the `detected` GPUs' (whose peak and links
    the plan then uses too), else 80 (`tenax.parallel.slot_memory_gib`). `mfu`: the share of
    peak the step time assumes while computing."""
    r = spec.resources
    if detected is not None and not (gpu_mem_gib or r.gpu_mem_gib) and r.device != "cpu":
        gpu_mem_gib, options = detected.gpu_mem_gib, {**detected.options(), **options}
    mem = gpu_mem_gib or r.gpu_mem_gib or slot_memory_gib(r.device, gpus_per_node)
    return plan_pinned(spec.model.args(), spec.parallel.model_dump(), spec.train.global_batch_size,
                       spec.train.dtype, Cluster(gpus, gpus_per_node, mem, **options), pin_zero,
                       mfu)


def spec_for_ranks(spec: JobSpec, recompute: str) -> dict[str, Any]:
    """The spec handed to the ranks: `spec` with `parallel.recompute` the level the plan chose
    and printed for their layout, so that no rank resolves `auto` again with other memory than
    the plan's (an 80 GiB assumption against an H200 or a 24 GiB card)."""
    raw = spec.to_dict()
    raw["parallel"] = {**raw["parallel"], "recompute": recompute}
    return raw
