"""tenax.workers — what runs on a job's GPUs (rank slots), and the job spec it runs from.

- The job spec: the pydantic `JobSpec` and its sections, `load_spec`, `spec_from_dict`,
  `parse_spec_text`, `apply_overrides`, `layout_from_spec`; model presets (`PRESETS`,
  `preset_model`); `SpecError`, `ZygoteError` (workers/errors.py: every exception of this layer).
- The rank agent: `RankWorker`, the Ray actor that owns one rank slot and forks its training
  process; `RankRun`, what it is told to start; `RankStatus`, what it reports; `Zygote`, the
  Ray actor per node block whose forkserver every training process there forks from;
  `NodeForkServer` (one a launcher starts before its embedded Ray), `PRELOAD` (what it imports).
- The rank loop: `run_rank(RankOptions, RankHooks)` (workers/rank.py), the per-rank training
  loop both the agents and the local launcher (workers/launch.py) run; `FaultHook`;
  `MemoryOptions`, the in-memory snapshots the placement decided on.
- Fault injection for drills: `ChaosEvent`, `RankChaos` (the one object a drill hands the
  workers; None in production), `ChaosInjector`.
- Events: `Event`, `stamp`, `human`, `layout_text`; `prepare_token_file` (the flat token file).
- Hang evidence (workers/diagnostics.py): `dump_stacks` (an agent asks its training process
  for every thread's stack), `read_stacks`, `diagnose` -> `Diagnosis` (the odd rank out);
  a straggler's samples: `join_samples`, `read_evidence` (each rank's role), `place_shares`,
  `compare_roles`; where evidence and profiles go: `diagnostics_location`. Profiling a window
  of steps (workers/profiling.py): `parse_profile_steps`.
- Experiment tracking: the sub-package `tenax.workers.tracking` (TensorBoard, W&B).
- The validation loop (`data.validation`) is `tenax.workers.evaluation` (`Validator`,
  `EvalResult`, the `eval` event): like the data loader, a training process's module (torch).

Names resolve lazily (PEP 562): importing this package, or `tenax.workers.worker` in an agent,
imports neither torch nor the modules behind names it does not use.
"""
from __future__ import annotations

from tenax.faces import lazy_face

_MODULES = {
    "spec": ("JobSpec", "ModelSpec", "MoESpec", "ParallelSpec", "TrainSpec", "DataSpec",
             "CheckpointSpec", "ResourcesSpec", "FaultToleranceSpec", "BlendSourceSpec",
             "ValidationSpec", "load_spec",
             "spec_from_dict", "parse_spec_text", "apply_overrides", "layout_from_spec", "Degree",
             "cross_field_problems", "format_validation_error"),
    "data": ("prepare_token_file",),
    "presets": ("PRESETS", "preset_model"),
    "errors": ("SpecError", "ZygoteError"),
    "worker": ("RankWorker", "RankRun", "RankStatus"),
    "zygote": ("Zygote", "NodeForkServer", "PRELOAD"),
    "rank": ("RankOptions", "RankHooks", "FaultHook", "run_rank"),
    "memory_options": ("MemoryOptions",),
    "snapshot_keeper": ("ReplicaTerms",),
    "replica_auth": ("new_job_secret",),
    "chaos_injector": ("ChaosEvent", "ChaosInjector", "RankChaos"),
    "preflight_links": ("LinkProbe", "LinkTask"),
    "events": ("Event", "human", "layout_text", "stamp"),
    "diagnostics": ("EVIDENCE_FILE", "Diagnosis", "compare_roles", "diagnose",
                    "diagnostics_location", "dump_stacks", "join_samples", "place_shares",
                    "read_evidence", "read_stacks"),
    "profiling": ("parse_profile_steps",),
}

__all__, __getattr__, __dir__ = lazy_face(__name__, _MODULES)
