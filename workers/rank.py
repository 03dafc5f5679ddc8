"""The rank loop: what one training process of a job runs, from rendezvous to its last step.

`run_rank(RankOptions, RankHooks)` joins the process group, builds the trainer for the layout,
resumes (from the in-memory snapshot its agent assembled when every rank can read it, else from
the newest committed checkpoint, resharded into this layout), runs the steps, saves every
checkpoint.every_steps and at the last step, takes the in-memory snapshots its placement
decided on (`MemoryOptions.every_steps`), and waits for the last save before returning the last
record. `tenax run`'s agents fork it (workers/worker.py); `python -m tenax.workers.launch` runs
it on local processes for tests and debugging.

Records: "started" (with the step it resumed at) and "step" go to `hooks.on_step`; checkpoint
events and `eval` events (data.validation, workers/evaluation.py) to `hooks.on_event` (default
`on_step`); a save's event is handed over by its writer's thread as the save ends, so hooks
must take records from more than one thread (checkpoint/manager.py says why).
`hooks.should_stop` is polled at every step boundary; when any rank says stop, all save at
that boundary and the loop returns {"event": "stopped", ...}. `hooks.profile_request` (a
running job's `tenax profile`) is agreed on in the same all-reduce, so every rank profiles the
same steps. `hooks.faults` is a drill's
fault injection (workers/chaos_injector.py), None in production: told before each step, it may
kill or hang this process or stretch its compute. Rank 0 of a job with a `logging` section also
hands its records to a tracker that writes TensorBoard / W&B off this thread (workers/tracking).
With `train.profile_steps`, every rank records a torch.profiler trace of that window of steps
(workers/profiling.py) and rank 0 reports the `profile` event.
"""
from __future__ import annotations

import logging
import os
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from tenax.workers.checkpoint_config import checkpoint_config
from tenax.workers.events import stamp
from tenax.workers.memory_options import MemoryOptions, begin_rank, snapshotter
from tenax.workers.profiling import ProfileWindows
from tenax.workers.rendezvous import join_process_group, leave_process_group
from tenax.workers.tracking.figures import device_figures
from tenax.workers.tracking.tracker import TrackingStart, open_tracker, tee_hooks

logger = logging.getLogger(__name__)

Record = dict[str, Any]

COLLECTIVE_TIMEOUT_FACTOR = 2.0
# glibc malloc, per training process: freed heap up to this much stays with the process, and
# blocks below MMAP_BYTES come from the heap rather than fresh mappings. By default a step's
# freed activations went back to the kernel and the next step faulted them in again: 100 to
# 6,000 page faults per rank per step here (3-5% of a step's CPU), most with snapshots on.
MALLOC_TRIM_BYTES = 256 << 20
MALLOC_MMAP_BYTES = 64 << 20
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt(3) parameters
MALLOC_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")  # a user's own choice wins


@dataclass
class RankOptions:
    """What one rank runs (picklable)."""
    spec: dict[str, Any]  # JobSpec.to_dict()
    layout: dict[str, Any]  # ParallelLayout.to_dict()
    rank: int
    world: int
    addr: str  # rank 0's rendezvous store
    port: int
    steps: int | None = None  # train until this step (default: train.steps)
    resume: bool = True  # from the newest committed checkpoint (or memory's restore_uri)
    storage_options: dict[str, Any] | None = None  # fsspec options for checkpoint.uri
    memory: MemoryOptions | None = None  # in-memory snapshots (from the rank's agent)
    # rank 0's tracker: the W&B run id (the service's job id, `tenax run`'s spec-derived
    # ControllerOptions.tracking_id; "": the spec's name and checkpoint URI) and restart totals
    tracking: TrackingStart = TrackingStart()


class FaultHook(Protocol):
    """A drill's fault injection inside the rank (workers/chaos_injector.py `ChaosInjector`)."""
    slow_factor: float  # this rank's compute takes this many times as long

    def before_step(self, step: int) -> None:
        """The rank is about to run `step` (1-based); may kill or hang this process."""


