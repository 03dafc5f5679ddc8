"""JobRunner: one job of `tenax serve`, its Controller on a thread.

Split from orchestrator/service/jobs.py (which re-exports it): what one job does with its
events (store, metrics, watchers, in that order) is independent of how the manager queues and
resumes many. A runner's `_on_event` appends the event (and, for state events, the new state)
to the store before anyone is woken, so a watcher sees exactly what a restart would replay.
"""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Callable

from tenax.orchestrator.errors import StoreError
from tenax.orchestrator.job.controller import Controller, ControllerOptions
from tenax.orchestrator.service.admission_preflight import AdmissionPreflight
from tenax.orchestrator.spec import JobSpec
from tenax.workers import stamp

if TYPE_CHECKING:
    from tenax.orchestrator.service.jobs import JobManager

logger = logging.getLogger(__name__)


class JobRunner:
    """One job: its Controller on a thread; events go to the store, metrics, then watchers.

    `allotted` is the scheduler's grant in nodes: the controller never plans for more (its
    capacity is limited to it), so lowering it shrinks the job through the planned re-plan
    and raising it grows the job back. `preempt` stops the job at a checkpoint boundary; its
    end is not stored as CANCELLED but puts the job back in the queue."""

    def __init__(self, manager: "JobManager", job_id: str, spec: JobSpec,
                 baseline: dict[str, Any] | None = None, allotted: int = 0,
                 order: float = 0.0) -> None:
        self.manager, self.job_id, self.spec = manager, job_id, spec
        self.baseline = baseline or {}  # stored status of a resumed job
        self.detached = False
        self.allotted, self.order = allotted or spec.resources.nodes, order
        self.preempting, self.requeue = "", False
        self.owner = ""  # who submitted it (a requeued job keeps counting for them)
        self.extra: list[Callable[[dict[str, Any]], None]] = []  # metrics.attach appends here
        self.controller = Controller(spec, ControllerOptions(
            job_id=job_id, on_event=self._on_event, capacity_limit=self.allotment,
            forkserver=manager.forkserver))
        self.preflight = AdmissionPreflight(job_id, spec, self.baseline, self.allotment,
                                            self._on_event, manager.forkserver)
        self.thread = threading.Thread(target=self._run, name=f"tenax-job-{job_id}", daemon=True)

    def allotment(self) -> int:
        return self.allotted

    def holds(self) -> int:
        """Nodes the current placement holds (0 between placements)."""
        c = self.controller
        if c.group is None or c.layout is None:
            return 0
        return -(-c.layout.world_size // self.spec.resources.gpus_per_node)

    def preempt(self, reason: str) -> None:
        self.preempting = reason
        self.preflight.stop()
        self.controller.preempt(reason)

    def capacity_changed(self, reason: str) -> None:
        """The scheduler changed `allotted`: the controller re-plans at once, not at its next
        periodic look at capacity (2 s)."""
        self.controller.capacity_changed(reason)

    def cancel(self) -> None:
        """Stop the job: its admission preflight, if one runs, and its controller."""
        self.preflight.stop()
        self.controller.cancel()

    @property
    def alive(self) -> bool:
        return not self.detached and self.thread.is_alive()

    def status(self) -> dict[str, Any]:
        status = {**self.controller.status(), "target_nodes": self.controller.target_nodes,
                  "allotted": self.allotted, "priority": self.spec.priority,
                  "gpus": self.holds() * self.spec.resources.gpus_per_node,
                  "queued_s": round(self.manager.dispatcher.queued_s.get(self.job_id, 0.0), 3)}
        if self.preflight.summary:
            status["preflight"] = self.preflight.summary
        if self.controller.loss is None and self.baseline.get("loss") is not None:
            # resumed and not stepped yet: the stored step is the better answer
            status.update(step=self.baseline.get("step", 0), loss=self.baseline["loss"])
        return status

    def _on_event(self, event: dict[str, Any]) -> None:
        if self.detached:  # shutting down: the store must keep the job resumable
            return
        if event.get("event") == "state":
            if self.preempting and event.get("state") == "CANCELLED" and \
                    not self.controller.cancel_requested:
                self.requeue = True  # not an end: the job goes back to the queue
                return
            self.manager.dispatcher.wake.set()
        self.record(event)

    def record(self, event: dict[str, Any]) -> None:
        """Store the event (with the status now), feed metrics, wake the watchers."""
        kind, step = event.get("event"), event.get("step")
        every = self.manager.store.step_every
        keep_status = kind != "step" or (isinstance(step, int) and step % every == 0)
        try:
            self.manager.store.append_event(self.job_id, event,
                                            self.status() if keep_status else None)
        except StoreError as err:  # training goes on; the history has a gap
            logger.error("job %s: event not stored: %s", self.job_id, err)
        for callback in self.extra:
            try:
                callback(event)
            except Exception:  # a metrics bug must not stop a job
                logger.exception("job %s: event callback failed", self.job_id)
        self.manager.notify()

    def _run(self) -> None:
        try:
            if self.preflight.run():
                self.controller.run()
        except Exception as err:
            logger.exception("job %s: controller crashed", self.job_id)
            self._on_event(stamp({"event": "state", "state": "FAILED", "job": self.job_id,
                                  "reason": f"controller error: {type(err).__name__}: {err}"}))
        finally:
            self.preflight.release()
            if not self.detached:
                try:
                    self.manager.store.save_status(self.job_id, self.status())
                except StoreError as err:
                    logger.error("job %s: final status not stored: %s", self.job_id, err)
                if self.requeue:
                    self.manager.requeue(self)
            self.manager.dispatcher.wake.set()
            self.manager.notify()
