"""Rank 0's experiment tracker: the records users plot, written off the training thread.

Why threads and bounded queues: the training loop only appends a record (a dict it already
built) to one deque per backend and sets an event, O(1) and lock-light; opening a backend
(`wandb.init` takes seconds), encoding protobufs and writing files happen on that backend's
daemon thread (a `Lane`), so a backend slow to open never holds up another's writes. A
backend that names a `batch_s` (W&B) is handed its records that often instead of at each step
(workers/tracking/wandb_writer.py says why), and earlier when half its queue is full. When a
writer falls behind by `capacity` records its oldest are dropped (counted, one warning), so a
slow file system or network can never stall a step.

Why backends fail soft: tracking is for people, training is the job. A backend that cannot open
(an unwritable directory, wandb failing to init) or that fails while writing logs one warning
and is switched off; the job goes on and its JSON log still has every record. Why it also
becomes an event: that warning lands in rank 0's process log, which a `tenax run` user never
sees. The lane leaves a `tracking_off` record {backend, reason, step} in the tracker; the
teed hooks (`tee_hooks`) take it after each record they pass on, and the tracker's close takes
what is left, both on the training thread, so the event travels like any other rank record
(the console, `--log-json`, the service's log) while no backend thread ever calls a hook.

Which records become what (one mapping for every backend, `scalars_of`/`texts_of`):
- `step`: train/loss, train/lr, train/grad_norm, train/tokens_per_s, train/step_s, and on CUDA
  train/mfu, train/peak_allocated_bytes;
- `eval` (when the job evaluates): eval/loss, eval/tokens_per_s;
- `checkpoint`: checkpoint/blocked_s, checkpoint/save_s; `checkpoint_failed`: a text entry;
- the attempt's start (`open`): the spec once (as text / as the W&B config) and an "attempts"
  text entry at the attempt's first step; on W&B also job/restarts and job/lost_steps (the
  controller's running totals, `TrackingStart`) in that step's row, after a restart. (The
  controller writes them to TensorBoard itself, as the `job` run: workers/tracking/job_events.)
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import re
import threading
import time
from typing import Any, Callable, Mapping, Protocol

logger = logging.getLogger(__name__)

Record = dict[str, Any]

CAPACITY = 4096  # records; a step makes one, so this is minutes of steps at any speed
CLOSE_TIMEOUT_S = 30.0  # what the end of a job waits for the writer (wandb.finish included)
ERROR_CLOSE_S = 2.0  # ... after an error: its report to the controller must not wait long
STEP_SCALARS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
                "tokens_per_s": "train/tokens_per_s", "step_s": "train/step_s",
                "mfu": "train/mfu", "peak_allocated_bytes": "train/peak_allocated_bytes"}
EVAL_SCALARS = {"loss": "eval/loss", "tokens_per_s": "eval/tokens_per_s"}
CHECKPOINT_SCALARS = {"blocked_s": "checkpoint/blocked_s", "total_s": "checkpoint/save_s"}
# The controller's figures (workers/tracking/job_events.py), one record kind of their own.
JOB_SCALARS = {"restarts": "job/restarts", "lost_steps": "job/lost_steps",
               "recovery_s": "job/recovery_s", "rescale_s": "job/rescale_s"}
JOB_FIGURES = "job_figures"
OFF = "tracking_off"  # the event saying a backend was switched off: {backend, reason, step}
REASON_CHARS = 300  # of the error in its `reason`: one console line, not a wandb traceback
# Text tags by event kind: one tag each, so that no kind's entries hide another's.
TEXT_TAGS = {"failure": "failures", "recovered": "recoveries", "scaled": "rescales",
             "checkpoint_failed": "checkpoint_failures", "snapshots_off": "notices",
             "straggler": "stragglers", OFF: "notices"}


class Backend(Protocol):
    """One place records go (TensorBoard, W&B). Every method runs on the tracker's thread."""
    name: str

    def open(self, first_step: int, spec: Mapping[str, Any]) -> None:
        """Start this attempt's writes; values at steps >= first_step replace older ones."""

    def scalars(self, step: int, values: Mapping[str, float], wall_time: float) -> None: ...

    def text(self, step: int, tag: str, text: str, wall_time: float) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def scalars_of(record: Mapping[str, Any]) -> dict[str, float]:
    """The scalar series a record adds to (tag -> value); {} for records nobody plots."""
    names = {"step": STEP_SCALARS, "eval": EVAL_SCALARS, "checkpoint": CHECKPOINT_SCALARS,
             JOB_FIGURES: JOB_SCALARS}.get(str(record.get("event")), {})
    values = {tag: _number(record.get(key)) for key, tag in names.items()}
    out = {tag: v for tag, v in values.items() if v is not None}
    if record.get("event") == "eval" and "tokens_per_s" not in out:
        tokens, seconds = _number(record.get("tokens")), _number(record.get("seconds"))
        if tokens is not None and seconds:
            out["eval/tokens_per_s"] = tokens / seconds
    return out


