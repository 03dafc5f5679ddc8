"""The jobs of `tenax serve`: one Controller thread per job, every event stored before it is seen.

Why this shape: the gRPC layer (orchestrator/service/server.py) stays a thin translation of requests
into calls here, and everything that must survive the process goes through the JobStore first.
A runner's `_on_event` appends the event (and, for state events, the new state) to the store,
feeds the job's metrics, then wakes the watchers; WatchJob only ever reads the store, so a
watcher sees exactly what a restarted service would replay.

On shutdown the runners are *detached*: their events are no longer stored, then their workers
are stopped. So a stopped service leaves its jobs RUNNING in the store and the next start
resumes them (`resume_unfinished`) from the newest committed checkpoint, with the target node
count of the last ScaleJob.
"""
from __future__ import annotations

import json
import logging
import threading
import uuid
from typing import Any

from tenax.checkpoint import Catalog, CatalogError, Storage
from tenax.orchestrator.errors import StorageRootError, StoreError, SubmitError
from tenax.orchestrator.service.job_runner import JobRunner
from tenax.orchestrator.service.limits import (ANONYMOUS, Identity, ServiceLimits, UriClaims,
                                               check_job_id, check_priority, check_queue)
from tenax.orchestrator.service.scheduler import Dispatcher
from tenax.orchestrator.service.storage_roots import StorageRoots
from tenax.orchestrator.service.store import JobRecord, JobStore
from tenax.orchestrator.service.submission import (connect_ray, default_gpu_slots, parse_submission,
                                                   spec_json_of)
from tenax.orchestrator.spec import JobSpec, SpecError, spec_from_dict
from tenax.workers import stamp

logger = logging.getLogger(__name__)

__all__ = ["JobManager", "JobRunner", "connect_ray", "default_gpu_slots", "parse_submission",
           "spec_json_of"]

STORAGE_TIMEOUT_S = 15.0
DETACH_TIMEOUT_S = 30.0
HOUSEKEEPING_S = 30.0  # how often finished records beyond --keep-finished are forgotten


