"""Pure decisions: given a snapshot of the job, say what to do and why.

The controller gathers facts (heartbeats, Ray's view of actors and nodes, capacity) into a
snapshot, asks a policy, and only executes the answer. Keeping the decisions pure makes them
testable without Ray and keeps every reason in one place, where it is logged.

Timeouts are the spec's named fields: `heartbeat_timeout_s` (no answer to heartbeats: the
process or node is gone), `hang_timeout_s` (answers, but its step does not advance). A rank
still starting (building the model, loading a checkpoint) gets twice `hang_timeout_s` before
it counts as stuck, because loading a large checkpoint legitimately takes longer than a step.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orchestrator.spec import JobSpec
    from orchestrator.worker_group import RankHealth
    from parallel.layout import ParallelLayout

logger = logging.getLogger(__name__)

STARTUP_HANG_FACTOR = 2.0


class Action(str, Enum):
    CONTINUE = "continue"
    SUCCEED = "succeed"
    RESTART = "restart"
    FAIL = "fail"


@dataclass(frozen=True)
class JobSnapshot:
    ranks: tuple["RankHealth", ...]
    restarts: int
    max_restarts: int
    heartbeat_timeout_s: float
    hang_timeout_s: float
    gpus_per_node: int


@dataclass(frozen=True)
class FailureDecision:
    action: Action
    reason: str
    failed_ranks: tuple[int, ...] = ()  # the root-cause rank first
    cause_kind: str = ""  # dead | heartbeat | hang | error: the label of restarts_total


def _rank_problem(r: "RankHealth", snap: JobSnapshot) -> tuple[int, int, str, str] | None:
    """(priority, rank, kind, reason) of one rank's failure; lower priority = closer to root."""
    if r.dead:
        return 0, r.rank, "dead", f"rank {r.rank} died ({r.dead})"
    if r.heartbeat_age_s > snap.heartbeat_timeout_s:
        return 1, r.rank, "heartbeat", (f"rank {r.rank} missed heartbeats for {r.heartbeat_age_s:.1f} s "
                                f"(heartbeat_timeout_s={snap.heartbeat_timeout_s})")
    if r.state == "failed" and (r.error or "").startswith("rank process"):
        # The process itself died (signal, exit code): a root cause, unlike its peers' errors.
        return 0, r.rank, "dead", f"rank {r.rank} died: {r.error}"
    if r.state == "failed":
        return 3, r.rank, "error", f"rank {r.rank} failed: {r.error}"
    limit = snap.hang_timeout_s * (STARTUP_HANG_FACTOR if r.state == "starting" else 1.0)
    if r.state in ("training", "starting") and r.step_age_s > limit:
        what = "step" if r.state == "training" else "start-up"
        return 2, r.rank, "hang", (f"rank {r.rank} hung: {what} did not advance for {r.step_age_s:.1f} s "
                           f"(limit {limit:.0f} s from hang_timeout_s={snap.hang_timeout_s})")
    return None


class FailurePolicy:
    """Continue, succeed, restart (within max_restarts) or fail, from rank health alone."""

    def make_decision(self, snap: JobSnapshot) -> FailureDecision:
        if snap.ranks and all(r.state == "done" for r in snap.ranks):
            return FailureDecision(Action.SUCCEED, "every rank reached train.steps")
        problems = sorted(p for p in (_rank_problem(r, snap) for r in snap.ranks) if p)
        if not problems:
            return FailureDecision(Action.CONTINUE, "all ranks healthy")
        _, root_rank, kind, root = problems[0]
        failed = (root_rank,) + tuple(sorted({p[1] for p in problems} - {root_rank}))  # peers of a dead rank fail too; report the root cause
        if snap.restarts >= snap.max_restarts:
            return FailureDecision(Action.FAIL, f"{root}; max_restarts={snap.max_restarts} "
                                   "exhausted", failed, kind)
        return FailureDecision(Action.RESTART, root, failed, kind)


@dataclass(frozen=True)
class Capacity:
    """Whole nodes (of `gpus_per_node` slots) the job may use now."""
    nodes: int
    detail: str = ""


@dataclass(frozen=True)
class RescaleDecision:
    rescale: bool
    nodes: int
    reason: str


@dataclass(frozen=True)
class ScaleDecision:
    layout: "ParallelLayout | None"
    nodes: int
    reason: str
    runners_up: list[str] = field(default_factory=list)


class ScalingPolicy:
    """How many nodes to use and which layout to run on them.

    Uses the target node count clamped to [min_nodes, max_nodes] and to what is available.
    When the planner cannot use every GPU (say 6 GPUs and a global batch of 32 sequences),
    it steps down one GPU at a time — possibly leaving GPUs idle — rather than fail, and
    says so. Fails only below min_nodes or when no world size admits a valid layout.
    """

    def wants_rescale(self, spec: "JobSpec", current_nodes: int, target_nodes: int,
                      capacity: Capacity) -> RescaleDecision:
        """Whether a running job should re-plan now: the target moved, or nodes joined that
        bring it closer to the target. (Nodes that leave show up as failed ranks instead.)"""
        r = spec.resources
        want = min(max(target_nodes, r.min_nodes), r.max_nodes)
        reachable = min(want, capacity.nodes + 0)
        if reachable == current_nodes:
            return RescaleDecision(False, current_nodes, "at the reachable target")
        if reachable < current_nodes:
            return RescaleDecision(True, reachable, f"target {want} node(s): shrinking from "
                                   f"{current_nodes} to {reachable}")
        return RescaleDecision(True, reachable, f"target {want} node(s), {capacity.nodes} "
                               f"available: growing from {current_nodes} to {reachable}")

    def make_decision(self, spec: "JobSpec", capacity: Capacity, target_nodes: int) -> ScaleDecision:
        from parallel.planner import PlanError, plan_for_spec

        r = spec.resources
        nodes = min(max(target_nodes, r.min_nodes), r.max_nodes, capacity.nodes)
        if nodes < r.min_nodes:
            return ScaleDecision(None, nodes, f"only {capacity.nodes} node(s) available, "
                                 f"below resources.min_nodes={r.min_nodes} {capacity.detail}".strip())
        tried = []
        for world in range(nodes * r.gpus_per_node, 0, -1):
            try:
                plan = plan_for_spec(spec, world, r.gpus_per_node, pin_zero=True)
            except PlanError as err:
                tried.append(f"{world} GPUs: {str(err).splitlines()[0]}")
                continue
            used_nodes = -(-world // r.gpus_per_node)
            if used_nodes < r.min_nodes:
                break
            why = f"{plan.layout.describe()} on {world} GPUs of {nodes} node(s): {plan.best.reason}"
            if tried:
                why += f" (could not use more GPUs: {tried[0]})"
            return ScaleDecision(plan.layout, used_nodes, why, tried)
        return ScaleDecision(None, nodes, "no valid layout on the available GPUs: " +
                             "; ".join(tried[:3]), tried)
