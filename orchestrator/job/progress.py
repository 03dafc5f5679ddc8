"""What a job controller learns from its ranks' records: progress, goodput, and the `scaled` and
`recovered` events that a (re)start closes.

Accounting only: nothing here decides, and nothing here reaches into the controller.
`JobProgress.absorb` updates the job's own figures (step, loss, steps lost, goodput) record by
record and yields what each record means for the controller: an event to publish (`Notice`),
which may close the rescale or the recovery the controller holds open.

Why it yields instead of returning a list: a subscriber handed an event may read the job's
figures (the service stores the job's status with each event), so each event is published
while the figures are those of its own record, not of the last record of the poll.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from tenax.orchestrator.job.facts import Recovery, Rescaling
from tenax.orchestrator.job.goodput import Goodput
from tenax.parallel import ParallelLayout

logger = logging.getLogger(__name__)

__all__ = ["JobProgress", "Notice"]


@dataclass(frozen=True)
class Notice:
    """An event to publish; a rank's record keeps the `time` the rank stamped it with."""
    event: str
    fields: dict[str, Any]
    # rescale | recovery | snapshots: the open fact this event ends (the controller resets it)
    closes: str = ""


@dataclass
class JobProgress:
    """The job's figures as rank 0 reports them, and the goodput they feed."""
    job_id: str
    goodput: Goodput = field(default_factory=Goodput)
    step: int = 0
    loss: float | None = None
    stepped: bool = False  # a step ran under this controller (else the job was already done)
    max_step_seen: int = 0  # by any rank: what a failure loses is counted from here
    lost_steps: int = 0

    def absorb(self, records: list[dict[str, Any]], layout: ParallelLayout | None,
               rescaling: Rescaling, recovery: Recovery) -> Iterator[Notice]:
        """Account for the records in order, yielding each event as its record is accounted
        for; `rescaling` and `recovery` are read, never changed."""
        rescale_open = rescaling.stopped and rescaling.old is not None
        failed_at = recovery.failed_at
        self.goodput.cold_start.observe(records)  # launch -> first step, once
        for record in records:
            kind = record.get("event")
            if kind == "started" and record["rank"] == 0:
                self.goodput.end()  # startup is over: what follows is training
                self.step = max(self.step, record["step"])  # a resumed job starts here
                if rescale_open and layout is not None:
                    rescale_open = False
                    yield self._scaled(record, rescaling, layout)
                if failed_at is not None and layout is not None:
                    since, failed_at = failed_at, None
                    yield self._recovered(record, since, recovery.source, layout)
            elif kind == "step":
                self.max_step_seen = max(self.max_step_seen, record["step"])
                if record["rank"] == 0:
                    self.step, self.loss, self.stepped = record["step"], record["loss"], True
                    self.goodput.step(record.get("step_s", 0.0))
                    yield relayed(record)
            elif kind == "snapshot" and record["rank"] == 0 and record.get("first"):
                yield relayed(record)  # once per attempt (what one costs); every step would flood
            elif kind == "snapshots_off" and record["rank"] == 0:  # every rank stopped alike
                yield Notice(record["event"], relayed(record).fields, closes="snapshots")
            elif kind in ("eval", "profile", "tracking_off") and record["rank"] == 0:
                yield relayed(record)  # rank 0 speaks for all (and only rank 0 tracks)
            elif kind in ("checkpoint", "checkpoint_failed") and record["rank"] == 0:
                self.goodput.checkpoint_blocked(record.get("blocked_s", 0.0))
                yield relayed(record)

    def _scaled(self, record: dict[str, Any], rescaling: Rescaling,
                layout: ParallelLayout) -> Notice:
        """Rank 0 started after a planned stop: the rescale is over."""
        old = rescaling.old
        return Notice("scaled", {
            "step": record["step"], "from": old.degrees(), "from_world": old.world_size,
            "layout": layout.degrees(), "world_size": layout.world_size,
            "seconds": round(time.monotonic() - rescaling.since, 3),
            "lost_steps": max(0, self.max_step_seen - record["step"])}, closes="rescale")

    def _recovered(self, record: dict[str, Any], failed_at: float, memory_source: str,
                   layout: ParallelLayout) -> Notice:
        """Rank 0 resumed after a failure: count what was lost; the recovery is over."""
        resumed = record["step"]
        lost = max(0, self.max_step_seen - resumed)
        self.lost_steps += lost
        self.goodput.lost_steps(lost)
        source = memory_source if record.get("source") == "memory" else \
            record.get("source") or "none"
        seconds = round(time.monotonic() - failed_at, 3)
        logger.info("job %s: recovered at step %d from %s in %.2fs, %d step(s) lost",
                    self.job_id, resumed, source, seconds, lost)
        return Notice("recovered", {"step": resumed, "layout": layout.degrees(),
                                    "world_size": layout.world_size, "lost_steps": lost,
                                    "seconds": seconds, "source": source}, closes="recovery")


def relayed(record: dict[str, Any]) -> Notice:
    """A rank's record as an event, keeping the `time` the rank stamped it with."""
    return Notice(record["event"], {k: v for k, v in record.items() if k not in ("event", "rank")})