class JobManager:
    """Every job of one service; thread-safe. `collector` is a metrics TenaxCollector or None."""

    def __init__(self, store: JobStore, collector: Any = None,
                 roots: StorageRoots | None = None,
                 autoscale_max: tuple[int, int] | None = None,
                 limits: ServiceLimits | None = None,
                 forkserver: dict[str, Any] | None = None) -> None:
        self.store, self.collector = store, collector
        self.forkserver = forkserver  # this node's: every job's agents here fork from it
        self.roots = roots  # None: any URI (embedding callers that trust their submitters)
        self.limits = limits or ServiceLimits()
        self.claims = UriClaims()  # checkpoint roots of unfinished jobs
        self._kept_at = float("-inf")  # when housekeeping last ran (time.monotonic)
        self.runners: dict[str, JobRunner] = {}
        self.stopping = threading.Event()
        largest = (autoscale_max[1],) * autoscale_max[0] if autoscale_max else None
        self.dispatcher = Dispatcher(self, largest)
        self._lock = self.dispatcher.lock  # one lock: the queue and the runners change together
        if collector is not None:
            collector.queue_source = self.dispatcher.figures
        self._changed = threading.Condition()
        self._version = 0

    # ---- lifecycle -------------------------------------------------------------------------
    def submit(self, spec_json: str, overrides: list[str],
               caller: Identity = ANONYMOUS) -> str:
        if self.stopping.is_set():
            raise SubmitError("the server is shutting down", "unavailable")
        try:
            spec = parse_submission(spec_json, overrides,
                                    None if self.roots is None else self.roots.check_raw)
            if self.roots is not None:
                self.roots.check_spec(spec)
        except StorageRootError as err:
            raise SubmitError(str(err), "invalid") from None
        check_priority(caller, spec.priority)
        job_id = f"{spec.name}-{uuid.uuid4().hex[:8]}"
        check_job_id(job_id)
        uri = spec.checkpoint.uri
        with self._lock:  # two spellings of one directory (or one inside the other) conflict
            busy = self.claims.holders(uri, self._unfinished)
            if busy:
                raise SubmitError(f"checkpoint.uri: {spec.checkpoint.uri} is in use by running "
                                  f"job {busy[0]}; give each job a checkpoint.uri of its own",
                                  "conflict")
            refused = self.dispatcher.refusal(spec)  # before the queue cap: says why first
            if refused is not None:
                raise SubmitError(f"refused: {refused}", "invalid")
            check_queue(self.limits, caller, [e.owner for e in self.dispatcher.queue.values()])
            record = self.store.add_job(job_id, spec.name, spec_json_of(spec),
                                        spec.checkpoint.uri, owner=caller.name)
            self.claims.claim(job_id, uri)
            self.dispatcher.enqueue(job_id, spec, record.created_at, owner=caller.name)
            self.dispatcher.tick()  # starts it now if it fits, else stores it as QUEUED
            self.dispatcher.start()
        logger.info("job %s submitted by %s (priority %d, %d steps, checkpoints at %s)", job_id,
                    caller.name, spec.priority, spec.train.steps, spec.checkpoint.uri)
        return job_id

    def _unfinished(self, job_id: str) -> bool:
        """An admitted job still running, or a queued one (call with the lock held)."""
        runner = self.runners.get(job_id)
        return (runner is not None and runner.alive) or job_id in self.dispatcher.queue

    def housekeeping(self, force: bool = False) -> list[str]:
        """Forget finished jobs beyond --keep-finished (at most every HOUSEKEEPING_S unless
        `force`); returns their ids."""
        import time

        keep = self.limits.keep_finished
        if keep is None or (not force and time.monotonic() - self._kept_at < HOUSEKEEPING_S):
            return []
        self._kept_at = time.monotonic()
        try:
            gone = self.store.prune_finished(keep)
        except StoreError as err:
            logger.error("finished jobs not pruned: %s", err)
            return []
        with self._lock:
            for job_id in gone:
                self.runners.pop(job_id, None)
                self.dispatcher.queued_s.pop(job_id, None)
                self.claims.release(job_id)
        if gone:
            logger.info("forgot %d finished job(s) beyond --keep-finished %d (oldest %s)",
                        len(gone), keep, gone[0])
        return gone

    def active_runners(self) -> list[JobRunner]:
        return [r for r in self.runners.values() if r.alive and not r.requeue]

    def record(self, job_id: str, event: dict[str, Any]) -> None:
        """Store an event of a job that may have no controller (queued, refused, expired)."""
        runner = self.runners.get(job_id)
        if runner is not None and runner.alive:
            runner.record(stamp(event))
            return
        try:
            self.store.append_event(job_id, stamp(event))
        except StoreError as err:
            logger.error("job %s: event not stored: %s", job_id, err)
        self.notify()

    def start_runner(self, job_id: str, spec: JobSpec, nodes: int) -> JobRunner:
        """Admitted by the scheduler: a controller limited to `nodes` nodes."""
        record = self.store.get_job(job_id)
        return self._start(job_id, spec, record, nodes)

    def requeue(self, runner: JobRunner) -> None:
        """A preempted job stopped at its checkpoint boundary: back in the queue, same place."""
        with self._lock:
            waited = self.dispatcher.queued_s.get(runner.job_id, 0.0)
            self.dispatcher.enqueue(runner.job_id, runner.spec, runner.order, waited,
                                    owner=runner.owner)
        logger.info("job %s: preempted and requeued", runner.job_id)

    def resume_unfinished(self) -> list[str]:
        """Start a controller for every stored job that had not finished; returns their ids."""
        resumed = []
        for record in self.store.unfinished():
            if self.store.cancel_requested(record.job_id):
                self._finish_cancelled(record)
                continue
            try:
                spec = spec_from_dict(json.loads(record.spec_json))
            except (SpecError, ValueError) as err:
                self.store.append_event(record.job_id, stamp({
                    "event": "state", "state": "FAILED", "job": record.job_id,
                    "reason": f"cannot resume: the stored spec is no longer valid: {err}"}))
                continue
            with self._lock:
                self.claims.claim(record.job_id, spec.checkpoint.uri)
                self._resume(record, spec)
            resumed.append(record.job_id)
        self.housekeeping(force=True)
        with self._lock:
            self.dispatcher.tick()
            self.dispatcher.start()
        return resumed

    def _resume(self, record: JobRecord, spec: JobSpec) -> None:
        """A job that held GPUs starts again with its allotment; a queued one queues again
        (in its submission order, so the queue keeps its order across a restart)."""
        queued = record.state in ("QUEUED", "PENDING")
        self.store.append_event(record.job_id, stamp({
            "event": "resumed", "job": record.job_id, "was": record.state,
            "reason": "service restarted; " + ("back in the queue" if queued else
                                               "continuing from the newest committed checkpoint")}))
        if queued:
            self.dispatcher.enqueue(record.job_id, spec, record.created_at,
                                    float(record.status.get("queued_s") or 0.0), record.owner)
            entry = self.dispatcher.queue[record.job_id]
            entry.announced = record.state == "QUEUED"
            logger.info("job %s back in the queue", record.job_id)
            return
        allotted = int(record.status.get("allotted") or 0)
        runner = self._start(record.job_id, spec, record, allotted)
        logger.info("job %s resumed (was %s, target %d node(s), allotted %d)", record.job_id,
                    record.state, runner.controller.target_nodes, runner.allotted)

    def _finish_cancelled(self, record: JobRecord) -> None:
        logger.info("job %s: not resumed, its cancel request was stored before the restart",
                    record.job_id)
        self.store.append_event(record.job_id, {
            "event": "state", "state": "CANCELLED", "job": record.job_id, "was": record.state,
            "reason": "cancel requested before the service stopped; not resumed"})

    def _start(self, job_id: str, spec: JobSpec, record: JobRecord | None = None,
               allotted: int = 0) -> JobRunner:
        baseline = record.status if record else {}
        order = record.created_at if record else 0.0
        runner = JobRunner(self, job_id, spec, baseline, allotted, order)
        runner.owner = record.owner if record else ""
        target = baseline.get("target_nodes") or spec.resources.nodes
        if target != spec.resources.nodes:
            try:
                runner.controller.scale(int(target))
            except (ValueError, TypeError) as err:
                logger.warning("job %s: stored target nodes ignored: %s", job_id, err)
        if self.collector is not None:
            from tenax.orchestrator.job.metrics import attach

            job_metrics = attach(self.collector, runner.controller, runner)
            if baseline.get("loss") is not None:  # a resumed job exports its last known step
                job_metrics.on_event({"event": "step", "job": job_id, "loss": baseline["loss"],
                                      "step": baseline.get("step", 0)})
        self.runners[job_id] = runner
        runner.thread.start()
        return runner

    def detach_all(self, timeout_s: float = DETACH_TIMEOUT_S) -> None:
        """Stop every job's workers without recording it: the store keeps them resumable."""
        import time

        with self._lock:
            runners = [r for r in self.runners.values() if r.thread.is_alive()]
        for runner in runners:
            runner.detached = True
            runner.cancel()
        deadline = time.monotonic() + timeout_s
        for runner in runners:
            runner.thread.join(max(0.0, deadline - time.monotonic()))
            if runner.thread.is_alive():
                logger.warning("job %s: controller still busy after %.0f s; leaving it",
                               runner.job_id, timeout_s)

    # ---- queries and requests ---------------------------------------------------------------
    def running(self, job_id: str) -> bool:
        runner = self.runners.get(job_id)
        return runner is not None and runner.alive

    def queued(self, job_id: str) -> bool:
        return job_id in self.dispatcher.queue

    def live_status(self, record: JobRecord) -> tuple[dict[str, Any], int]:
        """(status, target nodes): the controller's while it runs, else the stored one; a
        queued job's also says where it is in the queue and what it waits for."""
        queue = self.dispatcher.queue_status(record.job_id)
        runner = self.runners.get(record.job_id)
        if runner is None or not runner.alive:
            status = {**record.status, **(queue or {})}
            return status, int(record.status.get("target_nodes") or 0)
        return runner.status(), runner.controller.target_nodes

    def cancel(self, job_id: str) -> None:
        """Persist the request, then tell the controller: an ack means a restart honours it."""
        self.store.request_cancel(job_id, "CancelJob")  # StoreError: not acknowledged
        with self._lock:
            if self.dispatcher.drop(job_id) is not None:  # queued: nothing to stop
                self.record(job_id, {"event": "state", "state": "CANCELLED", "job": job_id,
                                     "reason": "cancel requested while queued"})
                return
        runner = self.runners.get(job_id)
        if runner is not None:
            runner.cancel()
        logger.info("job %s: cancel requested (stored before acting on it)", job_id)

    def scale(self, job_id: str, nodes: int) -> None:
        runner = self.runners[job_id]
        r = runner.spec.resources  # a size outside the spec's range: the controller says so
        refused = self.dispatcher.scale_refusal(runner.spec, nodes) \
            if r.min_nodes <= nodes <= r.max_nodes else None
        if refused is not None:  # the job would wait for nodes this cluster does not have
            raise SubmitError(f"scale refused: {refused}", "conflict")
        runner.controller.scale(nodes)  # ValueError outside [min_nodes, max_nodes]
        self.dispatcher.wake.set()  # the scheduler grants (or takes) the nodes now, not next tick
        try:
            self.store.save_status(job_id, runner.status())  # a restart keeps the target
        except StoreError as err:
            logger.error("job %s: target nodes not stored: %s", job_id, err)

    def profile(self, job_id: str, steps: int) -> dict[str, Any]:
        """Every rank of the running job profiles its next `steps` steps (workers/profiling.py)."""
        from tenax.orchestrator.job.profiling import request_profile

        return request_profile(self.runners[job_id].controller, steps)

    @staticmethod
    def checkpoints(uri: str, after_step: int | None = None,
                    count: int | None = None) -> tuple[list[dict[str, Any]], bool]:
        """Versions under a checkpoint URI by step, those after `after_step`, at most `count`
        (only their manifests are read), and whether more follow; StorageError/CatalogError
        when unreadable."""
        catalog = Catalog(Storage(uri, timeout_s=STORAGE_TIMEOUT_S))
        versions = [v for v in catalog.versions() if after_step is None or v.step > after_step]
        chosen = versions if count is None else versions[:count]
        return [version_item(catalog, v) for v in chosen], len(chosen) < len(versions)

    # ---- change notification (WatchJob) -----------------------------------------------------
    def notify(self) -> None:
        with self._changed:
            self._version += 1
            self._changed.notify_all()

    wake_all = notify

    def version(self) -> int:
        with self._changed:
            return self._version

    def wait_for_change(self, seen: int, timeout_s: float) -> None:
        with self._changed:
            if self._version == seen:
                self._changed.wait(timeout_s)


def version_item(catalog: Catalog, version: Any) -> dict[str, Any]:
    """One version as ListCheckpoints shows it; a committed one with its manifest's figures."""
    item: dict[str, Any] = {"step": version.step, "committed": version.committed,
                            "size_bytes": version.size}
    if version.committed:
        try:
            m = catalog.manifest(version.step)
        except CatalogError as err:  # listed, but say why it would not load
            item["error"] = str(err)
        else:
            item.update(layout=m.layout, world_size=m.world_size, created_at=m.created_at,
                        manifest_json=m.to_json())
    return item
