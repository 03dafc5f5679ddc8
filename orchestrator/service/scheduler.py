"""Executes the scheduler's decisions in `tenax serve`: the queue, allotments, events, autoscaler.

The policy (orchestrator/service/scheduling_policy.py) is pure; this module gathers its
snapshot (the queue, every admitted job's allotment and placement, the Ray cluster's GPU slots)
and carries out what
it returns: admit (start a controller limited to its allotment), refuse/expire (FAILED with the
reason), shrink/grow (change the allotment: the controller's capacity check then runs the same
planned re-plan as `tenax scale`), preempt (a planned stop at a checkpoint boundary; the job's
runner requeues it). Every decision that changes something is logged and stored as an event.

One pass runs at every submission (so a job that fits starts within the SubmitJob call and a
job that never fits is refused by it) and once a second on the dispatcher's thread, or sooner
when a job ends. While jobs wait, the missing GPUs are asked of Ray's autoscaler
(`ray.autoscaler.sdk.request_resources`) and the request is withdrawn once nothing waits.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tenax.orchestrator.errors import RayNodesTimeout
from tenax.orchestrator.placement.capacity import ray_nodes
from tenax.orchestrator.service.scheduling_policy import (Cluster, JobView, SchedulingAction,
                                                          SchedulingDecision, SchedulingSnapshot,
                                                          decide, never_fits)
from tenax.workers import stamp

if TYPE_CHECKING:
    from tenax.orchestrator.service.jobs import JobManager
    from tenax.orchestrator.spec import JobSpec

logger = logging.getLogger(__name__)

A = SchedulingAction
TICK_S = 1.0
NODES_TIMEOUT_S = 5.0


@dataclass
class QueueEntry:
    """A job waiting for GPUs (submitted, requeued after a preemption, or stored as QUEUED)."""
    job_id: str
    spec: "JobSpec"
    order: float  # submission time: keeps its place when requeued
    since: float = field(default_factory=time.monotonic)
    waited_s: float = 0.0  # earlier waits (before a preemption)
    position: int = 0
    waiting_for: str = ""
    announced: bool = False  # the `queued` event and QUEUED state are stored
    owner: str = ""  # who submitted it: the queue caps count per owner


def cluster_now(largest: tuple[int, ...] | None = None,
                held: frozenset[str] = frozenset()) -> Cluster | None:
    """GPU slots of the alive Ray nodes but `held` (nodes a preflight keeps from every job: their
    slots are taken, by no job's placement); None when not connected to Ray, or when Ray did not
    list its nodes within NODES_TIMEOUT_S (this runs under the scheduler's lock: a hung GCS
    must not hold every submission; the pass is skipped and the next one retries)."""
    import ray

    if not ray.is_initialized():
        return None
    try:
        nodes = ray_nodes(NODES_TIMEOUT_S)
    except RayNodesTimeout as err:
        logger.warning("scheduler pass skipped: %s", err)
        return None
    gpus = tuple(int(n.get("Resources", {}).get("GPU", 0)) for n in nodes
                 if n.get("Alive") and n.get("NodeID") not in held)
    return Cluster(tuple(g for g in gpus if g > 0), largest)


def request_autoscaler(bundles: list[dict[str, float]]) -> None:
    """Ask Ray's autoscaler for these bundles in all (an empty list withdraws the request)."""
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=bundles)


