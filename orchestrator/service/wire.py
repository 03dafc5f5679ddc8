"""Conversions between the service's records and the `tenax.v1` messages, both directions.

Why one module: the server builds messages from store records and controller status, and the
CLI turns messages back into the same plain dicts it prints or emits as `--json`; keeping both
directions side by side keeps the two in step when a field is added to jobs.proto.
"""
from __future__ import annotations

import json
import logging
from typing import Any

from tenax.orchestrator.service.store import EventRecord, JobRecord
from tenax.proto import jobs_pb2 as pb

logger = logging.getLogger(__name__)

LAYOUT_KEYS = ("dp", "tp", "pp", "cp", "ep", "zero")
_INT32 = (-2**31, 2**31)
_INT64 = (-2**63, 2**63)


def state_enum(name: str) -> int:
    """"RUNNING" -> JOB_STATE_RUNNING; "" -> JOB_STATE_UNSPECIFIED; ValueError if unknown."""
    return pb.JobState.Value(f"JOB_STATE_{name}") if name else pb.JOB_STATE_UNSPECIFIED


def state_name(value: int) -> str:
    """JOB_STATE_RUNNING -> "RUNNING"; ValueError for a number jobs.proto does not define."""
    return pb.JobState.Name(value).removeprefix("JOB_STATE_")


def _set_time(message: Any, seconds: float) -> None:
    message.FromNanoseconds(int(seconds * 1e9))


def set_layout(message: Any, doc: Any) -> None:
    if not isinstance(doc, dict):
        return
    for key in LAYOUT_KEYS:
        value = doc.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and \
                _INT32[0] <= value < _INT32[1]:
            setattr(message, key, value)


def _fit(value: Any, bounds: tuple[int, int], what: str) -> int:
    """An int for a proto field; a stored value outside the field's range (a job stored before
    submissions were checked) is clamped and logged, so one bad row cannot fail every listing."""
    number = int(value or 0) if not isinstance(value, bool) else int(value)
    if bounds[0] <= number < bounds[1]:
        return number
    logger.warning("%s=%d does not fit its wire type; sent clamped", what, number)
    return max(bounds[0], min(number, bounds[1] - 1))


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def job_message(record: JobRecord, status: dict[str, Any], target_nodes: int) -> pb.Job:
    spec = json.loads(record.spec_json)
    msg = pb.Job(job_id=record.job_id, name=record.name, state=state_enum(record.state),
                 step=_fit(status.get("step"), _INT64, "step"),
                 total_steps=_fit(spec["train"]["steps"], _INT64, "train.steps"),
                 world_size=_fit(status.get("world_size"), _INT32, "world_size"),
                 restarts=_fit(status.get("restarts"), _INT32, "restarts"),
                 lost_steps=_fit(status.get("lost_steps"), _INT64, "lost_steps"),
                 cause=record.cause, checkpoint_uri=record.checkpoint_uri,
                 target_nodes=_fit(target_nodes, _INT32, "target_nodes"),
                 spec_json=record.spec_json)
    if _number(status.get("loss")) is not None:
        msg.loss = _number(status["loss"])
    goodput = status.get("goodput")
    if isinstance(goodput, dict) and _number(goodput.get("goodput")) is not None:
        msg.goodput = _number(goodput["goodput"])
    if status.get("layout"):
        set_layout(msg.layout, status["layout"])
    _set_queue(msg, spec, record.state, status)
    msg.preflight = str(status.get("preflight") or "")
    _set_time(msg.created_at, record.created_at)
    _set_time(msg.updated_at, record.updated_at)
    return msg


def _set_queue(msg: pb.Job, spec: dict[str, Any], state: str, status: dict[str, Any]) -> None:
    """Scheduling fields: priority, queue position and what a QUEUED job waits for, GPUs held."""
    msg.priority = _fit(spec.get("priority", 0), _INT32, "priority")
    msg.gpus = _fit(status.get("gpus"), _INT32, "gpus")
    if _number(status.get("queued_s")) is not None:
        msg.queued_seconds = _number(status["queued_s"])
    if state == "QUEUED":
        msg.queue_position = _fit(status.get("queue_position"), _INT32, "queue_position")
        msg.waiting_for = str(status.get("waiting_for") or "")


