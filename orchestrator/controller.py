"""The job controller: an explicit state machine that executes the policies' decisions.

    PENDING -> PLACING -> RUNNING -> SUCCEEDED
                  ^          |  \\-> FAILED / CANCELLED
                  |          v
                  +----- RECOVERING (stop group, count restart, drop lost nodes)

One transition per loop iteration, each logged with its reason. The controller never decides
by itself: `FailurePolicy` reads rank health, `ScalingPolicy` picks nodes and layout, and the
controller only places workers, starts them, stops them and reports. Ranks resume from the
newest committed checkpoint (resharded into the new layout) inside `run_rank`, and because data
order and init depend only on (seed, sample index, name), the resumed run reproduces the clean
run's losses exactly.
"""
from __future__ import annotations

import logging
import time
import uuid
from enum import Enum
from typing import Any, Callable

import ray

from orchestrator.capacity import cluster_capacity, node_answers
from orchestrator.chaos import ChaosEvent, ChaosLedger
from orchestrator.goodput import Goodput
from orchestrator.health import StragglerFlag, StragglerTracker, eviction_plan
from orchestrator.policies import (STARTUP_HANG_FACTOR, Action, Capacity, FailureDecision,
                                   FailurePolicy, JobSnapshot, ScalingPolicy)

CAPACITY_CHECK_S = 2.0  # how often a running job looks for nodes that joined (cheap GCS call)
from orchestrator.spec import JobSpec
from orchestrator.worker_group import PlacementError, WorkerGroup
from parallel.layout import ParallelLayout

logger = logging.getLogger(__name__)


class JobState(str, Enum):
    PENDING = "PENDING"
    PLACING = "PLACING"
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"
    RESCALING = "RESCALING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