@dataclass
class RankHooks:
    """How the rank loop talks to whoever runs it (all optional)."""
    on_step: Callable[[Record], None] | None = None  # "started" and "step" records
    # checkpoint events (default: on_step); a save's own also from its writer's thread
    on_event: Callable[[Record], None] | None = None
    # liveness without a step: `evaluating` records of a validation run (workers/evaluation.py),
    # for the agent's hang clock only; never events
    on_progress: Callable[[Record], None] | None = None
    should_stop: Callable[[], bool] | None = None  # polled at every step boundary
    # (request id, steps) of the latest profile request, polled with should_stop; (0, 0): none
    profile_request: Callable[[], tuple[int, int]] | None = None
    faults: FaultHook | None = None  # a drill's fault injection; None in production

    def progress(self, record: Record) -> None:
        """Report a "started" or "step" record; then a drill may act before the next step."""
        if self.on_step is not None:
            self.on_step(record)
        if self.faults is not None:
            self.faults.before_step(record["step"] + 1)

    def events(self, events: list[Record], rank: int) -> None:
        """Checkpoint events of this rank, stamped where they happened."""
        emit = self.on_event or self.on_step
        for event in events:
            if emit is not None:
                emit(stamp({**event, "rank": rank}))


def keep_freed_heap() -> bool:
    """Tune glibc malloc as above; False where there is no glibc or the user tuned it."""
    import ctypes

    own = [n for n in MALLOC_ENV if n in os.environ]
    if own or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        logger.info("malloc left as the environment sets it (%s)", ", ".join(own) or
                    "GLIBC_TUNABLES")
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_TRIM_THRESHOLD, MALLOC_TRIM_BYTES) == 1 and \
        mallopt(M_MMAP_THRESHOLD, MALLOC_MMAP_BYTES) == 1
    logger.info("malloc keeps up to %d MiB of freed heap (no page faults to refill it every "
                "step): %s", MALLOC_TRIM_BYTES >> 20, "set" if ok else "refused by mallopt")
    return ok


def run_rank(options: RankOptions, hooks: RankHooks | None = None) -> Record:
    """Train this rank until step `options.steps` (default train.steps); the last record."""
    import torch

    from tenax.parallel import ParallelLayout
    from tenax.workers.spec import spec_from_dict

    torch.set_num_threads(1)
    keep_freed_heap()
    spec = spec_from_dict(options.spec)
    layout = ParallelLayout.from_dict(options.layout)
    # The collective timeout is only a backstop: the controller's hang detection
    # (hang_timeout_s) must fire first so the cause it reports is the hung rank, not a peer's
    # collective timing out.
    backend = "nccl" if torch.cuda.is_available() and spec.resources.device != "cpu" else "gloo"
    join_process_group(options.rank, options.world, options.addr, options.port,
                       COLLECTIVE_TIMEOUT_FACTOR * spec.fault_tolerance.hang_timeout_s, backend)
    joined_at = time.time()  # the cold start's rendezvous (in the "started" record)
    try:
        record = _train(spec, layout, options, hooks or RankHooks(), joined_at)
    except BaseException:
        leave_process_group(failed=True)
        raise
    leave_process_group()
    return record


def _train(spec: Any, layout: Any, options: RankOptions, hooks: RankHooks,
           joined_at: float = 0.0) -> Record:
    from tenax.checkpoint import CheckpointManager
    from tenax.workers.evaluation import Validator
    from tenax.workers.trainer import Trainer

    rank, world, storage_options = options.rank, options.world, options.storage_options
    # A resuming rank loads every weight: initialising them first would be wasted (~45 ms).
    trainer = Trainer(spec, layout, initialise=not options.resume)
    built_at = time.time()
    validator = Validator.from_spec(spec)  # a bad validation set fails before any load
    base = {"rank": rank, "world_size": world, "layout": layout.degrees()}
    with CheckpointManager(checkpoint_config(spec), trainer, rank, world,
                           storage_options=storage_options) as mgr, ExitStack() as closing:
        resumed, source = begin_rank(mgr, trainer, options.memory, options.resume, rank, world)
        tracker = open_tracker(options.spec, options.tracking, rank, trainer.step)
        if tracker is not None:  # rank 0 with `logging`: records also go there
            hooks = tee_hooks(hooks, tracker)
            closing.enter_context(tracker)  # closed after the last save's events
        hooks.events(mgr.drain_events(), rank)
        # from now on a save's event leaves from its writer's thread when the save ends: a
        # step blocked on a dead or hung peer must not keep a committed version's event here
        mgr.listen(lambda event: hooks.events([event], rank))
        snaps = snapshotter(spec, mgr, rank, world, options.memory)
        hooks.progress(stamp({"event": "started", "step": trainer.step,
                              "resumed_from": resumed, "source": source,
                              "joined_at": joined_at, "built_at": built_at, **base}))
        if validator is not None and trainer.step == 0 and validator.due(0):
            hooks.events([validator.run(trainer, hooks.on_progress).record()], rank)
        try:
            record = _steps(trainer, mgr, snaps, options, hooks, base, validator)
        finally:
            if snaps is not None:
                snaps.close()
        if record["event"] == "stopped":
            return record
        mgr.close()
        hooks.events(mgr.drain_events(), rank)
    return record


