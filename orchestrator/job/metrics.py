"""Prometheus metrics for Tenax jobs: the pinned names of DESIGN.md "Metrics", nothing global.

Why this shape:
- One `TenaxCollector` per exporter (a `tenax run` or a `tenax serve`) holds one `JobMetrics`
  per job and renders every family at scrape time from the jobs' current state. No global
  registry: tests and a server can run several exporters and jobs side by side, and removing a
  job or an old group's ranks is just dropping state (no stale label sets left in a registry).
- `JobMetrics` is fed two ways: controller events (`on_event`: step, state, placed, failure,
  recovered, checkpoint...) and `observe(controller, records)`, which the controller calls after
  every heartbeat poll (`add_observer`) with the group's rank handles (last heartbeat reply,
  status, death).
- Heartbeat age is computed at scrape time from the controller's monotonic clock, so a dead or
  silent rank shows `tenax_rank_up 0` and an age that keeps growing even while the controller is
  busy re-forming the group; the old group's rank series disappear when a new group is placed.

Goodput (`tenax_job_goodput_ratio`) is the controller's `Goodput.summary()["goodput"]`, read at
scrape time (one definition, in orchestrator/job/goodput.py): productive time ÷ wall time since
submit, where productive = wall − placement − start-up (incl. checkpoint load) − recovery and
rescaling − wall time of steps later lost to a failure − time blocked by checkpoint saves.

Checkpoint gauges hold the latest save/load (0 before the first one). One extra, non-pinned
counter, `tenax_checkpoint_failures_total`, feeds the "checkpoint failing" alert.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
                                    Metric)
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

RANK = ("job", "rank", "node")
JOB = ("job",)
LAYOUT_KEYS = ("dp", "tp", "pp", "cp", "ep", "zero")
JOB_STATES = ("PENDING", "QUEUED", "PLACING", "RUNNING", "RECOVERING", "RESCALING", "SUCCEEDED",
              "FAILED", "CANCELLED")
TERMINAL_STATES = ("SUCCEEDED", "FAILED", "CANCELLED")
# JobDecision.cause_kind values, plus placement retries and straggler evictions; exported
# at 0 from the start so that increase() sees the first restart.
RESTART_REASONS = ("dead", "heartbeat", "hang", "error", "placement", "straggler")
RECOVERY_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)

# name -> (type, labels, help). The pinned contract; tests compare the scrape against it.
METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "tenax_rank_up": ("gauge", RANK, "1 while the rank answers heartbeats and has not failed"),
    "tenax_rank_heartbeat_age_seconds": ("gauge", RANK,
                                         "Seconds since the rank's last heartbeat reply"),
    "tenax_rank_step": ("gauge", RANK, "Last optimizer step the rank completed"),
    "tenax_rank_tokens_per_second": ("gauge", RANK, "Rank tokens per second of its own busy time"),
    "tenax_rank_step_seconds": ("gauge", RANK, "Wall time of the rank's last step"),
    "tenax_rank_straggler_score": ("gauge", RANK, "Rank busy-time throughput / median of the "
                                   "job's ranks, last window"),
    "tenax_job_state": ("gauge", JOB + ("state",),
                        "1 for the job's current state, 0 for the others"),
    "tenax_job_step": ("gauge", JOB, "Last completed optimizer step"),
    "tenax_job_loss": ("gauge", JOB, "Loss of the last step (mean token loss of the global batch)"),
    "tenax_job_eval_loss": ("gauge", JOB, "Validation loss of the last evaluation "
                            "(data.validation; NaN until the first)"),
    "tenax_job_tokens_per_second": ("gauge", JOB, "Global batch tokens / wall step time"),
    "tenax_job_lr": ("gauge", JOB, "Learning rate of the last step (not pinned)"),
    "tenax_job_grad_norm": ("gauge", JOB, "Global gradient L2 norm of the last step, before "
                            "clipping (not pinned)"),
    "tenax_job_world_size": ("gauge", JOB, "Ranks in the current layout"),
    "tenax_job_layout_info": ("gauge", JOB + LAYOUT_KEYS, "Current parallel layout (value 1)"),
    "tenax_job_restarts_total": ("counter", JOB + ("reason",),
                                 "Restarts of the worker group by cause"),
    "tenax_job_recovery_seconds": ("histogram", JOB,
                                   "Seconds from failure detection to training resumed"),
    "tenax_job_lost_steps_total": ("counter", JOB, "Steps recomputed after failures"),
    "tenax_job_goodput_ratio": ("gauge", JOB, "Productive training time / wall time since submit"),
    "tenax_checkpoint_save_blocked_seconds": ("gauge", JOB,
                                              "Training time blocked by the last save"),
    "tenax_checkpoint_save_seconds": ("gauge", JOB, "Total duration of the last committed save"),
    "tenax_checkpoint_load_seconds": ("gauge", JOB, "Duration of the last checkpoint load"),
    "tenax_checkpoint_last_committed_step": ("gauge", JOB,
                                             "Step of the newest committed checkpoint"),
    "tenax_checkpoint_failures_total": ("counter", JOB,
                                        "Checkpoint saves that failed (not pinned)"),
    "tenax_replica_failures_total": ("counter", JOB + ("reason",),
                                     "Replicas refused by the job's agents, or not sent, by "
                                     "reason (docs/recovery.md)"),
    # tenax serve's scheduler (exported by a server only)
    "tenax_queue_jobs": ("gauge", ("priority",), "Jobs waiting in the queue, by priority"),
    "tenax_job_queued_seconds": ("gauge", JOB, "Seconds the job has waited in the queue in all"),
    "tenax_job_gpus": ("gauge", JOB, "GPUs the job holds now (its allotment while it changes)"),
}
SERVICE_METRICS = ("tenax_queue_jobs", "tenax_job_queued_seconds", "tenax_job_gpus")


def _family(name: str) -> Metric:
    kind, labels, doc = METRICS[name]
    cls = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily,
           "histogram": HistogramMetricFamily}[kind]
    return cls(name, doc, labels=list(labels))


@dataclass
class _Rank:
    node: str
    last_reply: float  # controller monotonic clock
    down: bool = False  # dead, failed, or its group was torn down
    step: int = 0
    tokens_per_s: float = 0.0
    step_s: float = 0.0
    replica_failures: dict[str, int] = field(default_factory=dict)  # its agent's, by reason


class JobMetrics:
    """What one job exports; thread-safe (fed by the controller, read by the HTTP thread)."""

    def __init__(self, job_id: str, heartbeat_timeout_s: float = 5.0,
                 goodput: Callable[[], float] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.job_id, self.heartbeat_timeout_s, self.clock = job_id, heartbeat_timeout_s, clock
        self.goodput, self._last_goodput = goodput or (lambda: math.nan), math.nan
        self._lock = threading.Lock()
        self.state = "PENDING"
        self.step, self.loss, self.tokens_per_s, self.world_size = 0, math.nan, 0.0, 0
        self.lr, self.grad_norm = math.nan, math.nan
        self.eval_loss = math.nan
        self.layout: dict[str, Any] | None = None
        self.ranks: dict[int, _Rank] = {}
        self.scores: dict[int, float] = {}
        self.restarts = {reason: 0 for reason in RESTART_REASONS}
        self._restart_reason: str | None = None
        self.recoveries: list[float] = []
        self.lost_steps = 0
        self.ckpt = {"blocked": 0.0, "save": 0.0, "load": 0.0, "committed": 0, "failures": 0}
        self.replica_failures_gone: dict[str, int] = {}  # counted by agents since replaced

    # ---- inputs --------------------------------------------------------------------------
    def on_event(self, event: Mapping[str, Any]) -> None:
        """Controller event callback (EventSink.extra); ignores other jobs' events."""
        if event.get("job", self.job_id) != self.job_id:
            return
        handler = getattr(self, f"_on_{event.get('event')}", None)
        if handler is not None:
            with self._lock:
                handler(event)

    def _on_step(self, e: Mapping[str, Any]) -> None:
        self.step, self.loss = e["step"], e.get("loss", math.nan)
        self.tokens_per_s = e.get("tokens_per_s", 0.0)
        self.lr, self.grad_norm = e.get("lr", math.nan), e.get("grad_norm", math.nan)
        self.world_size = e.get("world_size", self.world_size)
        self.layout = e.get("layout", self.layout)

    def _on_eval(self, e: Mapping[str, Any]) -> None:
        self.eval_loss = float(e.get("loss", math.nan))

    def _on_state(self, e: Mapping[str, Any]) -> None:
        self.state = e["state"]
        if self.state in TERMINAL_STATES:
            self.ranks, self.scores = {}, {}  # the job has no ranks any more
        elif self.state in ("RECOVERING", "PLACING"):
            # Being replaced: up 0, heartbeat age keeps growing. (RESCALING ranks are still
            # alive, committing their last checkpoint; they go down at PLACING.)
            for rank in self.ranks.values():
                rank.down = True
        if self.state == "RECOVERING":
            reason = self._restart_reason or "placement"  # no failure event: placement retry
            self.restarts[reason] = self.restarts.get(reason, 0) + 1
            self._restart_reason = None

    def _on_failure(self, e: Mapping[str, Any]) -> None:
        self._restart_reason = e.get("kind") or "error"

    def _on_placed(self, e: Mapping[str, Any]) -> None:
        now = self.clock()
        self.ranks = {rank: _Rank(node=str(node), last_reply=now)
                      for rank, node in enumerate(e.get("nodes", []))}
        self.scores = {}
        self.world_size, self.layout = e.get("world_size", len(self.ranks)), e.get("layout")

    def _on_recovered(self, e: Mapping[str, Any]) -> None:
        self.recoveries.append(float(e.get("seconds", 0.0)))
        self.lost_steps += int(e.get("lost_steps", 0))

    def _on_checkpoint(self, e: Mapping[str, Any]) -> None:
        self.ckpt["blocked"] = float(e.get("blocked_s", 0.0))
        self.ckpt["save"] = float(e.get("total_s", 0.0))
        self.ckpt["committed"] = max(self.ckpt["committed"], int(e.get("step", 0)))

    def _on_checkpoint_failed(self, e: Mapping[str, Any]) -> None:
        self.ckpt["failures"] += 1

    def _on_checkpoint_loaded(self, e: Mapping[str, Any]) -> None:
        self.ckpt["load"] = float(e.get("seconds", 0.0))
        self.ckpt["committed"] = max(self.ckpt["committed"], int(e.get("step", 0)))

    def observe(self, controller: Any, records: Iterable[Mapping[str, Any]] = ()) -> None:
        """Called by the controller after each heartbeat poll: refresh the per-rank series."""
        group = getattr(controller, "group", None)
        tracker = getattr(controller, "stragglers", None)
        with self._lock:
            for handle in (group.ranks if group is not None else []):
                self._absorb_handle(handle)
            if tracker is not None:
                self.scores = dict(tracker.scores)
            for record in records:
                if record.get("rank") == 0 and record.get("event") == "checkpoint_loaded":
                    self._on_checkpoint_loaded(record)

    def _absorb_handle(self, handle: Any) -> None:
        status = handle.status or {}
        rank = self.ranks.get(handle.rank)
        if rank is None:
            rank = _Rank(node=handle.node_id, last_reply=handle.last_reply)
            self.ranks[handle.rank] = rank
        rank.node, rank.last_reply = handle.node_id or rank.node, handle.last_reply
        rank.down = handle.dead is not None or status.get("state") == "failed"
        rank.step = int(status.get("step", rank.step) or 0)
        rank.tokens_per_s = float(status.get("rank_tokens_per_s", rank.tokens_per_s) or 0.0)
        rank.step_s = float(status.get("step_s", rank.step_s) or 0.0)
        counts = status.get("replica_failures")
        if isinstance(counts, Mapping):
            for reason, n in rank.replica_failures.items():  # a new agent counts from 0
                if int(counts.get(reason, 0)) < n:
                    gone = self.replica_failures_gone
                    gone[reason] = gone.get(reason, 0) + n
            rank.replica_failures = {str(k): int(v) for k, v in counts.items()}

    # ---- output --------------------------------------------------------------------------
    def _goodput(self) -> float:
        try:
            self._last_goodput = float(self.goodput())
        except (TypeError, KeyError, ValueError, RuntimeError) as err:
            # The source is the controller's, read from the HTTP thread mid-update: keep the
            # last value rather than fail the scrape.
            logger.debug("goodput not readable now: %s", err)
        return self._last_goodput

    def fill(self, families: Mapping[str, Metric]) -> None:
        """Add this job's samples to the scrape's metric families."""
        with self._lock:
            self._fill_ranks(families)
            self._fill_job(families)
            self._fill_checkpoint(families)

    def _fill_ranks(self, f: Mapping[str, Metric]) -> None:
        now = self.clock()
        for index, rank in sorted(self.ranks.items()):
            labels = [self.job_id, str(index), rank.node]
            age = max(0.0, now - rank.last_reply)
            up = not rank.down and age <= self.heartbeat_timeout_s
            f["tenax_rank_up"].add_metric(labels, 1.0 if up else 0.0)
            f["tenax_rank_heartbeat_age_seconds"].add_metric(labels, age)
            f["tenax_rank_step"].add_metric(labels, rank.step)
            f["tenax_rank_tokens_per_second"].add_metric(labels, rank.tokens_per_s)
            f["tenax_rank_step_seconds"].add_metric(labels, rank.step_s)
            if index in self.scores:  # absent until the first straggler window closes
                f["tenax_rank_straggler_score"].add_metric(labels, self.scores[index])

    def _fill_job(self, f: Mapping[str, Metric]) -> None:
        job = [self.job_id]
        for state in JOB_STATES:
            f["tenax_job_state"].add_metric(job + [state], 1.0 if state == self.state else 0.0)
        f["tenax_job_step"].add_metric(job, self.step)
        f["tenax_job_loss"].add_metric(job, self.loss if self.loss is not None else math.nan)
        f["tenax_job_eval_loss"].add_metric(job, self.eval_loss)
        f["tenax_job_tokens_per_second"].add_metric(job, self.tokens_per_s)
        f["tenax_job_lr"].add_metric(job, self.lr)
        f["tenax_job_grad_norm"].add_metric(job, self.grad_norm)
        f["tenax_job_world_size"].add_metric(job, self.world_size)
        if self.layout:
            f["tenax_job_layout_info"].add_metric(
                job + [str(self.layout.get(k, "")) for k in LAYOUT_KEYS], 1.0)
        for reason, count in sorted(self.restarts.items()):
            f["tenax_job_restarts_total"].add_metric(job + [reason], count)
        buckets = [(str(bound), sum(1 for s in self.recoveries if s <= bound))
                   for bound in RECOVERY_BUCKETS] + [("+Inf", len(self.recoveries))]
        f["tenax_job_recovery_seconds"].add_metric(job, buckets, sum(self.recoveries))
        f["tenax_job_lost_steps_total"].add_metric(job, self.lost_steps)
        f["tenax_job_goodput_ratio"].add_metric(job, self._goodput())

    def _fill_checkpoint(self, f: Mapping[str, Metric]) -> None:
        job, c = [self.job_id], self.ckpt
        f["tenax_checkpoint_save_blocked_seconds"].add_metric(job, c["blocked"])
        f["tenax_checkpoint_save_seconds"].add_metric(job, c["save"])
        f["tenax_checkpoint_load_seconds"].add_metric(job, c["load"])
        f["tenax_checkpoint_last_committed_step"].add_metric(job, c["committed"])
        f["tenax_checkpoint_failures_total"].add_metric(job, c["failures"])
        totals = dict(self.replica_failures_gone)
        for rank in self.ranks.values():
            for reason, n in rank.replica_failures.items():
                totals[reason] = totals.get(reason, 0) + n
        for reason, n in sorted(totals.items()):
            f["tenax_replica_failures_total"].add_metric(job + [reason], n)