class Dispatcher:
    """The queue of one JobManager and the thread that schedules it."""

    def __init__(self, manager: "JobManager", largest: tuple[int, ...] | None = None) -> None:
        self.manager, self.largest = manager, largest
        self.queue: dict[str, QueueEntry] = {}
        self.queued_s: dict[str, float] = {}  # job -> seconds waited, admitted jobs included
        self.lock = threading.RLock()
        self.wake = threading.Event()
        self.requested: list[dict[str, float]] = []
        self.thread: threading.Thread | None = None

    # ---- queue -----------------------------------------------------------------------------
    def enqueue(self, job_id: str, spec: "JobSpec", order: float, waited_s: float = 0.0,
                owner: str = "") -> None:
        with self.lock:
            self.queue[job_id] = QueueEntry(job_id, spec, order, waited_s=waited_s, owner=owner)

    def drop(self, job_id: str) -> QueueEntry | None:
        with self.lock:
            return self.queue.pop(job_id, None)

    def refusal(self, spec: "JobSpec") -> str | None:
        """Why a new job could never fit this cluster (None: it may, or Ray is not connected)."""
        cluster = cluster_now(self.largest)
        if cluster is None:
            return None
        return never_fits(_view_of_spec("new", spec, 0.0), cluster)

    def scale_refusal(self, spec: "JobSpec", nodes: int) -> str | None:
        """Why the job could never run at `nodes` node(s) on this cluster (None: it may)."""
        cluster = cluster_now(self.largest)
        if cluster is None:
            return None
        view = dataclasses.replace(_view_of_spec("scale", spec, 0.0), min_nodes=nodes)
        why = never_fits(view, cluster)
        return None if why is None else why.replace("resources.min_nodes=", "--nodes ", 1)

    def start(self) -> None:
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, name="tenax-scheduler",
                                               daemon=True)
                self.thread.start()

    def _loop(self) -> None:
        # A closed store means its server is gone (or a test ended): passes would only fail.
        while not self.manager.stopping.is_set() and not self.manager.store.closed:
            try:
                self.tick()
                self.manager.housekeeping()  # rate-limited: finished records past the cap
            except Exception:  # a bug in one pass must not stop scheduling
                logger.exception("scheduler pass failed")
            self.wake.wait(TICK_S)
            self.wake.clear()
        self._withdraw()

    # ---- one pass --------------------------------------------------------------------------
    def tick(self) -> list[SchedulingDecision]:
        with self.lock:
            held = frozenset(r.preflight.held_node() for r in self.manager.active_runners())
            cluster = cluster_now(self.largest, held - {""})
            if cluster is None or self.manager.stopping.is_set():  # no Ray, or shutting down
                return []
            decisions = decide(SchedulingSnapshot(self._views(), cluster))
            for d in decisions:
                if d.action != A.WAIT:
                    logger.info("scheduler: %s %s: %s", d.action.value, d.job_id, d.reason)
                self._apply(d)
            self._autoscale(decisions)
            return decisions

    def _views(self) -> tuple[JobView, ...]:
        now = time.monotonic()
        views = [_view_of_spec(e.job_id, e.spec, e.order, queued_s=e.waited_s + now - e.since)
                 for e in self.queue.values()]
        for runner in self.manager.active_runners():
            c, r = runner.controller, runner.spec.resources
            target = min(max(c.target_nodes, r.min_nodes), r.max_nodes)
            runner.allotted = min(runner.allotted, target)  # `tenax scale` down lowers it too
            views.append(JobView(runner.job_id, runner.spec.priority, runner.order,
                                 r.gpus_per_node, r.min_nodes, target, True, runner.allotted,
                                 runner.holds(), r.preemptible, runner.preempting))
        return tuple(views)

    def _apply(self, d: SchedulingDecision) -> None:
        if d.action == A.WAIT:
            self._wait(d)
        elif d.action == A.ADMIT:
            entry = self.queue.pop(d.job_id)
            waited = entry.waited_s + time.monotonic() - entry.since
            self.queued_s[d.job_id] = waited
            self.manager.record(d.job_id, {"event": "admitted", "job": d.job_id, "nodes": d.nodes,
                                           "queued_s": round(waited, 3), "reason": d.reason})
            self.manager.start_runner(d.job_id, entry.spec, d.nodes)
        elif d.action in (A.REFUSE, A.EXPIRE):
            entry = self.queue.pop(d.job_id)
            self.queued_s[d.job_id] = entry.waited_s + time.monotonic() - entry.since
            self.manager.record(d.job_id, {"event": "state", "state": "FAILED", "job": d.job_id,
                                           "reason": d.reason})
        else:
            self._resize(d)

    def _wait(self, d: SchedulingDecision) -> None:
        entry = self.queue[d.job_id]
        entry.position, entry.waiting_for = d.position, d.reason
        if not entry.announced:
            entry.announced = True
            self.manager.record(d.job_id, {"event": "queued", "job": d.job_id,
                                           "position": d.position, "reason": d.reason})
            self.manager.record(d.job_id, {"event": "state", "state": "QUEUED", "job": d.job_id,
                                           "reason": f"position {d.position}: {d.reason}"})

    def _resize(self, d: SchedulingDecision) -> None:
        runner = self.manager.runners[d.job_id]
        kind = {A.SHRINK: "shrunk", A.GROW: "grown", A.PREEMPT: "preempted"}[d.action]
        old, runner.allotted = runner.allotted, d.nodes
        event = {"event": kind, "job": d.job_id, "from_nodes": old, "nodes": d.nodes,
                 "reason": d.reason}
        runner.record(stamp(event))
        if d.action == A.PREEMPT:
            runner.preempt(d.reason)
        else:  # the controller re-plans at once instead of at its next look at capacity
            runner.capacity_changed(f"{kind} to {d.nodes} node(s): {d.reason}")

    def _autoscale(self, decisions: list[SchedulingDecision]) -> None:
        """Ask for every admitted job's bundles plus the waiting jobs' missing ones."""
        waiting = [d for d in decisions if d.action == A.WAIT and d.missing_gpus > 0]
        bundles: list[dict[str, float]] = []
        if waiting:
            for runner in self.manager.active_runners():
                g = runner.spec.resources.gpus_per_node
                bundles += [{"GPU": float(g)}] * max(runner.allotted, runner.holds())
            for d in waiting:
                r = self.queue[d.job_id].spec.resources
                bundles += [{"GPU": float(r.gpus_per_node)}] * r.min_nodes
        if bundles != self.requested:
            self._request(bundles)

    def _request(self, bundles: list[dict[str, float]]) -> None:
        try:
            request_autoscaler(bundles)
        except Exception as err:  # no autoscaler API (old Ray): scheduling goes on
            logger.warning("autoscaler request failed: %s", err)
            return
        logger.info("autoscaler: %s", f"requested {len(bundles)} bundle(s) {bundles}"
                    if bundles else "request withdrawn")
        self.requested = bundles

    def _withdraw(self) -> None:
        import ray

        if self.requested and ray.is_initialized():
            self._request([])

    # ---- queries ---------------------------------------------------------------------------
    def queue_status(self, job_id: str) -> dict[str, Any] | None:
        with self.lock:
            e = self.queue.get(job_id)
            if e is None:
                return None
            return {"queue_position": e.position, "waiting_for": e.waiting_for,
                    "queued_s": round(e.waited_s + time.monotonic() - e.since, 3)}

    def figures(self) -> dict[str, Any]:
        """For metrics: queued jobs per priority, seconds queued and GPUs held per job."""
        with self.lock:
            now = time.monotonic()
            by_priority: dict[int, int] = {}
            queued = dict(self.queued_s)
            for e in self.queue.values():
                by_priority[e.spec.priority] = by_priority.get(e.spec.priority, 0) + 1
                queued[e.job_id] = e.waited_s + now - e.since
            gpus = {r.job_id: max(r.allotted, r.holds()) * r.spec.resources.gpus_per_node
                    for r in self.manager.active_runners()}
        return {"queue": by_priority, "queued_s": queued, "gpus": gpus}