def _steps(trainer: Any, mgr: Any, snaps: Any, options: RankOptions, hooks: RankHooks,
           base: Record, validator: Any = None) -> Record:
    """Step until the target, saving and snapshotting where due; the last record."""
    spec = trainer.spec
    record: Record = {"event": "step", "step": trainer.step, "loss": None, **base}
    target, every = options.steps or spec.train.steps, spec.checkpoint.every_steps
    figures = device_figures(trainer)  # mfu, peak memory: CUDA only
    profiling = ProfileWindows(spec, base["rank"], options.storage_options)
    while trainer.step < target:
        if hooks.should_stop is not None:
            stop, request, steps = _agree(hooks.should_stop(), hooks.profile_request)
            if stop:
                return _stop_at_boundary(mgr, trainer.step, hooks, base, profiling)
            profiling.on_request(request, steps, trainer.step + 1)
        if hooks.faults is not None:  # chaos `slow`: this rank computes F times slower
            trainer.slow_factor = hooks.faults.slow_factor
        profiling.before_step(trainer.step + 1)  # torch.profiler windows (workers/profiling.py)
        result = trainer.run_step()
        record = {**_step_record(result, base), **figures(result)}
        hooks.events(profiling.after_step(trainer.step, target), base["rank"])
        hooks.progress(record)
        if trainer.step % every == 0 or trainer.step == target:
            mgr.save(trainer.step)
        if snaps is not None and options.memory.snapshot_due(trainer.step) \
                and trainer.step < target:
            snaps.snapshot(trainer.step)
        if validator is not None and validator.due(trainer.step):  # the `eval` event
            hooks.events([validator.run(trainer, hooks.on_progress).record()], base["rank"])
        hooks.events(mgr.drain_events(), base["rank"])
    return record


def _stop_at_boundary(mgr: Any, step: int, hooks: RankHooks, base: Record,
                      profiling: ProfileWindows | None = None) -> Record:
    """A planned stop: every rank saves this step (skipped when it is saved or resumed from)."""
    if profiling is not None:  # a window the stop cut short keeps nothing
        profiling.close()
    mgr.save(step)
    mgr.close()  # waits; a failed or timed-out save becomes an event, not an error
    hooks.events(mgr.drain_events(), base["rank"])
    return {"event": "stopped", "step": step, **base}


def _step_record(result: Any, base: Record) -> Record:
    return {"event": "step", "step": result.step, "loss": result.loss,
            "tokens_per_s": result.tokens_per_s, **base,
            "rank_tokens_per_s": result.rank_tokens_per_s, "grad_norm": result.grad_norm,
            "lr": result.lr, "step_s": result.step_s, "time": round(time.time(), 6),
            "cpu_time": round(time.process_time(), 6),  # this rank's CPU seconds so far
            "max_rss_bytes": max_rss_bytes()}  # the process's peak resident memory so far


def max_rss_bytes() -> int:
    """This process's peak resident set (ru_maxrss: KiB on Linux, bytes on macOS)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _agree(stop: bool, profile_request: Callable[[], tuple[int, int]] | None
           ) -> tuple[bool, int, int]:
    """One all-reduce (MAX) so every rank stops, or begins a requested profile, at the same
    step boundary, whatever moment each rank's agent passed the request on."""
    import torch
    import torch.distributed as dist

    request, steps = profile_request() if profile_request is not None else (0, 0)
    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([1 if stop else 0, request, steps], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    flag, request, steps = (int(x) for x in t.tolist())
    return bool(flag), request, steps


class ControlChannel:
    """The agent's requests to its training process, over the pipe end `conn`: "stop"
    (checkpoint at the next step boundary and exit) and ("profile", request, steps) (a
    torch.profiler trace of the next `steps` steps; `request` is the controller's id)."""

    def __init__(self, conn: Any) -> None:
        self.conn, self.stop, self.profile = conn, False, (0, 0)

    def _read(self) -> None:
        try:
            while self.conn.poll():
                message = self.conn.recv()
                if message == "stop":
                    self.stop = True
                elif isinstance(message, tuple) and message[:1] == ("profile",):
                    self.profile = (int(message[1]), int(message[2]))
        except (EOFError, OSError):  # the agent is gone: nobody will run this job's steps
            self.stop = True

    def should_stop(self) -> bool:
        self._read()
        return self.stop

    def profile_request(self) -> tuple[int, int]:
        self._read()
        return self.profile
