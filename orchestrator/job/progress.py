"""What a job controller learns from its ranks' records: progress, goodput, and the `scaled` and
`recovered` events that a (re)start closes. Accounting only: nothing here decides."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from tenax.orchestrator.job.facts import Rescaling

if TYPE_CHECKING:
    from tenax.orchestrator.job.controller import Controller

logger = logging.getLogger(__name__)


def absorb(ctl: "Controller", records: list[dict[str, Any]]) -> None:
    for record in records:
        kind = record.get("event")
        if kind == "started" and record["rank"] == 0:
            ctl.goodput.end()  # startup is over: what follows is training
            ctl.step = max(ctl.step, record["step"])  # a resumed job starts here
            on_started(ctl, record)
        elif kind == "step":
            ctl.max_step_seen = max(ctl.max_step_seen, record["step"])
            if record["rank"] == 0:
                ctl.step, ctl.loss, ctl.stepped = record["step"], record["loss"], True
                ctl.goodput.step(record.get("step_s", 0.0))
                relay(ctl, record)
        elif kind == "snapshot" and record["rank"] == 0 and record.get("first"):
            relay(ctl, record)  # once per attempt (what one costs); every step would flood
        elif kind in ("checkpoint", "checkpoint_failed") and record["rank"] == 0:
            ctl.goodput.checkpoint_blocked(record.get("blocked_s", 0.0))
            relay(ctl, record)


def relay(ctl: "Controller", record: dict[str, Any]) -> None:
    """A rank's record as an event, keeping the `time` the rank stamped it with."""
    ctl.publish(record["event"], **{k: v for k, v in record.items() if k not in ("event", "rank")})


def on_started(ctl: "Controller", record: dict[str, Any]) -> None:
    """Rank 0 started: close a rescale (`scaled`) or a recovery (`recovered`) if one is open."""
    rescaled, rec = ctl.rescaling, ctl.recovery
    if rescaled.stopped and rescaled.old is not None:
        ctl.publish("scaled", step=record["step"], **{"from": rescaled.old.degrees()},
                    from_world=rescaled.old.world_size, layout=ctl.layout.degrees(),
                    world_size=ctl.layout.world_size,
                    seconds=round(time.monotonic() - rescaled.since, 3),
                    lost_steps=max(0, ctl.max_step_seen - record["step"]))
        ctl.rescaling = Rescaling()
    if rec.failed_at is None:
        return
    resumed = record["step"]
    lost = max(0, ctl.max_step_seen - resumed)
    ctl.lost_steps += lost
    ctl.goodput.lost_steps(lost)
    source = rec.source if record.get("source") == "memory" else record.get("source") or "none"
    seconds = round(time.monotonic() - rec.failed_at, 3)
    logger.info("job %s: recovered at step %d from %s in %.2fs, %d step(s) lost",
                ctl.job_id, resumed, source, seconds, lost)
    ctl.publish("recovered", step=resumed, layout=ctl.layout.degrees(),
                world_size=ctl.layout.world_size, lost_steps=lost, seconds=seconds, source=source)
    rec.failed_at = None