def texts_of(record: Mapping[str, Any]) -> dict[str, str]:
    """Text entries a record adds (tag -> sentence)."""
    tag = TEXT_TAGS.get(str(record.get("event")))
    if tag is None:
        return {}
    from tenax.workers.events import human

    return {tag: human(record)}


def wandb_run_id(job_id: str, spec: Mapping[str, Any]) -> str:
    """The W&B run id of a job: its job id (so a recovery or a restarted service resumes the
    same run); without one (the local launcher) the spec's name and checkpoint URI, which is
    what a resume goes by. At most 64 characters of [A-Za-z0-9_-]."""
    if not job_id:
        uri = str((spec.get("checkpoint") or {}).get("uri", ""))
        job_id = f"{spec.get('name', 'job')}-{hashlib.sha1(uri.encode()).hexdigest()[:8]}"
    clean = re.sub(r"[^A-Za-z0-9_-]", "-", job_id)
    if len(clean) <= 64:
        return clean
    return f"{clean[:55]}-{hashlib.sha1(job_id.encode()).hexdigest()[:8]}"


@dataclasses.dataclass(frozen=True)
class TrackingStart:
    """What the controller tells rank 0's tracker at each start of the ranks (picklable)."""
    run_id: str = ""  # names the W&B run; "": the spec's name and checkpoint URI
    restarts: int = 0  # the controller's restarts so far, this start's included
    lost_steps: int = 0  # steps lost to the recoveries before this start
    reached_step: int = 0  # the furthest step any rank reached before this start

    def figures(self, first_step: int) -> dict[str, float]:
        """job/restarts and job/lost_steps once this start resumes at `first_step` (the steps
        above it are lost, as the controller will count them); {} for a first start."""
        lost = self.lost_steps + max(0, self.reached_step - first_step)
        if not self.restarts and not lost:
            return {}
        return {JOB_SCALARS["restarts"]: float(self.restarts),
                JOB_SCALARS["lost_steps"]: float(lost)}


@dataclasses.dataclass
class TrackerStats:
    written: int = 0  # records handed to the backends (by the slowest one)
    dropped: int = 0  # records dropped because a writer fell behind
    failed: list[str] = dataclasses.field(default_factory=list)  # backends switched off
    open_cpu_s: float = 0.0  # the writer threads' CPU seconds opening the backends
    cpu_s: float = 0.0  # ... in all, so far: what tracking takes from the host


