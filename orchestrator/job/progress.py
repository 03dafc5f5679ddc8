"""What a job controller learns from its ranks' records: progress, goodput, and the `scaled` and
`recovered` events that a (re)start closes.

Accounting only: nothing here decides, and nothing here reaches into the controller.
`JobProgress.absorb` updates the job's own figures (step, loss, steps lost, goodput) record by
record and yields what each record means for the controller: an event to publish (`Notice`),
which may close the rescale or the recovery the controller holds open.

Why it yields instead of returning a list: a subscriber handed an event may read the job's
figures (the service stores the job's status with each event), so each event is published
while the figures are those of its own record, not of the last record of the poll.

Every committed version is told exactly once (`CommitLedger`). Rank 0 tells of its commits: its
writer hands the `checkpoint` event over the moment the manifest is written
(checkpoint/manager.py). What that cannot cover is a rank 0 killed between the manifest and the
hand-over, or an event still in its agent when the controller gave up on the attempt (a
restart starts the agents' records afresh). Storage knows of every commit, so the controller
looks there when an attempt is over — when the next attempt's rank 0 started (the old
processes are gone by then, so no late commit can slip in behind the look), and when the job
ends — and tells the commits it was not told of, from their manifests: the same fields as the
rank's event, plus `told_by: "controller"`. Why this design rather than a last poll of the
agents: the agents hold nothing of a process killed before it spoke, the catalog does. A
commit is named by its manifest's `created_at`, not by its step: a step saved again (an attempt
resumed below it) is another commit and told again; the same commit is never told twice.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, Iterator

from tenax.orchestrator.job.facts import Recovery, Rescaling
from tenax.orchestrator.job.goodput import Goodput
from tenax.parallel import ParallelLayout

logger = logging.getLogger(__name__)

__all__ = ["CommitLedger", "JobProgress", "Notice", "committed_events"]

# (lowest step) -> `checkpoint` events of the committed versions above it (storage's view)
CommitReader = Callable[[int], list[dict[str, Any]]]


@dataclass(frozen=True)
class Notice:
    """An event to publish; a rank's record keeps the `time` the rank stamped it with."""
    event: str
    fields: dict[str, Any]
    # rescale | recovery | snapshots: the open fact this event ends (the controller resets it)
    closes: str = ""


@dataclass
class CommitLedger:
    """The commits this controller told of, and the attempts whose commits it has not checked
    against storage yet (module docstring)."""
    launched: float = field(default_factory=time.time)  # older versions were told before
    told: dict[int, str] = field(default_factory=dict)  # step -> created_at of the one told
    # the lowest step the attempts not yet checked started at; they committed only above it
    low: int | None = None

    def note(self, event: dict[str, Any]) -> None:
        """A `checkpoint` event was told."""
        self.told[int(event["step"])] = str(event.get("created_at", ""))

    def untold(self, found: list[dict[str, Any]], high: int | None) -> list[dict[str, Any]]:
        """Of the commits `found` in storage, those of the checked attempts (step in
        (low, high]) created since launch and not told; each noted as told now."""
        out = []
        for event in sorted(found, key=lambda e: e["step"]):
            step, created = int(event["step"]), str(event.get("created_at", ""))
            if self.low is None or step <= self.low or (high is not None and step > high):
                continue
            if created == self.told.get(step) or _wall(created) < self.launched:
                continue  # told already, or older than this controller (a resumed job's)
            self.note(event)
            out.append({**event, "time": _wall(created) or time.time(),
                        "told_by": "controller"})
        return out


def _wall(created_at: str) -> float:
    """A manifest's created_at as seconds since the epoch (0.0 when it has none)."""
    try:
        return datetime.fromisoformat(created_at).timestamp()
    except (TypeError, ValueError):
        return 0.0


def committed_events(uri: str, timeout_s: float) -> CommitReader:
    """A `CommitReader` over the job's checkpoint storage at `uri` (reads bounded by
    `timeout_s`); one that cannot read logs why and finds nothing (the job goes on)."""
    def read(low: int) -> list[dict[str, Any]]:
        from tenax.checkpoint import Catalog, Storage
        from tenax.checkpoint.save import commit_event

        try:
            catalog = Catalog(Storage(uri, timeout_s=timeout_s))
            return [commit_event(catalog.manifest(step)) for step in catalog.committed_steps()
                    if step > low]
        except Exception as exc:  # telling of a commit must never fail the job
            logger.warning("cannot read the committed versions at %s (%s: %s): a commit whose "
                           "rank was killed before telling of it stays untold", uri,
                           type(exc).__name__, exc)
            return []
    return read


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
    commits: CommitLedger = field(default_factory=CommitLedger)
    read_commits: CommitReader | None = None  # storage's commits (None: told by ranks only)

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
                yield from self.untold_commits(high=record["step"])  # the attempts before
                self.commits.low = record["step"]
                self.goodput.end(record_age_s(record))  # what follows is training
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
                if kind == "checkpoint":
                    self.commits.note(record)
                yield relayed(record)

    def untold_commits(self, high: int | None = None) -> Iterator[Notice]:
        """The commits of the attempts not yet checked (step at most `high`; None: the job
        is over) that no rank told of, as `checkpoint` events; those attempts are checked."""
        if self.commits.low is None or self.read_commits is None:
            return
        for event in self.commits.untold(self.read_commits(self.commits.low), high):
            logger.warning("job %s: checkpoint step %d was committed but its rank did not tell "
                           "of it; told from storage", self.job_id, event["step"])
            self.goodput.checkpoint_blocked(event.get("blocked_s", 0.0))
            yield Notice("checkpoint", {k: v for k, v in event.items() if k != "event"})
        if high is None:
            self.commits.low = None

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
        elapsed = time.monotonic() - failed_at
        # Until rank 0 started, not until this poll saw it (a heartbeat later).
        seconds = round(elapsed - min(record_age_s(record), elapsed), 3)
        logger.info("job %s: recovered at step %d from %s in %.2fs, %d step(s) lost",
                    self.job_id, resumed, source, seconds, lost)
        fields = {"step": resumed, "layout": layout.degrees(), "world_size": layout.world_size,
                  "lost_steps": lost, "seconds": seconds, "source": source}
        if "time" in record:
            fields["time"] = record["time"]
        return Notice("recovered", fields, closes="recovery")


def record_age_s(record: dict[str, Any]) -> float:
    """How long ago a rank stamped `record`, by its own `time` on the rank's clock (0 without
    one, or when another host's clock runs ahead of this one's)."""
    return max(0.0, time.time() - float(record.get("time", time.time())))


def relayed(record: dict[str, Any]) -> Notice:
    """A rank's record as an event, keeping the `time` the rank stamped it with."""
    return Notice(record["event"], {k: v for k, v in record.items() if k not in ("event", "rank")})