class Controller:
    def __init__(self, spec: JobSpec, chaos: list[ChaosEvent] | None = None,
                 on_event: Callable[[dict[str, Any]], None] | None = None,
                 job_id: str | None = None) -> None:
        self.spec, self.chaos = spec, list(chaos or [])
        self.job_id = job_id or f"{spec.name}-{uuid.uuid4().hex[:8]}"
        self.on_event = on_event or (lambda event: None)
        self.failure_policy, self.scaling_policy = FailurePolicy(), ScalingPolicy()
        self.state = JobState.PENDING
        self.group: WorkerGroup | None = None
        self.layout: ParallelLayout | None = None
        self.restarts, self.lost_steps = 0, 0
        self.step, self.loss, self.max_step_seen = 0, None, 0
        self.target_nodes = spec.resources.nodes
        self.lost_slots: dict[str, int] = {}  # Ray node id -> GPU slots treated as gone
        self.failure: FailureDecision | None = None
        self.failed_at: float | None = None
        self.cause = ""
        self.cancel_requested = False
        self.ledger = None
        self.head_node = ""
        self.controller_chaos_fired: set[str] = set()
        self.submitted_at = time.monotonic()
        self.goodput = Goodput(self.submitted_at)
        self.next_capacity_check = time.monotonic() + CAPACITY_CHECK_S
        self.rescale_from: tuple[ParallelLayout, float] | None = None
        self.scale_pending: dict[str, Any] | None = None
        self.stragglers = StragglerTracker.from_spec(spec.fault_tolerance)
        # Called after every heartbeat poll with (controller, records), e.g. metrics.observe.
        self.observers: list[Callable[["Controller", list[dict[str, Any]]], None]] = []

    # ---- loop --------------------------------------------------------------------------------
    def run(self) -> JobState:
        try:
            while not self.state.terminal:
                self.step_once()
        except KeyboardInterrupt:
            self.cancel_requested = True
            self._transition(JobState.CANCELLED, "interrupted by the user (Ctrl-C)")
        finally:
            self._stop_group()
        return self.state

    def step_once(self) -> None:
        if self.cancel_requested and not self.state.terminal:
            self._stop_group()
            self._transition(JobState.CANCELLED, "cancel requested")
            return
        handler = {JobState.PENDING: self._pending, JobState.PLACING: self._placing,
                   JobState.RUNNING: self._running, JobState.RECOVERING: self._recovering,
                   JobState.RESCALING: self._rescaling}
        handler[self.state]()

    def cancel(self) -> None:
        self.cancel_requested = True

    def scale(self, nodes: int) -> None:
        """Set the target node count (clamped to [min_nodes, max_nodes] by the policy)."""
        r = self.spec.resources
        if not r.min_nodes <= nodes <= r.max_nodes:
            raise ValueError(f"nodes: {nodes} is outside [min_nodes={r.min_nodes}, "
                             f"max_nodes={r.max_nodes}]")
        logger.info("job %s: target nodes %d -> %d (requested)", self.job_id, self.target_nodes, nodes)
        self.target_nodes = nodes
        self.next_capacity_check = 0.0

    def _transition(self, new: JobState, reason: str) -> None:
        logger.info("job %s: %s -> %s: %s", self.job_id, self.state.value, new.value, reason)
        self.state = new
        phase = {JobState.PLACING: "placement", JobState.RUNNING: "startup",
                 JobState.RECOVERING: "recovery", JobState.RESCALING: "recovery"}.get(new)
        if phase:
            self.goodput.begin(phase)
        else:
            self.goodput.end()
        self.emit({"event": "state", "state": new.value, "reason": reason})
        if new == JobState.FAILED:
            self.cause = reason

    def emit(self, event: dict[str, Any]) -> None:
        self.on_event({**event, "job": self.job_id})

    # ---- states ------------------------------------------------------------------------------
    def _pending(self) -> None:
        self.ledger = ray.remote(ChaosLedger).options(num_cpus=0).remote()
        # The driver runs on the head node; a `kill node` drill must never take it down.
        self.head_node = ray.get_runtime_context().get_node_id()
        self._transition(JobState.PLACING, f"submitted: target {self.target_nodes} node(s) x "
                         f"{self.spec.resources.gpus_per_node} GPUs")

    def _placing(self) -> None:
        decision = self.scaling_policy.make_decision(self.spec, self.capacity(), self.target_nodes)
        if decision.layout is None:
            self._transition(JobState.FAILED, decision.reason)
            return
        logger.info("job %s: layout decision: %s", self.job_id, decision.reason)
        self.layout = decision.layout
        try:
            reuse = self._place_and_start(decision.layout)
        except (PlacementError, ray.exceptions.RayError, TimeoutError) as err:
            self._fail_or_retry(f"placement failed: {err}", "placement")
            return
        self.stragglers.reset()  # rank numbers now name other processes
        self.emit({"event": "placed", "layout": decision.layout.degrees(),
                   "world_size": decision.layout.world_size, "reason": decision.reason,
                   "nodes": [h.node_id for h in self.group.ranks],
                   "ips": [h.ip for h in self.group.ranks], **reuse})
        self._transition(JobState.RUNNING, f"started {decision.layout.describe()} "
                         f"({decision.layout.world_size} ranks on {decision.nodes} node(s))")

    def _place_and_start(self, layout: ParallelLayout) -> dict[str, Any]:
        """Warm: reuse live actors and fork new training processes. Cold fallback: new group."""
        # Placing and starting actors on a loaded host can take longer than a step may hang;
        # it gets the same allowance as a rank that is still starting.
        timeout = STARTUP_HANG_FACTOR * self.spec.fault_tolerance.hang_timeout_s
        chaos = [e.to_dict() for e in self.chaos]
        if self.group is None:
            self.group = WorkerGroup(self.job_id, self.spec.resources.gpus_per_node)
        try:
            reuse = self.group.create(layout, timeout)
            self.group.start(self.spec.to_dict(), chaos, self.ledger, timeout, self.head_node)
            return {**reuse, "mode": "warm" if reuse["reused"] else "cold"}
        except (PlacementError, ray.exceptions.RayError, TimeoutError) as err:
            if not self.group.blocks and not self.group.ranks:
                raise
            logger.warning("job %s: warm re-join failed (%s); falling back to a cold start",
                           self.job_id, err)
        self._stop_group()
        self.group = WorkerGroup(self.job_id, self.spec.resources.gpus_per_node)
        reuse = self.group.create(layout, timeout)
        self.group.start(self.spec.to_dict(), chaos, self.ledger, timeout, self.head_node)
        return {**reuse, "mode": "cold"}

    def _running(self) -> None:
        interval = self.spec.fault_tolerance.heartbeat_interval_s
        records = self.group.poll(interval)
        self._absorb(records)
        evict = self._watch_health(records)
        self._maybe_controller_chaos()
        snap = JobSnapshot(tuple(self.group.health()), self.restarts,
                           self.spec.fault_tolerance.max_restarts,
                           self.spec.fault_tolerance.heartbeat_timeout_s,
                           self.spec.fault_tolerance.hang_timeout_s, self.spec.resources.gpus_per_node)
        decision = self.failure_policy.make_decision(snap)
        if decision.action == Action.CONTINUE and evict is not None:
            decision = evict
        if decision.action == Action.CONTINUE and self._maybe_rescale():
            return
        if decision.action == Action.CONTINUE:
            time.sleep(max(0.0, interval - 0.05) if not records else 0.0)
        elif decision.action == Action.SUCCEED:
            self.emit({"event": "done", "step": self.step, "loss": self.loss,
                       "restarts": self.restarts, "lost_steps": self.lost_steps,
                       "goodput": self.goodput.summary()})
            self._transition(JobState.SUCCEEDED, decision.reason)
        else:
            self._on_failure(decision)

    def _maybe_rescale(self) -> bool:
        if time.monotonic() < self.next_capacity_check:
            return False
        self.next_capacity_check = time.monotonic() + CAPACITY_CHECK_S
        current = -(-self.layout.world_size // self.spec.resources.gpus_per_node)
        want = self.scaling_policy.wants_rescale(self.spec, current, self.target_nodes,
                                                 self.capacity())
        if not want.rescale:
            return False
        self.rescale_from = (self.layout, time.monotonic())
        for h in self.group.ranks:
            h.actor.request_stop.remote()
        self._transition(JobState.RESCALING, want.reason + "; checkpointing at the next step")
        return True

    def _rescaling(self) -> None:
        """Wait until every rank committed the boundary checkpoint and stopped, then re-plan."""
        self._absorb(self.group.poll(self.spec.fault_tolerance.heartbeat_interval_s))
        health = self.group.health()
        if all(r.state == "stopped" for r in health):
            old, _ = self.rescale_from
            self.scale_pending = {"from": old.degrees(), "from_world": old.world_size}
            self._transition(JobState.PLACING, f"all ranks stopped at step {self.step}")
            return
        snap = JobSnapshot(tuple(r for r in health if r.state != "stopped"), self.restarts,
                           self.spec.fault_tolerance.max_restarts,
                           self.spec.fault_tolerance.heartbeat_timeout_s,
                           self.spec.fault_tolerance.hang_timeout_s, self.spec.resources.gpus_per_node)
        decision = self.failure_policy.make_decision(snap)
        if decision.action in (Action.RESTART, Action.FAIL):
            self._on_failure(decision)

    def _watch_health(self, records: list[dict[str, Any]]) -> FailureDecision | None:
        """Straggler windows and observers after each poll; an `evict` straggler -> restart."""
        evict = None
        for flag in self.stragglers.observe(records, self.layout.world_size):
            self.emit({"event": "straggler", "rank": flag.rank, "score": flag.score,
                       "action": flag.action, "node": self.group.ranks[flag.rank].node_id})
            if flag.action == "evict" and evict is None:
                evict = self._evict(flag)
        for observe in self.observers:
            observe(self, records)
        return evict

    def _evict(self, flag: StragglerFlag) -> FailureDecision | None:
        """Restart without the straggler's node block, unless that would stop the job."""
        node, ranks, reason = eviction_plan(flag, [h.node_id for h in self.group.ranks],
                                            self.spec.resources.gpus_per_node)
        if self.restarts >= self.spec.fault_tolerance.max_restarts or \
                self.capacity().nodes - 1 < self.spec.resources.min_nodes:
            logger.warning("job %s: not evicting: %s; no restart or node to spare", self.job_id, reason)
            return None
        self.lost_slots[node] = self.lost_slots.get(node, 0) + len(ranks)
        self.group.mark_lost(node)
        return FailureDecision(Action.RESTART, reason, ranks, "straggler")

    def _on_failure(self, decision: FailureDecision) -> None:
        self.failure, self.failed_at = decision, time.monotonic()
        self.emit({"event": "failure", "step": self.max_step_seen, "rank": decision.failed_ranks[0],
                   "ranks": list(decision.failed_ranks), "cause": decision.reason,
                   "kind": decision.cause_kind})
        if decision.action == Action.FAIL:
            self._stop_group()
            self._transition(JobState.FAILED, decision.reason)
        else:
            self._transition(JobState.RECOVERING, decision.reason)

    def _recovering(self) -> None:
        self._mark_lost_nodes()
        self.restarts += 1
        self._transition(JobState.PLACING, f"restart {self.restarts}/"
                         f"{self.spec.fault_tolerance.max_restarts} after: {self.failure.reason}")

    def _fail_or_retry(self, reason: str, kind: str) -> None:
        self._stop_group()
        if self.restarts >= self.spec.fault_tolerance.max_restarts:
            self._transition(JobState.FAILED, f"{reason}; max_restarts exhausted")
            return
        self.failure = FailureDecision(Action.RESTART, reason, (), kind)
        self.failed_at = self.failed_at or time.monotonic()
        self._transition(JobState.RECOVERING, reason)

    def _stop_group(self) -> None:
        if self.group is not None:
            self.group.shutdown()
            self.group = None

    # ---- records -----------------------------------------------------------------------------
    def _absorb(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            kind = record.get("event")
            if kind == "started" and record["rank"] == 0:
                self.goodput.end()  # startup is over: what follows is training
                self.step = max(self.step, record["step"])  # a resumed job starts here
                self._on_started(record)
            elif kind == "step":
                self.max_step_seen = max(self.max_step_seen, record["step"])
                if record["rank"] == 0:
                    self.step, self.loss = record["step"], record["loss"]
                    self.goodput.step(record.get("step_s", 0.0))
                    self.emit({k: v for k, v in record.items() if k != "rank"})
            elif kind in ("checkpoint", "checkpoint_failed") and record["rank"] == 0:
                self.goodput.checkpoint_blocked(record.get("blocked_s", 0.0))
                self.emit({k: v for k, v in record.items() if k != "rank"})

    def _on_started(self, record: dict[str, Any]) -> None:
        if self.scale_pending is not None and self.rescale_from is not None:
            self.emit({"event": "scaled", "step": record["step"], **self.scale_pending,
                       "layout": self.layout.degrees(), "world_size": self.layout.world_size,
                       "seconds": round(time.monotonic() - self.rescale_from[1], 3),
                       "lost_steps": max(0, self.max_step_seen - record["step"])})
            self.scale_pending = self.rescale_from = None
        if self.failed_at is None:
            return
        resumed = record["step"]
        lost = max(0, self.max_step_seen - resumed)
        self.lost_steps += lost
        self.goodput.lost_steps(lost)
        self.emit({"event": "recovered", "step": resumed, "layout": self.layout.degrees(),
                   "world_size": self.layout.world_size, "lost_steps": lost,
                   "seconds": round(time.monotonic() - self.failed_at, 3)})
        self.failed_at = None

    # ---- capacity ----------------------------------------------------------------------------
    def capacity(self) -> Capacity:
        return cluster_capacity(self.spec.resources.gpus_per_node, self.lost_slots)

    def _mark_lost_nodes(self) -> None:
        """A node-sized block is lost when a chaos `kill node` targeted it, or when every one of
        its ranks is gone and its Ray node does not answer a probe."""
        if self.group is None or self.failure is None:
            return
        failed, g = set(self.failure.failed_ranks), self.spec.resources.gpus_per_node
        health = {r.rank: r for r in self.group.health()}
        for k in range(-(-len(self.group.ranks) // g)):
            block = self.group.ranks[k * g:(k + 1) * g]
            if not block:
                continue
            timeout = self.spec.fault_tolerance.heartbeat_timeout_s
            # A block that has been silent for a whole heartbeat timeout needs no second wait.
            silent = all(health[h.rank].heartbeat_age_s > timeout for h in block)
            if not self._chaos_killed(k) and not silent:
                if not all(h.rank in failed for h in block) or node_answers(block[0].node_id, timeout):
                    continue
            node = block[0].node_id
            self.lost_slots[node] = self.lost_slots.get(node, 0) + len(block)
            self.group.mark_lost(node)
            logger.warning("job %s: node block %d (Ray node %s) lost", self.job_id, k, node[:8])

    def _chaos_killed(self, node_block: int) -> bool:
        """Whether a not yet accounted `kill node` drill hit this block (consumes it)."""
        for e in self.chaos:
            if e.kind == "kill" and e.node == node_block and e.at <= self.max_step_seen + 1 \
                    and e.id not in self.controller_chaos_fired:
                self.controller_chaos_fired.add(e.id)
                return True
        return False

    def _maybe_controller_chaos(self) -> None:
        for e in self.chaos:
            if e.kind == "scale" and e.id not in self.controller_chaos_fired \
                    and self.max_step_seen + 1 >= e.at:
                self.controller_chaos_fired.add(e.id)
                self.emit({"event": "chaos", "kind": e.kind, "detail": f"target nodes {e.nodes}"})
                self.scale(e.nodes)
            if e.kind == "corrupt-checkpoint" and e.id not in self.controller_chaos_fired \
                    and self.max_step_seen + 1 >= e.at:
                self.controller_chaos_fired.add(e.id)
                from orchestrator.chaos import corrupt_newest_checkpoint

                self.emit({"event": "chaos", "kind": e.kind,
                           "detail": corrupt_newest_checkpoint(self.spec.checkpoint.uri)})

    def status(self) -> dict[str, Any]:
        return {"job": self.job_id, "state": self.state.value, "step": self.step, "loss": self.loss,
                "layout": self.layout.degrees() if self.layout else None,
                "world_size": self.layout.world_size if self.layout else 0,
                "restarts": self.restarts, "lost_steps": self.lost_steps, "cause": self.cause,
                "goodput": self.goodput.summary()}