def _view_of_spec(job_id: str, spec: "JobSpec", order: float, queued_s: float = 0.0) -> JobView:
    r = spec.resources
    return JobView(job_id, spec.priority, order, r.gpus_per_node, r.min_nodes,
                   min(max(r.nodes, r.min_nodes), r.max_nodes), preemptible=r.preemptible,
                   queued_s=queued_s, queue_timeout_s=r.queue_timeout_s)


def wait_for_gpus(spec: "JobSpec", publish: Any, poll_s: float = TICK_S) -> str | None:
    """`tenax run --address`: queue like the service on a shared cluster. Waits until Ray has
    the GPUs for `min_nodes` free (other drivers' placement groups count as taken), asking the
    autoscaler for them meanwhile; returns why the job cannot run (never fits, queue timeout)
    or None once it may start. `publish(kind, **fields)` reports queued/admitted."""
    import ray

    r = spec.resources
    view = _view_of_spec(spec.name, spec, 0.0)
    refused = never_fits(view, cluster_now() or Cluster(()))
    if refused is not None:
        return refused
    start, announced, need = time.monotonic(), False, view.need_gpus
    while True:
        free = int(ray.available_resources().get("GPU", 0))
        if free >= need:
            break
        waited = time.monotonic() - start
        if r.queue_timeout_s is not None and waited > r.queue_timeout_s:
            request_autoscaler([])
            return (f"waited {waited:.0f} s for {need} GPU(s), more than "
                    f"resources.queue_timeout_s={r.queue_timeout_s:g}")
        if not announced:
            announced = True
            request_autoscaler([{"GPU": float(r.gpus_per_node)}] * r.min_nodes)
            publish("queued", position=1, reason=f"waiting for {need} GPU(s) ({r.min_nodes} "
                    f"node(s) x {r.gpus_per_node}); {free} free on the cluster")
        time.sleep(poll_s)
    if announced:
        request_autoscaler([])
        publish("admitted", nodes=r.min_nodes, queued_s=round(time.monotonic() - start, 3),
                reason=f"{free} GPU(s) free on the cluster")
    return None
