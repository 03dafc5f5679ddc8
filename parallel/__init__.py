"""tenax.parallel — the engine: layouts, the planner, the model and every kind of parallelism.

- Config: `ModelArgs`, `MoEArgs`, `RopeScalingArgs` (plain dataclasses the caller builds from
  the job spec).
- Layouts: `ParallelLayout` (degrees, rank <-> coordinates, device mesh), `layout_for`,
  `degree_problems`, `MESH_DIMS`, `SCHEDULES`.
- Planning (pure arithmetic, torch-free): `plan_layout(model, Cluster, PlanOptions)`,
  `plan_pinned`, `DEFAULT_MFU`, `estimate_layout`, `precision`, `PlanResult`, `Estimate`,
  `StepTime`; the cost model (`MemoryLedger`, `Network`, `Link`, `Comm`, `StateBytes`,
  `MIXED_ADAMW`, `FP32_ADAMW`, per-dimension `*_comm`, activation and state memory,
  `train_flops_per_token`); pipeline bubbles (`bubble_time`, `bubble_fraction`, `bubble_table`);
  GPU models (`GpuModel`, `GPUS`, `gpu_model`, `gpu_from_device_name`,
  `gpus_from_ray_resources`, `planner_options`, `slot_memory_gib`); host memory for snapshots
  (`snapshot_footprint`, `node_snapshot_footprint`, ...).
- Errors: `PlanError`, `LayoutError` (parallel/errors.py).
- The model and its parallelisms (torch): `Transformer`, `build_model`, `init_weights`,
  `cross_entropy_sum`, `canonical_param_name`; `parallelize` (applies every parallelism in
  one fixed order), the `ParallelModel` it returns and `adamw_impl` (the optimizer's flags
  per device); activation recompute (`apply_recompute`,
  `engine_recompute`, `resolve_recompute`, `SavedTensorMeter`); per-block torch.compile
  (`apply_compile`); `DataParallel`;
  `PipelineRunner`; MoE (`MoEFeedForward`, `apply_ep`, `moe_stats`, ...); context
  parallelism (`ring_attention`, `apply_cp`, zigzag splits); `CommCounter`.

Names resolve lazily (PEP 562): importing this package, `tenax.parallel.layout` or the planner
imports neither torch nor the modules behind names it does not use.
"""
from __future__ import annotations

from tenax.faces import lazy_face

_MODULES = {
    "config": ("ModelArgs", "MoEArgs", "RopeScalingArgs", "tie_problems"),
    "errors": ("LayoutError", "PlanError"),
    "layout": ("MESH_DIMS", "ParallelLayout", "SCHEDULES", "degree_problems", "layout_for"),
    "planner": ("Cluster", "DEFAULT_MFU", "PlanOptions", "estimate_layout", "plan_layout",
                "plan_pinned", "precision"),
    "estimate": ("Estimate", "PlanResult", "StepTime"),
    "cost_model": ("Comm", "FP32_ADAMW", "Link", "MIXED_ADAMW", "MemoryLedger", "Network",
                   "StateBytes", "ZERO_NAMES", "all_gather", "all_reduce", "all_to_all",
                   "attention_activation_bytes", "cp_comm", "crossing_dims", "dp_comm",
                   "ep_comm", "gib", "in_flight_microbatches", "layer_activation_bytes",
                   "mlp_activation_bytes", "model_state_memory", "pp_comm", "reduce_scatter",
                   "stage_activation_bytes", "tp_comm", "train_flops_per_token",
                   "zero_stage_ledgers"),
    "bubble": ("bubble_fraction", "bubble_table", "bubble_time"),
    "hardware": ("GPUS", "DetectedGpus", "GpuModel", "gpu_from_device_name", "gpu_model",
                 "gpus_from_ray_resources", "host_memory_bytes", "planner_options",
                 "slot_memory_gib"),
    "host_memory": ("CURSOR_RNG_BYTES", "SnapshotFootprint", "human_bytes",
                    "ledger_snapshot_bytes", "node_snapshot_footprint", "rank_snapshot_bytes",
                    "snapshot_footprint"),
    "model": ("Attention", "Transformer", "build_model", "canonical_param_name",
              "cross_entropy_sum", "init_weights", "param_seed", "rotary_cos_sin",
              "rotary_inv_freq", "tie_output"),
    "parallel_model": ("ParallelGroups", "ParallelModel", "adamw_impl", "build_groups",
                       "parallelize"),
    "recompute": ("SavedTensorMeter", "apply_recompute", "engine_recompute", "resolve_recompute"),
    "compile": ("apply_compile",),
    "pipeline_parallel": ("PipelineRunner",),
    "expert_parallel": ("MoEFeedForward", "MoEStats", "apply_ep", "is_expert_param",
                        "moe_aux_loss", "moe_layers", "moe_stats"),
    "context_parallel": ("RingCommCounter", "apply_cp", "ring_attention", "zigzag_gather",
                         "zigzag_indices", "zigzag_split"),
    "comm_counter": ("CommCounter", "collective_kind"),
    "data_parallel": ("DataParallel", "local"),
}

__all__, __getattr__, __dir__ = lazy_face(__name__, _MODULES)
