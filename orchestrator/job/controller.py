"""The job controller: a transition table plus the executors of the policies' decisions.

    PENDING    | submit -> PLACING
    PLACING    | start -> RUNNING, restart -> RECOVERING, fail -> FAILED
    RUNNING    | succeed -> SUCCEEDED, restart -> RECOVERING, fail -> FAILED, rescale -> RESCALING
    RESCALING  | succeed -> SUCCEEDED, replan -> PLACING, restart -> RECOVERING, fail -> FAILED
    RECOVERING | replan -> PLACING
    any        | cancel -> CANCELLED

(`tenax.orchestrator.job.states.state_diagram()` prints this from the table; a test keeps them
equal.)

One loop iteration: drain the inbox (cancel, scale, node-lost reports from other threads),
observe (poll heartbeats, collect node probes; the ranks' records are accounted for by
`JobProgress`), take one immutable `JobSnapshot`, ask `job_policy.decide` for a `JobDecision`,
run its executor, move to `TRANSITIONS[state][action]`, logging the reason, and idle until the
next poll, a request or a training process's end. The controller never decides by itself;
PLACING's decision is the outcome of placing (a layout from `ScalingPolicy`, then start, or a
failure for `restart_or_fail`). A failure and its recovery (recording it, the node probes, the
lost nodes at REPLAN) are executed by `FailureRecovery` (failure_recovery.py).
Every state has a deadline (`states.DEADLINES`) from the job's `Timeouts`, which are derived
once from the spec and handed to everything that waits. Ranks resume from the newest committed
checkpoint (resharded into the new layout) inside the rank loop; since data order and init
depend only on (seed, sample index, name), a resumed run reproduces the clean losses.

What a caller decides (job id, event sink, drills, the scheduler's allotment, where capacity is
counted) arrives in `ControllerOptions` at construction; afterwards the controller's fields are
its own: other threads post requests (`cancel`, `scale`, `preempt`, `report_node_lost`), add
listeners (`subscribe`, `add_observer`) or, from a signal handler, `note_interrupt`.
"""
from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from tenax.orchestrator.chaos.driver import ChaosDriver
from tenax.orchestrator.job.facts import Recovery, Rescaling
from tenax.orchestrator.job.failure_recovery import FailureRecovery
from tenax.orchestrator.job.goodput import Goodput
from tenax.orchestrator.job.health import StragglerFlag, StragglerTracker
from tenax.orchestrator.job.health_evidence import publish_stragglers
from tenax.orchestrator.job.inbox import (CancelRequest, CapacityNotice, Inbox, NodeLostReport,
                                          PreemptRequest, ScaleRequest)
from tenax.orchestrator.job.job_policy import (JobAction, JobDecision, JobSnapshot, Limits,
                                               decide, restart_or_fail)
from tenax.orchestrator.job.options import ControllerOptions, Observer, Subscriber
from tenax.orchestrator.job.progress import JobProgress, committed_events
from tenax.orchestrator.job.scaling_policy import (ScalingPolicy, allotted_capacity,
                                                   preempt_decision)
from tenax.orchestrator.job.states import JobState, next_state, state_deadline_s
from tenax.orchestrator.placement.capacity import Capacity
from tenax.orchestrator.placement.placer import PLACEMENT_ERRORS, Placer
from tenax.orchestrator.placement.worker_group import WorkerGroup
from tenax.orchestrator.spec import JobSpec
from tenax.parallel import ParallelLayout
from tenax.workers import Event
from tenax.workers.tracking import TrackingStart, job_events

logger = logging.getLogger(__name__)

CAPACITY_CHECK_S = 2.0  # how often a running job looks for nodes that joined (cheap GCS call)

__all__ = ["Controller", "ControllerOptions", "JobState"]