def version_message(version: dict[str, Any], max_bytes: int | None = None) -> pb.CheckpointVersion:
    """One checkpoint version (JobManager.checkpoints) as ListCheckpoints sends it. A manifest
    that alone would make the message pass `max_bytes` (a job of tens of thousands of files) is
    replaced by a note of its size and where to read it, with the step kept: one version must
    always fit a reply, or the client could never list past it."""
    item = pb.CheckpointVersion(step=version["step"], committed=version["committed"],
                                size_bytes=version["size_bytes"],
                                world_size=version.get("world_size", 0),
                                created_at=version.get("created_at", ""),
                                manifest_json=version.get("manifest_json", ""))
    set_layout(item.layout, version.get("layout"))
    if max_bytes is not None and item.ByteSize() > max_bytes:
        size = len(item.manifest_json)
        logger.info("checkpoint step %d: manifest of %d bytes left out of the listing (a reply "
                    "holds %d)", item.step, size, max_bytes)
        item.manifest_json = json.dumps({
            "step": item.step, "omitted_bytes": size,
            "omitted": f"the manifest ({size} bytes) is larger than one reply ({max_bytes} "
                       f"bytes): read it with `tenax ckpt inspect URI --step {item.step}`"})
    return item


def event_message(record: EventRecord) -> pb.JobEvent:
    e = record.event
    msg = pb.JobEvent(job_id=record.job_id, seq=record.seq, kind=record.kind, step=record.step,
                      json=json.dumps(e, default=str),
                      reason=str(e.get("reason") or e.get("cause") or ""))
    _set_time(msg.time, record.time)
    if record.kind == "state":
        try:
            msg.state = state_enum(str(e.get("state", "")))
        except ValueError:
            logger.warning("event %d of job %s: unknown state %r", record.seq, record.job_id,
                           e.get("state"))
    if _number(e.get("loss")) is not None:
        msg.loss = _number(e["loss"])
    set_layout(msg.layout, e.get("layout"))
    if isinstance(e.get("world_size"), int) and _INT32[0] <= e["world_size"] < _INT32[1]:
        msg.world_size = e["world_size"]
    return msg


def layout_dict(message: Any, present: bool) -> dict[str, int] | None:
    return {k: getattr(message, k) for k in LAYOUT_KEYS} if present else None


def job_dict(job: pb.Job) -> dict[str, Any]:
    """The `--json` form of a Job: plain numbers (int64 stays a number), ISO-free unix times."""
    return {"job_id": job.job_id, "name": job.name, "state": state_name(job.state),
            "step": job.step, "total_steps": job.total_steps,
            "loss": job.loss if job.HasField("loss") else None,
            "layout": layout_dict(job.layout, job.HasField("layout")),
            "world_size": job.world_size, "target_nodes": job.target_nodes,
            "restarts": job.restarts, "lost_steps": job.lost_steps, "cause": job.cause,
            "goodput": job.goodput, "checkpoint_uri": job.checkpoint_uri,
            "priority": job.priority, "queue_position": job.queue_position,
            "waiting_for": job.waiting_for, "gpus": job.gpus,
            "queued_seconds": job.queued_seconds, "preflight": job.preflight,
            "created_at": job.created_at.ToNanoseconds() / 1e9,
            "updated_at": job.updated_at.ToNanoseconds() / 1e9}


def event_dict(event: pb.JobEvent) -> dict[str, Any]:
    """The event's own JSON plus seq and time (what `tenax watch --json` prints per line)."""
    try:
        doc = json.loads(event.json) if event.json else {}
    except ValueError:
        doc = {}
    if not isinstance(doc, dict):
        doc = {"value": doc}
    doc.setdefault("event", event.kind)
    return {**doc, "seq": event.seq, "time": event.time.ToNanoseconds() / 1e9}