class Lane:
    """One backend with its own bounded queue and writer thread: a backend slow to open
    (`wandb.init` takes seconds) or to write never holds up the others."""

    def __init__(self, backend: Backend, first_step: int, spec: Mapping[str, Any],
                 capacity: int, notices: collections.deque[Record] | None = None) -> None:
        self.backend, self.first_step, self.spec = backend, first_step, spec
        self.capacity = capacity
        # A backend whose every call wakes other threads or processes (W&B: its service
        # process) takes its records in batches this often instead of one per step
        self.batch_s = float(getattr(backend, "batch_s", 0.0) or 0.0)
        self.step = first_step  # the step being written: where a switch-off is told
        # `tracking_off` records for the training thread to emit (a deque: appends and
        # pops are atomic, so this thread and the training thread need no lock for it)
        self.notices: collections.deque[Record] = \
            notices if notices is not None else collections.deque()
        self.stats = TrackerStats()
        self.live = True
        self.closing = False
        self._queue: collections.deque[Record] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"tenax-tracker-{backend.name}",
                                       daemon=True)
        self.thread.start()

    def put(self, record: Record) -> None:
        with self._lock:
            if len(self._queue) >= self.capacity:
                self._queue.popleft()
                self.stats.dropped += 1
                if self.stats.dropped == 1:
                    logger.warning("tracking (%s) falls behind training: dropping the oldest "
                                   "records (the JSON log keeps them all)", self.backend.name)
            self._queue.append(record)
            waiting = len(self._queue)
        if not self.batch_s or waiting * 2 >= self.capacity:  # never drop for batching
            self._wake.set()

    def close(self) -> None:
        self.closing = True
        self._wake.set()

    def pending(self) -> int:
        return len(self._queue)

    def _run(self) -> None:
        self._call("open", self.first_step, self.spec)
        self.stats.open_cpu_s = time.thread_time()
        while True:
            # A backend that batches its writes (TensorBoard on an object store) names how
            # often it wants a flush while no record comes: a hung job's last steps still land.
            self._wake.wait(self.batch_s or getattr(self.backend, "flush_every_s", None))
            self._wake.clear()
            with self._lock:
                batch, self._queue = list(self._queue), collections.deque()
            for record in batch:
                self._write(record)
            self._call("flush")
            self.stats.cpu_s = time.thread_time()
            self.stats.written += len(batch)
            if self.closing and not self._queue:
                break
        self._call("close")
        self.stats.cpu_s = time.thread_time()

    def _write(self, record: Record) -> None:
        step = record.get("step")
        if not isinstance(step, int) or not self.live:
            return
        self.step = step
        wall = _number(record.get("time")) or time.time()
        values = scalars_of(record)
        if values:
            self._call("scalars", step, values, wall)
        for tag, text in texts_of(record).items():
            self._call("text", step, tag, text, wall)

    def _call(self, method: str, *args: Any) -> None:
        """Call the backend; one that raises is switched off, with one warning."""
        if not self.live:
            return
        try:
            getattr(self.backend, method)(*args)
        except Exception as err:  # a tracking backend must never fail the job
            self.live = False
            self.stats.failed.append(self.backend.name)
            logger.warning("tracking: %s switched off (%s failed: %s: %s); training goes on",
                           self.backend.name, method, type(err).__name__, err)
            self.notices.append(off_record(
                self.backend.name, f"{method} failed: {type(err).__name__}: {err}"[:REASON_CHARS],
                self.step))
            _close_quietly(self.backend)


def off_record(backend: str, reason: str, step: int) -> Record:
    """The `tracking_off` event of a backend switched off at `step`, stamped now."""
    return {"event": OFF, "backend": backend, "reason": reason, "step": step,
            "time": round(time.time(), 6)}


