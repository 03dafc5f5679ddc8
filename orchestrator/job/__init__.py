"""tenax.orchestrator.job — one job's control loop: decide, then execute.

- `Controller`: drains requests, observes the ranks, asks the policy, executes the decision
  and moves along `TRANSITIONS`; `ControllerOptions`, what its caller decides (job id, event
  sink, drills, the scheduler's allotment), handed over at construction.
- The policy (pure): `decide(JobSnapshot) -> JobDecision` (a `JobAction` and its reason),
  within `Limits`, `restart_or_fail`; scaling_policy.py: `ScalingPolicy` (the layout for the
  nodes at hand), `preempt_decision`, `allotted_capacity`.
- States: `JobState`, `TRANSITIONS`, `DEADLINES` (each from the job's `Timeouts`),
  `next_state`, `state_diagram`.
- Accounting: `JobProgress` (what the ranks' records say), `Goodput`; stragglers:
  `StragglerTracker`, `StragglerPolicy`, `StragglerFlag`.
- Metrics: `TenaxCollector`, `MetricsServer`, `attach`, `serve_metrics`.

Names resolve lazily (PEP 562): importing this package imports neither Ray nor torch.
"""
from __future__ import annotations

from tenax.faces import lazy_face

_MODULES = {
    "controller": ("Controller",),
    "options": ("ControllerOptions",),
    "job_policy": ("JobAction", "JobDecision", "JobSnapshot", "Limits", "decide",
                   "restart_or_fail"),
    "scaling_policy": ("ScalingPolicy", "allotted_capacity", "preempt_decision"),
    "states": ("DEADLINES", "TRANSITIONS", "JobState", "next_state", "state_diagram"),
    "progress": ("JobProgress",),
    "goodput": ("Goodput",),
    "health": ("StragglerFlag", "StragglerPolicy", "StragglerTracker"),
    "health_evidence": ("straggler_evidence",),
    "profiling": ("ProfileUnavailable", "request_profile"),
    "inbox": ("Inbox",),
    "metrics": ("MetricsServer", "TenaxCollector", "attach", "serve_metrics"),
}

__all__, __getattr__, __dir__ = lazy_face(__name__, _MODULES)