class Controller:
    """One job's control loop (`run`), fed by requests from any thread; see the module doc."""

    def __init__(self, spec: JobSpec, options: ControllerOptions | None = None) -> None:
        options = options or ControllerOptions()
        self.spec, self.options, self.limits = spec, options, Limits.from_spec(spec)
        self.timeouts = self.limits.timeouts
        self.job_id = options.job_id or f"{spec.name}-{uuid.uuid4().hex[:8]}"
        self.subscribers: list[Subscriber] = [options.on_event] if options.on_event else []
        self.observers: list[Observer] = []  # called after every heartbeat poll (metrics)
        self.inbox = Inbox()
        self.state, self.state_since, self.cause = JobState.PENDING, time.monotonic(), ""
        self.group: WorkerGroup | None = None
        self.layout: ParallelLayout | None = None
        self.restarts, self.cancel_requested, self.preempt_reason = 0, False, ""
        self._target_nodes = spec.resources.nodes
        self._interrupted_by = "Ctrl-C"  # what a KeyboardInterrupt in run() stands for
        self.lost_slots: dict[str, int] = {}  # Ray node id -> GPU slots treated as gone
        self.recovery, self.rescaling = Recovery(), Rescaling()
        self.failures = FailureRecovery(self.job_id, spec, self.recovery, self.lost_slots,
                                        self.publish)
        self.progress = JobProgress(self.job_id, Goodput(self.state_since,
                                                         launched_at=options.launched_at),
                                    read_commits=committed_events(spec.checkpoint.uri,
                                                                  self.timeouts.probe_s))
        self.next_capacity_check = time.monotonic() + CAPACITY_CHECK_S
        # Placing and starting actors on a loaded host can take longer than a step may hang;
        # it gets the same allowance as a rank that is still starting.
        self.placer = Placer(self.job_id, spec, self.timeouts.startup_s, self.goodput.cold_start,
                             forkserver=options.forkserver,
                             tracking=lambda: TrackingStart(  # W&B's run and restart totals
                                 options.tracking_id or self.job_id, self.restarts,
                                 self.progress.lost_steps, self.progress.max_step_seen))
        ft = spec.fault_tolerance
        self.stragglers = StragglerTracker(ft.straggler_threshold, ft.straggler_action,
                                           self.timeouts.heartbeat_interval_s)
        self.new_flags: tuple[StragglerFlag, ...] = ()
        self.chaos = ChaosDriver(options.chaos) if options.chaos else None
        if self.chaos is not None:
            self.chaos.attach(self)

    # ---- requests (any thread) ---------------------------------------------------------------
    def cancel(self) -> None:
        self.inbox.post(CancelRequest())

    def scale(self, nodes: int) -> None:
        """Ask for `nodes` nodes; ValueError (naming the field) outside [min_nodes, max_nodes]."""
        r = self.spec.resources
        if not r.min_nodes <= nodes <= r.max_nodes:
            raise ValueError(f"nodes: {nodes} is outside [min_nodes={r.min_nodes}, "
                             f"max_nodes={r.max_nodes}]")
        self.inbox.post(ScaleRequest(nodes))

    def preempt(self, reason: str) -> None:
        """Stop at a checkpoint boundary and end CANCELLED with `preempted: reason`."""
        self.inbox.post(PreemptRequest(reason))

    def capacity_changed(self, reason: str) -> None:
        """The grant behind `ControllerOptions.capacity_limit` changed: look at it now."""
        self.inbox.post(CapacityNotice(reason))

    def report_node_lost(self, block: int, reason: str) -> None:
        self.inbox.post(NodeLostReport(block, reason))

    def note_interrupt(self, by: str) -> None:
        """Name what the next KeyboardInterrupt in `run()` stands for (e.g. "SIGTERM"). Safe in a
        signal handler: one attribute store, where posting to the inbox would take a lock the
        interrupted loop may hold."""
        self._interrupted_by = by

    def subscribe(self, callback: Subscriber) -> None:
        self.subscribers.append(callback)

    def add_observer(self, callback: Observer) -> None:
        """Call `callback(controller, records)` after every heartbeat poll (e.g. metrics)."""
        self.observers.append(callback)

    # ---- figures (any thread) ----------------------------------------------------------------
    @property
    def target_nodes(self) -> int:
        pending = self.inbox.pending_scale()
        return self._target_nodes if pending is None else pending

    @property
    def step(self) -> int:
        return self.progress.step

    @property
    def loss(self) -> float | None:
        return self.progress.loss

    @property
    def lost_steps(self) -> int:
        return self.progress.lost_steps

    @property
    def goodput(self) -> Goodput:
        return self.progress.goodput

    @property
    def controller_chaos_fired(self) -> set[str]:
        """Ids of the drills the chaos driver fired (what bench/soak.py audits)."""
        return set(self.chaos.fired) if self.chaos else set()

    # ---- loop --------------------------------------------------------------------------------
    def run(self) -> JobState:
        tracking = job_events(self.spec.to_dict(),  # logging.tensorboard_dir: the job's own run
                              lambda off: self.publish(off.pop("event"), **off))
        if tracking is not None:
            self.subscribe(tracking.on_event)
        try:
            while not self.state.terminal:
                self.step_once()
        except KeyboardInterrupt:
            self.cancel_requested = True
            self._stop_group()  # before the end is told: no rank may commit after it
            self._transition(JobState.CANCELLED, f"interrupted ({self._interrupted_by})")
        finally:
            self._stop_group()
            if tracking is not None:
                tracking.close()
        return self.state

    def step_once(self) -> None:
        self._drain_inbox()
        preempt = preempt_decision(self.state.value, self.group is not None, self.preempt_reason,
                                   self.cancel_requested)
        if preempt is not None:
            return self._execute(preempt)
        if self.state == JobState.PLACING and not self.cancel_requested:
            decision = self._place()
        else:
            records = self._observe()
            decision = decide(self._snapshot())
            if decision.action == JobAction.CONTINUE and not records:
                self._idle()
        self._execute(decision)

    def _drain_inbox(self) -> None:
        for request in self.inbox.drain():
            if isinstance(request, CancelRequest):
                self.cancel_requested = True
            elif isinstance(request, ScaleRequest):
                logger.info("job %s: target nodes %d -> %d (requested)", self.job_id,
                            self._target_nodes, request.nodes)
                self._target_nodes, self.next_capacity_check = request.nodes, 0.0
            elif isinstance(request, PreemptRequest):
                self.preempt_reason = request.reason
            elif isinstance(request, CapacityNotice):
                logger.info("job %s: capacity changed (%s): looking at it now", self.job_id,
                            request.reason)
                self.next_capacity_check = 0.0
            elif isinstance(request, NodeLostReport):
                self.failures.note_node_lost(request)

    def _observe(self) -> list[dict[str, Any]]:
        """Gather this state's facts: heartbeats and records, or node probe answers."""
        interval = self.timeouts.heartbeat_interval_s
        if self.state == JobState.RECOVERING:
            self.failures.probe(self.group, self._snapshot, interval)
            return []
        if self.state not in (JobState.RUNNING, JobState.RESCALING) or self.group is None:
            return []
        records = self.group.poll(interval)
        self._account(records)
        self.new_flags = tuple(self.stragglers.observe(records, self.layout.world_size))
        publish_stragglers(self.group, self.spec, self.new_flags, self.stragglers, self.publish)
        for observe in self.observers:
            observe(self, records)
        return records

    def _account(self, records: list[dict[str, Any]]) -> None:
        """The ranks' records: progress and goodput, the events they carry, and the end of a
        rescale or a recovery that rank 0's start closes."""
        for notice in self.progress.absorb(records, self.layout, self.rescaling, self.recovery):
            self.publish(notice.event, **notice.fields)
            if notice.closes == "rescale":
                self.rescaling = Rescaling()
            elif notice.closes == "recovery":
                self.recovery.failed_at = None
            elif notice.closes == "snapshots":  # later placements keep them off
                self.placer.turn_off_snapshots(str(notice.fields.get("reason", "")))

    def _snapshot(self) -> JobSnapshot:
        now = time.monotonic()
        ranks = self.recovery.health if self.state == JobState.RECOVERING else \
            tuple(self.group.health()) if self.group is not None else ()
        capacity = 0
        evicting = any(f.action == "evict" for f in self.new_flags)
        if self.state == JobState.RUNNING and (evicting or now >= self.next_capacity_check):
            self.next_capacity_check = now + CAPACITY_CHECK_S
            capacity = self.capacity().nodes
        world = self.layout.world_size if self.layout else 0
        return JobSnapshot(
            ranks=ranks, restarts=self.restarts, limits=self.limits, state=self.state.value,
            state_age_s=now - self.state_since,
            state_deadline_s=state_deadline_s(self.state, self.timeouts),
            cancel_requested=self.cancel_requested, stragglers=self.new_flags,
            capacity_nodes=capacity, current_nodes=-(-world // self.limits.gpus_per_node),
            target_nodes=self._target_nodes, **self.failures.snapshot_facts(),
            nodes_down=self.failures.nodes_down(ranks) if self.state == JobState.RUNNING else ())

    def _idle(self) -> None:
        """Nothing new: until the next heartbeat poll, a request, or a training process's end."""
        if self.state in (JobState.RUNNING, JobState.RESCALING):
            wait_s = self.timeouts.idle_s
            if self.group is not None:
                self.group.wait_for_change(wait_s, self.inbox.wake)
            else:
                self.inbox.wake.wait(wait_s)
            self.inbox.wake.clear()

    # ---- executors ---------------------------------------------------------------------------
    def _execute(self, decision: JobDecision) -> None:
        new = next_state(self.state, decision.action)
        executor = {JobAction.RESTART: self._on_failure, JobAction.FAIL: self._on_failure,
                    JobAction.SUCCEED: self._on_success, JobAction.RESCALE: self._begin_rescale,
                    JobAction.REPLAN: self._replan,
                    JobAction.CANCEL: lambda d: self._stop_group()}.get(decision.action)
        if executor is not None:
            executor(decision)
        if new != self.state:
            self._transition(new, decision.reason)

    def _transition(self, new: JobState, reason: str) -> None:
        logger.info("job %s: %s -> %s: %s", self.job_id, self.state.value, new.value, reason)
        self.state, self.state_since = new, time.monotonic()
        phase = {JobState.PLACING: "placement", JobState.RUNNING: "startup",
                 JobState.RECOVERING: "recovery", JobState.RESCALING: "recovery"}.get(new)
        if phase:
            self.goodput.begin(phase)
        else:
            self.goodput.end()
        if new == JobState.FAILED:
            self.cause = reason
        if new.terminal:  # the ranks are done or stopped: storage has every commit now
            for notice in self.progress.untold_commits():
                self.publish(notice.event, **notice.fields)
        self.publish("state", state=new.value, reason=reason)

    def publish(self, event: str, /, **fields: Any) -> None:
        """Stamp an event where it happens (now, unless `fields` carries its `time`) and hand
        it to every subscriber: the job's sink, the chaos driver, metrics."""
        doc = {**Event.make(event, **fields).to_dict(), "job": self.job_id}
        for callback in list(self.subscribers):
            callback(doc)

    def _place(self) -> JobDecision:
        """PLACING's executor: plan a layout for the capacity, place and start the ranks."""
        plan = ScalingPolicy().make_decision(self.spec, self.capacity(), self._target_nodes)
        if plan.action == JobAction.FAIL or plan.layout is None:
            return JobDecision(JobAction.FAIL, plan.reason)
        logger.info("job %s: layout decision: %s", self.job_id, plan.reason)
        self.layout = plan.layout
        try:
            reuse = self._place_and_start(plan.layout, plan.recompute)
        except PLACEMENT_ERRORS as err:
            return restart_or_fail(f"placement failed: {err}", self.restarts, self.limits,
                                   kind="placement")
        self.stragglers.reset()  # rank numbers now name other processes
        self.publish("placed", layout=plan.layout.degrees(), world_size=plan.layout.world_size,
                     reason=plan.reason, nodes=[h.node_id for h in self.group.ranks],
                     ips=[h.ip for h in self.group.ranks], blocks=plan.nodes, **reuse)
        return JobDecision(JobAction.START, f"started {plan.layout.describe()} "
                           f"({plan.layout.world_size} ranks on {plan.nodes} node(s))")

    def _place_and_start(self, layout: ParallelLayout, recompute: str = "auto") -> dict[str, Any]:
        """Place and start (orchestrator/placement/placer.py); a failure leaves no group behind.
        The ranks run the plan's `recompute` level, the one `plan.reason` printed."""
        drill = self.chaos.for_ranks() if self.chaos is not None else None  # None: production
        try:
            placed = self.placer.place(self.group, layout, drill, recompute)
        except PLACEMENT_ERRORS:
            self.group = None
            raise
        self.group, self.recovery.source = placed.group, placed.source
        if placed.notice:
            self.publish("snapshots_off", reason=placed.notice)
        return placed.reuse

    def _on_failure(self, decision: JobDecision) -> None:
        """RESTART and FAIL: record the failure (failure_recovery.py); a FAIL or a failed
        placement stops the group."""
        self.failures.record_failure(decision, self.group, self.progress.max_step_seen)
        if decision.action == JobAction.FAIL or decision.cause_kind == "placement":
            self._stop_group(keep_snapshots=decision.action != JobAction.FAIL)  # restart cold

    def _on_success(self, decision: JobDecision) -> None:
        extra = {} if self.progress.stepped else {"already_complete": True}
        self.publish("done", step=self.step, loss=self.loss, restarts=self.restarts,
                     lost_steps=self.lost_steps, goodput=self.goodput.summary(),
                     cold_start=self.goodput.cold_start.summary(), **extra)

    def _begin_rescale(self, decision: JobDecision) -> None:
        self.rescaling.since, self.rescaling.old = time.monotonic(), self.layout
        for h in self.group.ranks:
            h.actor.request_stop.remote()

    def _replan(self, decision: JobDecision) -> None:
        """REPLAN: after RESCALING the ranks stopped cleanly; after RECOVERING drop the lost
        nodes and count the restart."""
        if self.state == JobState.RESCALING:
            self.rescaling.stopped = True
            return
        self.failures.drop_lost_nodes(decision, self.group)
        self.restarts += 1
        self.failures.reset()

    def _stop_group(self, keep_snapshots: bool = False) -> None:
        if self.group is not None:
            if not keep_snapshots:  # the job ends: nothing will resume from them
                self.group.drop_snapshots(self.timeouts.probe_s)
            self.group.shutdown()
            self.group = None

    # ---- capacity and status -----------------------------------------------------------------
    def capacity(self) -> Capacity:
        counted = self.options.cluster_capacity(self.limits.gpus_per_node, self.lost_slots)
        return allotted_capacity(counted, self.options.capacity_limit)

    def status(self) -> dict[str, Any]:
        return {"job": self.job_id, "state": self.state.value, "step": self.step, "loss": self.loss,
                "layout": self.layout.degrees() if self.layout else None,
                "world_size": self.layout.world_size if self.layout else 0,
                "restarts": self.restarts, "lost_steps": self.lost_steps, "cause": self.cause,
                "goodput": self.goodput.summary()}
