"""The service-facing decisions of a job: the nodes and layout PLACING starts on, the capacity
the scheduler allots, and what a preemption asks of the job.

Pure, like the failure and recovery decisions in job_policy.py (whose `JobAction` and
`JobDecision` these return), and apart from them because they answer the cluster and the
service rather than the ranks' health.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from tenax.orchestrator.job.job_policy import JobAction, JobDecision
from tenax.orchestrator.placement.capacity import Capacity

if TYPE_CHECKING:
    from tenax.parallel import ParallelLayout

logger = logging.getLogger(__name__)

__all__ = ["ScaleDecision", "ScalingPolicy", "allotted_capacity", "preempt_decision"]


@dataclass(frozen=True)
class ScaleDecision:
    """PLACING's plan: START on `layout` (`nodes` nodes), or FAIL when there is none."""
    action: JobAction
    reason: str
    layout: "ParallelLayout | None" = None
    nodes: int = 0
    runners_up: tuple[str, ...] = ()
    recompute: str = "auto"  # the level the plan chose (and printed) for `layout`


class ScalingPolicy:
    """How many nodes to use and which layout to run on them.

    Uses the target node count clamped to [min_nodes, max_nodes] and to what is available.
    When the planner cannot use every GPU (say 6 GPUs and a global batch of 32 sequences),
    it steps down one GPU at a time — possibly leaving GPUs idle — rather than fail, and
    says so. Fails only below min_nodes or when no world size admits a valid layout.
    """

    def make_decision(self, spec: Any, capacity: Capacity, target_nodes: int) -> ScaleDecision:
        from tenax.orchestrator.spec import plan_for_spec
        from tenax.parallel import PlanError

        r = spec.resources
        nodes = min(max(target_nodes, r.min_nodes), r.max_nodes, capacity.nodes)
        if nodes < r.min_nodes:
            why = (f"only {capacity.nodes} node(s) available, "
                   f"below resources.min_nodes={r.min_nodes} {capacity.detail}")
            return ScaleDecision(JobAction.FAIL, why.strip(), nodes=nodes)
        tried = []
        for world in range(nodes * r.gpus_per_node, 0, -1):
            try:
                plan = plan_for_spec(spec, world, r.gpus_per_node, pin_zero=True,
                                     detected=capacity.gpus)
            except PlanError as err:
                tried.append(f"{world} GPUs: {str(err).splitlines()[0]}")
                continue
            used_nodes = -(-world // r.gpus_per_node)
            if used_nodes < r.min_nodes:
                break
            why = (f"{plan.layout.describe()} on {world} GPUs of {nodes} node(s)"
                   f"{gpus_text(spec, capacity)}: {plan.best.reason}")
            if tried:
                why += f" (could not use more GPUs: {tried[0]})"
            return ScaleDecision(JobAction.START, why, plan.layout, used_nodes, tuple(tried),
                                 plan.best.recompute)
        return ScaleDecision(JobAction.FAIL, "no valid layout on the available GPUs: " +
                             "; ".join(tried[:3]), nodes=nodes, runners_up=tuple(tried))


# ---- the service's requests, as the job decides them -------------------------------------
def allotted_capacity(capacity: Capacity, limit: Callable[[], int] | None) -> Capacity:
    """The cluster's capacity for a job, capped by the scheduler's allotment when there is one."""
    nodes = limit() if limit is not None else None
    if nodes is None or nodes >= capacity.nodes:
        return capacity
    return Capacity(nodes, f"(the scheduler allots {nodes} node(s) of {capacity.nodes})",
                    capacity.gpus)


def gpus_text(spec: Any, capacity: Capacity) -> str:
    """" (H200, 131.3 GiB each, as Ray names them)" when the plan took the GPUs' memory from
    the cluster; "" when the spec names it, the ranks run on CPU or Ray names no known GPU."""
    gpus = capacity.gpus
    if gpus is None or spec.resources.gpu_mem_gib or spec.resources.device == "cpu":
        return ""
    return f" ({gpus.label}, {gpus.gpu_mem_gib:.1f} GiB each, as Ray names them)"


def preempt_decision(state: str, placed: bool, reason: str,
                     cancel_requested: bool) -> JobDecision | None:
    """A preempted job stops like a planned rescale (boundary checkpoint, 0 lost steps), then
    ends instead of re-placing (the service requeues it); a job that is not training just ends."""
    if not reason or cancel_requested or state in ("SUCCEEDED", "FAILED", "CANCELLED"):
        return None
    why = f"preempted: {reason}"
    if state == "RUNNING" and placed:
        return JobDecision(JobAction.RESCALE, f"{why}; checkpointing at the next step")
    if state == "RESCALING":
        return None  # RescalePolicy finishes the stop; in PLACING the job then ends
    return JobDecision(JobAction.CANCEL, why)