class TenaxCollector(Collector):
    """Renders every job's metrics at scrape time; one per exporter, several jobs each."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[str, JobMetrics] = {}
        # tenax serve: () -> {"queue": {priority: n}, "queued_s": {job: s}, "gpus": {job: n}}
        self.queue_source: Callable[[], Mapping[str, Mapping[Any, float]]] | None = None

    def add_job(self, job_id: str, **kwargs: Any) -> JobMetrics:
        job = JobMetrics(job_id, **kwargs)
        with self._lock:
            self._jobs[job_id] = job
        return job

    def remove_job(self, job_id: str) -> None:
        with self._lock:
            self._jobs.pop(job_id, None)

    def job(self, job_id: str) -> JobMetrics | None:
        with self._lock:
            return self._jobs.get(job_id)

    def describe(self) -> Iterator[Metric]:
        return iter(_family(name) for name in METRICS)

    def collect(self) -> Iterator[Metric]:
        families = {name: _family(name) for name in METRICS}
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            job.fill(families)
        if self.queue_source is not None:
            self._fill_queue(families)
        return iter(families.values())

    def _fill_queue(self, f: Mapping[str, Metric]) -> None:
        try:
            figures = self.queue_source()
        except Exception:  # the scrape must not fail because the scheduler is mid-update
            logger.exception("queue figures not readable")
            return
        for priority, count in sorted(figures.get("queue", {}).items()):
            f["tenax_queue_jobs"].add_metric([str(priority)], count)
        if not figures.get("queue"):
            f["tenax_queue_jobs"].add_metric(["0"], 0.0)  # an empty queue is a value, not a gap
        for job, seconds in sorted(figures.get("queued_s", {}).items()):
            f["tenax_job_queued_seconds"].add_metric([job], seconds)
        for job, gpus in sorted(figures.get("gpus", {}).items()):
            f["tenax_job_gpus"].add_metric([job], gpus)


class MetricsServer:
    """A private registry with one TenaxCollector, served over HTTP (port 0: any free port)."""

    def __init__(self, port: int, host: str = "0.0.0.0") -> None:
        self.registry = CollectorRegistry()
        self.collector = TenaxCollector()
        self.registry.register(self.collector)
        self._httpd, self._thread = start_http_server(port, host, self.registry)
        self.port = int(self._httpd.server_port)
        logger.info("Prometheus metrics on http://%s:%d/metrics", host, self.port)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def attach(collector: TenaxCollector, controller: Any, sink: Any = None) -> JobMetrics:
    """Register a controller's job: its events through `sink.extra`, its polls as observer."""
    source = getattr(controller, "goodput", None)
    goodput = (lambda: float(source.summary()["goodput"])) if source is not None else None
    job = collector.add_job(controller.job_id,
                            heartbeat_timeout_s=controller.timeouts.heartbeat_timeout_s,
                            goodput=goodput)
    if sink is not None:
        sink.extra.append(job.on_event)
    controller.add_observer(job.observe)
    return job


def serve_metrics(controller: Any, port: int, sink: Any = None,
                  host: str = "0.0.0.0") -> MetricsServer:
    """`tenax run --metrics-port`: export one job's metrics; close() the server when done."""
    server = MetricsServer(port, host)
    attach(server.collector, controller, sink)
    return server
