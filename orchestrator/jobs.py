"""The jobs of `tenax serve`: one Controller thread per job, every event stored before it is seen.

Why this shape: the gRPC layer (orchestrator/service.py) stays a thin translation of requests
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
import os
import tempfile
import threading
import uuid
from typing import Any, Callable

import yaml

from checkpoint.catalog import Catalog, CatalogError
from checkpoint.storage import Storage
from orchestrator.controller import Controller
from orchestrator.spec import JobSpec, SpecError, apply_overrides, spec_from_dict
from orchestrator.storage_roots import StorageRootError, StorageRoots, overlapping
from orchestrator.store import JobRecord, JobStore, StoreError
from workers.events import stamp

logger = logging.getLogger(__name__)

MAX_SPEC_CHARS = 1 << 20
MAX_OVERRIDES, MAX_OVERRIDE_CHARS = 200, 4096
STORAGE_TIMEOUT_S = 15.0
DETACH_TIMEOUT_S = 30.0


def default_gpu_slots() -> int:
    """Real GPUs if torch sees any; otherwise one rank slot per CPU core."""
    try:
        import torch

        count = torch.cuda.device_count()
    except Exception as err:  # a broken CUDA install must not stop a CPU server
        logger.warning("cannot count GPUs (%s); using CPU slots", err)
        count = 0
    return count or (os.cpu_count() or 1)


def connect_ray(address: str | None, gpus: int | None, cpus: int | None) -> None:
    """Join a cluster, or start an embedded one on 127.0.0.1 (ray.shutdown() stops it)."""
    import ray

    if address:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
        logger.info("connected to the Ray cluster at %s", address)
        return
    slots = gpus if gpus is not None else default_gpu_slots()
    tmp = tempfile.mkdtemp(prefix="tenax-ray-")
    ray.init(num_cpus=cpus or max(os.cpu_count() or 1, slots), num_gpus=slots,
             include_dashboard=False, _node_ip_address="127.0.0.1", _temp_dir=tmp,
             log_to_driver=False, configure_logging=False)
    logger.info("started an embedded Ray with %d GPU slot(s) (temp dir %s)", slots, tmp)


class SubmitError(ValueError):
    """A submission that cannot start; `kind` is invalid | conflict | unavailable."""

    def __init__(self, message: str, kind: str = "invalid") -> None:
        super().__init__(message, kind)
        self.message, self.kind = message, kind

    def __str__(self) -> str:
        return self.message


def parse_submission(spec_json: str, overrides: list[str]) -> JobSpec:
    """JSON text (+ `KEY=VALUE` overrides) -> JobSpec; SpecError naming the field otherwise.

    JSON only on the wire (DESIGN.md pins it): YAML aliases would let one request expand into
    gigabytes. The CLI converts a YAML file to JSON before sending it.
    """
    if not spec_json.strip():
        raise SpecError("spec_json: required (a JSON object; '{}' for the default job)")
    if len(spec_json) > MAX_SPEC_CHARS:
        raise SpecError(f"spec_json: {len(spec_json)} characters, more than {MAX_SPEC_CHARS}")
    try:
        raw = json.loads(spec_json)
    except (ValueError, RecursionError) as err:
        raise SpecError(f"spec_json: not valid JSON: {err}") from None
    if not isinstance(raw, dict):
        raise SpecError(f"spec_json: top level must be an object, got {type(raw).__name__}")
    if len(overrides) > MAX_OVERRIDES or any(len(o) > MAX_OVERRIDE_CHARS for o in overrides):
        raise SpecError(f"overrides: at most {MAX_OVERRIDES}, each at most "
                        f"{MAX_OVERRIDE_CHARS} characters")
    try:
        raw = apply_overrides(raw, overrides)
    except SpecError:
        raise
    except (yaml.YAMLError, ValueError, TypeError, RecursionError, ArithmeticError) as err:
        # a value is parsed as YAML (typed by its field): unterminated lists and the like
        raise SpecError(f"overrides: {type(err).__name__}: {err}") from None
    try:
        return spec_from_dict(raw)
    except RecursionError:
        raise SpecError("spec_json: nested too deeply") from None


def spec_json_of(spec: JobSpec) -> str:
    return json.dumps(spec.model_dump(mode="json", by_alias=True), sort_keys=True)


class JobRunner:
    """One job: its Controller on a thread; events go to the store, metrics, then watchers."""

    def __init__(self, manager: "JobManager", job_id: str, spec: JobSpec,
                 baseline: dict[str, Any] | None = None) -> None:
        self.manager, self.job_id, self.spec = manager, job_id, spec
        self.baseline = baseline or {}  # stored status of a resumed job
        self.detached = False
        self.extra: list[Callable[[dict[str, Any]], None]] = []  # metrics.attach appends here
        self.controller = Controller(spec, None, self._on_event, job_id)
        self.thread = threading.Thread(target=self._run, name=f"tenax-job-{job_id}", daemon=True)

    @property
    def alive(self) -> bool:
        return not self.detached and self.thread.is_alive()

    def status(self) -> dict[str, Any]:
        status = {**self.controller.status(), "target_nodes": self.controller.target_nodes}
        if self.controller.loss is None and self.baseline.get("loss") is not None:
            # resumed and not stepped yet: the stored step is the better answer
            status.update(step=self.baseline.get("step", 0), loss=self.baseline["loss"])
        return status

    def _on_event(self, event: dict[str, Any]) -> None:
        if self.detached:  # shutting down: the store must keep the job resumable
            return
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
            self.controller.run()
        except Exception as err:
            logger.exception("job %s: controller crashed", self.job_id)
            self._on_event(stamp({"event": "state", "state": "FAILED", "job": self.job_id,
                                  "reason": f"controller error: {type(err).__name__}: {err}"}))
        finally:
            if not self.detached:
                try:
                    self.manager.store.save_status(self.job_id, self.status())
                except StoreError as err:
                    logger.error("job %s: final status not stored: %s", self.job_id, err)
            self.manager.notify()


class JobManager:
    """Every job of one service; thread-safe. `collector` is a metrics TenaxCollector or None."""

    def __init__(self, store: JobStore, collector: Any = None,
                 roots: StorageRoots | None = None) -> None:
        self.store, self.collector = store, collector
        self.roots = roots  # None: any URI (embedding callers that trust their submitters)
        self.runners: dict[str, JobRunner] = {}
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._changed = threading.Condition()
        self._version = 0

    # ---- lifecycle -------------------------------------------------------------------------
    def submit(self, spec_json: str, overrides: list[str]) -> str:
        if self.stopping.is_set():
            raise SubmitError("the server is shutting down", "unavailable")
        spec = parse_submission(spec_json, overrides)
        try:
            if self.roots is not None:
                self.roots.check_spec(spec)
        except StorageRootError as err:
            raise SubmitError(str(err), "invalid") from None
        uri = spec.checkpoint.uri
        with self._lock:  # two spellings of one directory (or one inside the other) conflict
            busy = [r.job_id for r in self.runners.values()
                    if r.alive and overlapping(r.spec.checkpoint.uri, uri)]
            if busy:
                raise SubmitError(f"checkpoint.uri: {spec.checkpoint.uri} is in use by running "
                                  f"job {busy[0]}; give each job a checkpoint.uri of its own",
                                  "conflict")
            job_id = f"{spec.name}-{uuid.uuid4().hex[:8]}"
            self.store.add_job(job_id, spec.name, spec_json_of(spec), spec.checkpoint.uri)
            self._start(job_id, spec)
        logger.info("job %s submitted (%d steps, checkpoints at %s)", job_id, spec.train.steps,
                    spec.checkpoint.uri)
        return job_id

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
                self.store.append_event(record.job_id, stamp({
                    "event": "resumed", "job": record.job_id, "was": record.state,
                    "reason": "service restarted; continuing from the newest committed checkpoint"}))
                runner = self._start(record.job_id, spec, record)
            logger.info("job %s resumed (was %s, target %d node(s))", record.job_id,
                        record.state, runner.controller.target_nodes)
            resumed.append(record.job_id)
        return resumed

    def _finish_cancelled(self, record: JobRecord) -> None:
        logger.info("job %s: not resumed, its cancel request was stored before the restart",
                    record.job_id)
        self.store.append_event(record.job_id, {
            "event": "state", "state": "CANCELLED", "job": record.job_id, "was": record.state,
            "reason": "cancel requested before the service stopped; not resumed"})

    def _start(self, job_id: str, spec: JobSpec, record: JobRecord | None = None) -> JobRunner:
        baseline = record.status if record else {}
        runner = JobRunner(self, job_id, spec, baseline)
        target = baseline.get("target_nodes") or spec.resources.nodes
        if target != spec.resources.nodes:
            try:
                runner.controller.scale(int(target))
            except (ValueError, TypeError) as err:
                logger.warning("job %s: stored target nodes ignored: %s", job_id, err)
        if self.collector is not None:
            from orchestrator.metrics import attach

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
            runner.controller.cancel()
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

    def live_status(self, record: JobRecord) -> tuple[dict[str, Any], int]:
        """(status, target nodes): the controller's while it runs, else the stored one."""
        runner = self.runners.get(record.job_id)
        if runner is None or not runner.alive:
            return record.status, int(record.status.get("target_nodes") or 0)
        return runner.status(), runner.controller.target_nodes

    def cancel(self, job_id: str) -> None:
        """Persist the request, then tell the controller: an ack means a restart honours it."""
        self.store.request_cancel(job_id, "CancelJob")  # StoreError: not acknowledged
        runner = self.runners.get(job_id)
        if runner is not None:
            runner.controller.cancel()
        logger.info("job %s: cancel requested (stored before acting on it)", job_id)

    def scale(self, job_id: str, nodes: int) -> None:
        runner = self.runners[job_id]
        runner.controller.scale(nodes)  # ValueError outside [min_nodes, max_nodes]
        try:
            self.store.save_status(job_id, runner.status())  # a restart keeps the target
        except StoreError as err:
            logger.error("job %s: target nodes not stored: %s", job_id, err)

    @staticmethod
    def checkpoints(uri: str) -> list[dict[str, Any]]:
        """Versions under a checkpoint URI; StorageError/CatalogError when unreadable."""
        catalog = Catalog(Storage(uri, timeout_s=STORAGE_TIMEOUT_S))
        out = []
        for v in catalog.versions():
            item: dict[str, Any] = {"step": v.step, "committed": v.committed, "size_bytes": v.size}
            if v.committed:
                try:
                    m = catalog.manifest(v.step)
                except CatalogError as err:  # listed, but say why it would not load
                    item["error"] = str(err)
                else:
                    item.update(layout=m.layout, world_size=m.world_size,
                                created_at=m.created_at, manifest_json=m.to_json())
            out.append(item)
        return out

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
