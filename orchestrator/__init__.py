"""tenax.orchestrator — runs jobs: one job's controller, placement and recovery, the
`tenax serve` service, the command line, and drills.

- One job: `Controller` (the control loop: a transition table executing the policies'
  decisions), `ControllerOptions` (what its caller decides, handed over at construction),
  `JobState`.
- The job spec as the orchestrator sees it: `JobSpec`, `load_spec`, `spec_from_dict`,
  `parse_spec_text`, `plan_for_spec`, `SpecError`; model presets `PRESETS`, `preset_model`.
- `Timeouts`: every bound a job waits with, derived once from its spec.
- The service: `JobManager` (one controller thread per job), `JobStore`, `JobServer`,
  `ServeConfig`, `serve`.
- The command line: `main` (`tenax`), `run_job` (`tenax run`).
- Errors: every exception of this layer (orchestrator/errors.py), importable alone.
- `loopback_env`: the environment that keeps a local Ray on 127.0.0.1 and starts it without
  an idle second (before `import ray`); `prompt_node_start`: a node started here is used as
  soon as its raylet registers.

Rooms, bottom to top: the base modules above, `chaos` (drills), `placement` (worker group,
placer, capacity, recovery source), `job` (controller, policies, states, health, metrics),
`service` (gRPC, jobs, scheduler, store), `cli`; each room's face lists its names. Names
resolve lazily (PEP 562): importing this package imports neither Ray nor torch, nor the modules
behind names it does not use.
"""
from __future__ import annotations

from tenax.faces import lazy_face

_MODULES = {
    "errors": ("ChaosError", "PlacementError", "PreflightInterrupted", "ProfileUnavailable",
               "RayNodesTimeout", "RpcAbort", "RpcFailed", "StorageRootError", "StoreError",
               "SubmitError"),
    "spec": ("JobSpec", "SpecError", "load_spec", "parse_spec_text", "plan_for_spec",
             "spec_from_dict"),
    "presets": ("PRESETS", "preset_model"),
    "timeouts": ("STARTUP_HANG_FACTOR", "Timeouts"),
    "loopback": ("loopback_env", "prompt_node_start"),
    "job.controller": ("Controller",),
    "job.options": ("ControllerOptions",),
    "job.states": ("JobState",),
    "service.jobs": ("JobManager",),
    "service.store": ("JobStore",),
    "service.server": ("JobServer", "ServeConfig", "serve"),
    "cli.main": ("main",),
    "cli.runner": ("run_job",),
}

__all__, __getattr__, __dir__ = lazy_face(__name__, _MODULES)
