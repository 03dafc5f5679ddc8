"""The service's preflight at admission: a job with `preflight: {steps, required}` is
smoke-tested (orchestrator/preflight) on the nodes the scheduler allotted it, after admission and
before its controller starts the long run.

Why in the job's own thread: the preflight holds the job's allotment (the scheduler counts it
as the job's) and runs scratch jobs on it, so it belongs to the job, not to the dispatcher.
The `preflight` event goes to the job's history; the verdict and every row that did not pass
stay in the job's status (`tenax status` shows them). A failing preflight with
`required: true` ends the job FAILED with the failing rows as its cause, no rank of the real
job started. A job that resumes (a service restart, a requeue after preemption) is not
preflighted again: it has stepped, or its status holds the verdict.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Callable, Iterator

from tenax.workers import stamp

logger = logging.getLogger(__name__)

Record = Callable[[dict[str, Any]], None]
VERDICTS = ("pass", "warn", "fail")  # a summary that starts with one: the preflight ran


class AdmissionPreflight:
    """One job's preflight: `run()` returns False when the job must not start."""

    def __init__(self, job_id: str, spec: Any, baseline: dict[str, Any],
                 capacity_limit: Callable[[], int], record: Record,
                 forkserver: dict[str, Any] | None = None) -> None:
        self.job_id, self.spec, self.record = job_id, spec, record
        self.forkserver = forkserver  # the service's: the scratch jobs' agents fork from it
        self.capacity_limit = capacity_limit
        self.summary = str(baseline.get("preflight") or "")  # "" until one ran
        done = self.summary.split(":")[0].split(";")[0] in VERDICTS
        self.wanted = (spec.preflight is not None and spec.preflight.steps > 0
                       and not done and not baseline.get("step"))
        self._lock = threading.Lock()
        self._scratch: Any = None  # the scratch controller running now
        self.report: Any = None  # the preflight's report (it may hold a node from others)
        self._stopped = False

    def stop(self) -> None:
        """Cancel, preemption or detach: stop the scratch job now. `run()` then returns True:
        the job's controller, asked the same, ends the job as it would have ended it."""
        with self._lock:
            self._stopped = True
            if self._scratch is not None:
                self._scratch.cancel()

    @contextlib.contextmanager
    def _guard(self, controller: Any) -> Iterator[None]:
        with self._lock:
            self._scratch = controller
            if self._stopped:
                controller.cancel()
        try:
            yield
        finally:
            with self._lock:
                self._scratch = None

    def run(self) -> bool:
        """The preflight, if the job wants one; False: the job ended FAILED (the preflight
        failed and was required), True: start the job's controller."""
        if not self.wanted:
            return True
        from tenax.orchestrator.preflight import PreflightInterrupted, run_preflight

        self.summary = "running"
        try:
            report = run_preflight(self.spec, None, self._publish, self._guard,
                                   capacity_limit=self.capacity_limit,
                                   forkserver=self.forkserver)
        except PreflightInterrupted as err:
            self.summary = f"stopped: {err}"
            logger.info("job %s: preflight stopped: %s", self.job_id, err)
            return True
        except Exception as err:  # noqa: BLE001 - a preflight bug is the job's failure cause
            logger.exception("job %s: preflight crashed", self.job_id)
            self.summary = f"fail: preflight error: {type(err).__name__}: {err}"
            return self._end_failed(self.summary) if self._required() else True
        self.report, self.summary = report, report.summary()
        logger.info("job %s: preflight %s", self.job_id, self.summary)
        if report.verdict == "fail" and self._required() and not self._stopped:
            return self._end_failed(report.cause())
        return True

    def held_node(self) -> str:
        """The node this job's preflight keeps from every job, the scheduler's included
        ("" when none)."""
        report = self.report
        return report.held_node if report is not None else ""

    def release(self) -> None:
        """The job ended: give back a node the preflight kept from it."""
        if self.report is not None:
            self.report.release()

    def _required(self) -> bool:
        return bool(self.spec.preflight is not None and self.spec.preflight.required)

    def _publish(self, kind: str, fields: dict[str, Any]) -> None:
        self.record(stamp({"event": kind, "job": self.job_id, **fields}))

    def _end_failed(self, cause: str) -> bool:
        self.record(stamp({"event": "state", "state": "FAILED", "job": self.job_id,
                           "reason": cause}))
        return False
