"""A `torch.profiler` trace of a window of steps on every rank (`train.profile_steps: [A, B]`,
`tenax run --profile-steps A:B`), kept as Chrome/Perfetto JSON at
`<checkpoint.uri>/diagnostics/<UTC time>-profile/rank-N.trace.json`.

Why the ranks agree on the time by an all-reduce (MAX of each rank's clock, at the step
boundary before A): every rank must write into one location, and a location named by the
controller would have to travel to ranks already running. Why another all-reduce after every
rank wrote its trace: rank 0's `profile` event then means the location is complete. Both
collectives run only at the window's two boundaries, never inside the profiled steps.

The profiler only observes: it records op timings and changes no arithmetic, so the losses
equal a run without it (tests/test_profile.py). A failure to write a trace is a warning and
the job goes on; an interrupted window (a stop or a failure inside it) keeps nothing.
"""
from __future__ import annotations

import logging
import os
import tempfile
import time
from typing import Any

from tenax.workers.diagnostics import diagnostics_location

logger = logging.getLogger(__name__)

TRACE_NAME = "rank-{rank}.trace.json"


def parse_profile_steps(text: str, flag: str = "--profile-steps") -> tuple[int, int]:
    """"A:B" -> (A, B): 1 <= A <= B, both integers; ValueError naming the flag and value."""
    parts = str(text).split(":")
    try:
        first, last = (int(p) for p in parts) if len(parts) == 2 else (None, None)
    except ValueError:
        first = last = None
    if first is None or last is None:
        raise ValueError(f"{flag}: {text!r} must be two step numbers FIRST:LAST, e.g. 10:12")
    check_profile_steps(first, last, flag, text)
    return first, last


def check_profile_steps(first: int, last: int, where: str, value: Any) -> None:
    """1 <= first <= last, or ValueError naming `where` and `value`."""
    if first < 1 or last < first:
        raise ValueError(f"{where}: {value!r} must name steps FIRST <= LAST, both >= 1 "
                         f"(steps are numbered from 1)")


def agreed_time(now: float) -> float:
    """The largest of every rank's `now` (one all-reduce on the default group)."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([now], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


class StepProfiler:
    """Profiles the steps `first`..`last` of this rank; `before_step`/`after_step` around each
    step of the rank loop, `close` when the loop ends (drops an unfinished window)."""

    def __init__(self, first: int, last: int, rank: int, checkpoint_uri: str,
                 storage_options: dict[str, Any] | None = None, request: int = 0) -> None:
        self.first, self.last, self.rank = first, last, rank
        self.uri, self.storage_options = checkpoint_uri, storage_options or {}
        self.active: Any = None
        # a request's id is the epoch milliseconds the controller asked at: it names the
        # location, which the controller can then tell its caller before any rank starts
        self.request = request
        self.location = (diagnostics_location(checkpoint_uri, "profile", request / 1000)
                         if request else "")
        self.began_at, self.began_step = 0.0, 0

    @classmethod
    def from_spec(cls, spec: Any, rank: int, storage_options: dict[str, Any] | None
                  ) -> "StepProfiler | None":
        window = spec.train.profile_steps
        if not window:
            return None
        return cls(window[0], window[1], rank, spec.checkpoint.uri, storage_options)

    def before_step(self, step: int) -> None:
        """`step` (1-based) is about to run: start the window at its first step still to run."""
        if self.active is not None or not self.first <= step <= self.last:
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        if not self.request:
            self.location = diagnostics_location(self.uri, "profile", agreed_time(time.time()))
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self.active = profile(activities=activities, record_shapes=False)
        self.active.__enter__()
        self.began_at, self.began_step = time.perf_counter(), step

    def after_step(self, step: int, target: int) -> list[dict[str, Any]]:
        """`step` ran: at the window's end (or the run's), keep the trace; rank 0's `profile`
        event once every rank kept its own."""
        if self.active is None or step < min(self.last, target):
            return []
        prof, self.active = self.active, None
        prof.__exit__(None, None, None)
        steps = [self.began_step, step]
        start = time.perf_counter()
        wrote = self._keep(prof)
        agreed_time(0.0)  # every rank has written (or failed to): the location is complete
        if self.rank != 0:
            return []
        asked = {"request": self.request} if self.request else {}
        return [{"event": "profile", "step": step, "steps": steps, "diagnostics": self.location,
                 "written": wrote, "seconds": round(start - self.began_at, 3),
                 "export_s": round(time.perf_counter() - start, 3), **asked}]

    def _keep(self, prof: Any) -> bool:
        """Export the trace locally, copy it to the location; False (a warning) on failure."""
        import fsspec

        target = f"{self.location}/{TRACE_NAME.format(rank=self.rank)}"
        handle, local = tempfile.mkstemp(suffix=".trace.json")
        os.close(handle)
        try:
            prof.export_chrome_trace(local)
            fs, path = fsspec.core.url_to_fs(target, **self.storage_options)
            fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            fs.put_file(local, path)
            return True
        except Exception as err:  # a trace is a courtesy: training goes on without it
            logger.warning("rank %d: could not keep the profile at %s: %s: %s", self.rank,
                           target, type(err).__name__, err)
            return False
        finally:
            os.unlink(local)

    def close(self) -> None:
        """The loop ended inside the window (a stop or a failure): drop what was recorded."""
        if self.active is not None:
            prof, self.active = self.active, None
            prof.__exit__(None, None, None)
            logger.warning("rank %d: the profiled window ended early; no trace kept", self.rank)


class ProfileWindows:
    """The rank loop's profiling: the spec's window, then any window a request asks for.

    A request (`tenax profile JOB --steps N`, through the agent) is agreed on by every rank at
    a step boundary (workers/rank.py), so all start it at the same step; one that arrives while
    a window is being recorded waits for its end; one handled already is ignored; a spec window
    not begun yet gives way to a request."""

    def __init__(self, spec: Any, rank: int, storage_options: dict[str, Any] | None) -> None:
        self.rank, self.uri, self.storage_options = rank, spec.checkpoint.uri, storage_options
        self.current = StepProfiler.from_spec(spec, rank, storage_options)
        self.handled = 0

    def on_request(self, request: int, steps: int, next_step: int) -> None:
        """Every rank agreed on (request, steps) at the boundary before `next_step`."""
        busy = self.current is not None and self.current.active is not None
        if request <= self.handled or steps < 1 or busy:
            return
        self.handled = request
        self.current = StepProfiler(next_step, next_step + steps - 1, self.rank, self.uri,
                                    self.storage_options, request)

    def before_step(self, step: int) -> None:
        if self.current is not None:
            self.current.before_step(step)

    def after_step(self, step: int, target: int) -> list[dict[str, Any]]:
        return self.current.after_step(step, target) if self.current is not None else []

    def close(self) -> None:
        if self.current is not None:
            self.current.close()
