"""The controller's side of tracking: failures, recoveries and rescales, which rank 0 never
sees, as a TensorBoard run of their own, `<logging.tensorboard_dir>/job`.

Why a run of its own and not rank 0's: rank 0's attempts purge the steps they redo (a START at
each attempt's first step), and a failure is told at the last step reached, which the next
attempt redoes; in the same run it would vanish. The `job` run is never purged (event files of
version 2 without a START). Scalars: job/restarts and job/lost_steps (running totals of this
controller), job/recovery_s and job/rescale_s at the step training resumed; text entries per
kind (failures, recoveries, rescales, checkpoint_failures, stragglers). TensorBoard shows both
runs side by side when pointed at `tensorboard_dir`. The controller must not import torch, and
nothing here does: the writer is protobuf, crc32c and fsspec.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

from tenax.workers.tracking.tracker import JOB_FIGURES, OFF, TEXT_TAGS, Tracker

logger = logging.getLogger(__name__)

JOB_RUN = "job"


class JobEvents:
    """A controller subscriber (`on_event`) writing the job's own events; `close()` at the end.
    `report` hears, as a `tracking_off` record with `run: "job"`, that this run's writer was
    switched off (a directory that cannot be written): the user learns it from the job's
    events, as from rank 0's run, not from the controller's log alone."""

    def __init__(self, tensorboard_dir: str,
                 report: Callable[[dict[str, Any]], None] | None = None) -> None:
        from tenax.workers.tracking.tensorboard_writer import TensorBoardWriter

        uri = f"{tensorboard_dir.rstrip('/')}/{JOB_RUN}"
        self.tracker = Tracker([TensorBoardWriter(uri, attempt=False)], 0, {})
        if report is not None:
            self.tracker.report = lambda notice: report({**notice, "run": JOB_RUN})
        self.restarts, self.lost_steps = 0, 0

    def on_event(self, event: Mapping[str, Any]) -> None:
        kind = event.get("event")
        if kind in TEXT_TAGS and kind != OFF:  # a backend switched off: rank 0's run says so
            self.tracker.submit(dict(event))
        figures: dict[str, Any] = {}
        if kind == "recovered":
            self.restarts += 1
            self.lost_steps += int(event.get("lost_steps", 0))
            figures = {"restarts": self.restarts, "lost_steps": self.lost_steps,
                       "recovery_s": event.get("seconds")}
        elif kind == "scaled":
            self.lost_steps += int(event.get("lost_steps", 0))
            figures = {"lost_steps": self.lost_steps, "rescale_s": event.get("seconds")}
        if figures:
            self.tracker.submit({"event": JOB_FIGURES, "step": event.get("step"),
                                 "time": event.get("time"), **figures})
        self.tracker.report_off()  # a writer switched off since: told on this thread

    def close(self) -> None:
        self.tracker.close()


def job_events(spec: Mapping[str, Any],
               report: Callable[[dict[str, Any]], None] | None = None) -> JobEvents | None:
    """The controller's writer when the spec asks for TensorBoard, else None."""
    tensorboard_dir = (spec.get("logging") or {}).get("tensorboard_dir")
    return JobEvents(tensorboard_dir, report) if tensorboard_dir else None