class Tracker:
    """Records in (`submit`, any thread, never blocks), each backend written on its own thread."""

    def __init__(self, backends: list[Backend], first_step: int, spec: Mapping[str, Any],
                 capacity: int = CAPACITY) -> None:
        self.notices: collections.deque[Record] = collections.deque()
        # Who hears of a switched-off backend (`tee_hooks` sets it); called on the thread that
        # calls `report_off` or `close`, never on a lane's.
        self.report: Callable[[Record], None] | None = None
        self.lanes = [Lane(b, first_step, spec, capacity, self.notices) for b in backends]

    def submit(self, record: Record) -> None:
        """Queue a record for every backend; a full queue drops its oldest (counted)."""
        for lane in self.lanes:
            lane.put(record)

    def take_off_notices(self) -> list[Record]:
        """The `tracking_off` records not yet taken (each is handed out once)."""
        out: list[Record] = []
        while self.notices:
            out.append(self.notices.popleft())
        return out

    def report_off(self) -> None:
        """Tell `report` of every backend switched off since the last call (the caller's
        thread); the backends still on note it as a text entry too."""
        for notice in self.take_off_notices():
            self.submit(notice)
            if self.report is None:
                continue
            try:
                self.report(notice)
            except Exception as err:  # the event sink is gone (the job is ending)
                logger.warning("tracking: could not report %s switched off: %s",
                               notice.get("backend"), err)

    @property
    def stats(self) -> TrackerStats:
        lanes = [lane.stats for lane in self.lanes]
        return TrackerStats(written=min((s.written for s in lanes), default=0),
                            dropped=sum(s.dropped for s in lanes),
                            failed=[name for s in lanes for name in s.failed],
                            open_cpu_s=sum(s.open_cpu_s for s in lanes),
                            cpu_s=sum(s.cpu_s for s in lanes))

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, kind: Any, error: Any, trace: Any) -> bool:
        self.close(ERROR_CLOSE_S if kind is not None else CLOSE_TIMEOUT_S)
        return False

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> TrackerStats:
        """Write what is queued, close the backends; never raises, waits at most timeout_s."""
        deadline = time.monotonic() + timeout_s
        for lane in self.lanes:
            lane.close()
        for lane in self.lanes:
            lane.thread.join(max(0.0, deadline - time.monotonic()))
            if lane.thread.is_alive():
                logger.warning("tracking: %s did not finish within %.0f s; %d record(s) not "
                               "written", lane.backend.name, timeout_s, lane.pending())
        self.report_off()  # lanes are done: what they switched off since the last step
        stats = self.stats
        if stats.dropped:
            logger.warning("tracking dropped %d record(s) while training ran ahead",
                           stats.dropped)
        return stats


def _close_quietly(backend: Backend) -> None:
    try:
        backend.close()
    except Exception as err:  # already reported as switched off
        logger.debug("tracking: closing %s: %s", backend.name, err)


def backends_for(spec: Mapping[str, Any], job_id: str,
                 figures: Mapping[str, float] | None = None) -> list[Backend]:
    """The backends the spec's `logging` section asks for (none when it asks for none).
    `figures`: the controller's job/* totals for W&B's first row of this attempt."""
    section = spec.get("logging") or {}
    out: list[Backend] = []
    if section.get("tensorboard_dir"):
        from tenax.workers.tracking.tensorboard_writer import TensorBoardWriter

        out.append(TensorBoardWriter(section["tensorboard_dir"]))
    wandb = section.get("wandb")
    if wandb and wandb.get("mode") != "disabled":
        from tenax.workers.tracking.wandb_writer import WandbWriter

        out.append(WandbWriter(wandb, wandb_run_id(job_id, spec), str(spec.get("name", "")),
                               figures))
    return out


def open_tracker(spec: Mapping[str, Any], start: TrackingStart, rank: int,
                 first_step: int) -> Tracker | None:
    """Rank 0's tracker for this attempt, or None (another rank, or nothing configured)."""
    if rank != 0:
        return None
    backends = backends_for(spec, start.run_id, start.figures(first_step))
    return Tracker(backends, first_step, spec) if backends else None


def tee_hooks(hooks: Any, tracker: Tracker | None) -> Any:
    """`hooks` (a RankHooks) whose records also go to `tracker`; `hooks` itself without one."""
    if tracker is None:
        return hooks
    on_step, on_event = hooks.on_step, hooks.on_event or hooks.on_step
    if on_event is not None:  # a switched-off backend's event goes where events go
        tracker.report = lambda notice: on_event({**notice, "rank": 0})  # only rank 0 tracks
    return dataclasses.replace(hooks, on_step=_teed(tracker, on_step),
                               on_event=_teed(tracker, on_event))


def _teed(tracker: Tracker, then: Callable[[Record], None] | None) -> Callable[[Record], None]:
    def both(record: Record) -> None:
        tracker.submit(record)
        if then is not None:
            then(record)
        tracker.report_off()  # the training thread: a backend switched off becomes an event
    return both
