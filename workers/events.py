"""Typed job events: a kind, its fields, the time it happened, and one human rendering.

Why one module: a rank's step, a checkpoint commit, a failure the controller detected and a
state change travel through the worker, the controller, the service's store and three
front-ends (`tenax run`, `tenax watch`, `python -m tenax.workers.launch`). They are plain JSON
objects on the wire and in `--log-json` (the pinned fields of DESIGN.md, unchanged), and this
module is the one place that knows how each kind reads as a sentence. It lives in `workers/`
because the lowest layer that emits events is the rank; the orchestrator imports it from here.

`time` is seconds since the epoch, taken where the event happened: the rank's clock for a
step or a checkpoint, the controller's for a decision. Relaying an event never restamps it,
so recovery and step timings can be read from the log alone.
"""
from __future__ import annotations

import json
import logging
import time as clock
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

logger = logging.getLogger(__name__)

SERVICE_KINDS = ("queued", "admitted", "shrunk", "grown", "preempted")


@dataclass(frozen=True)
class Event:
    kind: str
    fields: Mapping[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=clock.time)

    @classmethod
    def make(cls, kind: str, /, **fields: Any) -> "Event":
        """A new event, stamped now unless `fields` carries the `time` it happened at."""
        when = fields.pop("time", None)
        return cls(kind, fields, float(when) if isinstance(when, (int, float)) else clock.time())

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> "Event":
        fields = {k: v for k, v in doc.items() if k not in ("event", "time")}
        when = doc.get("time")
        return cls(str(doc.get("event", "")), fields,
                   float(when) if isinstance(when, (int, float)) and not isinstance(when, bool)
                   else clock.time())

    def to_dict(self) -> dict[str, Any]:
        """The JSON object: `event` first, the kind's pinned fields, then `time`."""
        return {"event": self.kind, **self.fields, "time": round(self.time, 6)}

    def human(self) -> str:
        """One sentence (capital first, full stop last) saying what happened."""
        render = _RENDER.get(self.kind)
        try:
            text = render(self.fields) if render else _generic(self.kind, self.fields)
        except (KeyError, TypeError, ValueError) as err:  # an old or partial record
            logger.debug("event %s rendered generically: %s", self.kind, err)
            text = _generic(self.kind, self.fields)
        return _sentence(text)


def human(doc: Mapping[str, Any]) -> str:
    """The sentence for an event given as its JSON object."""
    return Event.from_dict(doc).human()


def stamp(record: Mapping[str, Any]) -> dict[str, Any]:
    """`record` with a `time` of now when it has none (used where an event is created)."""
    return {**record, "time": record.get("time", round(clock.time(), 6))}


def _sentence(text: str) -> str:
    text = " ".join(text.split()).rstrip(" .;:")
    return (text[:1].upper() + text[1:] + ".") if text else "An event without a description."


def layout_text(layout: Any) -> str:
    """`dp2 tp2 zero1`: the degrees above 1, then the ZeRO stage; `-` when unknown."""
    if not isinstance(layout, Mapping) or not layout:
        return "-"
    dims = [f"{k}{layout[k]}" for k in ("dp", "tp", "pp", "cp", "ep") if layout.get(k, 1) != 1]
    return " ".join(dims + [f"zero{layout.get('zero', 0)}"])


def _loss(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) else "n/a"


def _plural(n: Any, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _generic(kind: str, f: Mapping[str, Any]) -> str:
    rest = ", ".join(f"{k} {json.dumps(v, default=str)}" for k, v in f.items() if k != "job")
    return f"Event {kind or 'unknown'}" + (f": {rest}" if rest else "")


def _step(f: Mapping[str, Any]) -> str:
    return (f"Step {f['step']} done: loss {_loss(f.get('loss'))}, "
            f"{f.get('tokens_per_s') or 0:.0f} tokens/s on {f.get('world_size', '?')} rank(s) "
            f"({layout_text(f.get('layout'))})")


def _done(f: Mapping[str, Any]) -> str:
    if f.get("already_complete"):
        return (f"The job was already complete at step {f['step']}: the newest checkpoint is "
                "the last step, nothing left to train")
    figures = f.get("goodput")
    goodput = figures.get("goodput") if isinstance(figures, dict) else None
    tail = f", goodput {goodput:.0%}" if isinstance(goodput, (int, float)) else ""
    return (f"The job finished at step {f['step']} with loss {_loss(f.get('loss'))} "
            f"({_plural(f.get('restarts', 0), 'restart')}, "
            f"{_plural(f.get('lost_steps', 0), 'lost step')}{tail})")


def _placed(f: Mapping[str, Any]) -> str:
    nodes, blocks = len(set(f.get("nodes") or [])), f.get("blocks")
    mode = f.get("mode")
    how = f" ({mode}: {f.get('reused', 0)} reused, {f.get('created', 0)} new)" if mode else ""
    # One Ray node may hold several of the plan's nodes (an embedded Ray: blocks of
    # resources.gpus_per_node ranks stand in for nodes); say both, as the plan counts blocks.
    split = f" as {blocks} blocks of {f['world_size'] // blocks} ranks" \
        if isinstance(blocks, int) and blocks > 0 and blocks != nodes else ""
    return (f"Placed {f['world_size']} ranks ({layout_text(f.get('layout'))}) on "
            f"{_plural(nodes, 'node')}{split}{how}")


def _scaled(f: Mapping[str, Any]) -> str:
    return (f"Scaled from {f.get('from_world', '?')} to {f.get('world_size', '?')} ranks at step "
            f"{f['step']} ({layout_text(f.get('layout'))}) in {f.get('seconds', 0):.1f} s, "
            f"{_plural(f.get('lost_steps', 0), 'step')} lost")


def _service(kind: str) -> Callable[[Mapping[str, Any]], str]:
    return lambda f: f"The job was {kind}" + (f": {f['reason']}" if f.get("reason") else "")


_RENDER: dict[str, Callable[[Mapping[str, Any]], str]] = {
    "step": _step,
    "done": _done,
    "placed": _placed,
    "scaled": _scaled,
    "state": lambda f: f"The job is {f['state']}" + (f": {f['reason']}" if f.get("reason") else ""),
    "failure": lambda f: (f"At step {f.get('step', '?')} rank {f.get('rank', '?')} failed"
                          + (f" ({f['kind']})" if f.get("kind") else "") + f": {f['cause']}"
                          + (f"; stacks: tenax diagnose {f['diagnostics']}"
                             if f.get("diagnostics") else "")),
    "recovered": lambda f: (f"Recovered from step {f['step']} on {layout_text(f.get('layout'))} "
                            f"in {f.get('seconds', 0):.1f} s "
                            f"({_plural(f.get('lost_steps', 0), 'step')} lost"
                            + (f", read from {f['source']}" if f.get("source") else "") + ")"),
    "eval": lambda f: (f"Validation at step {f['step']}: loss {_loss(f.get('loss'))} over "
                       f"{f.get('tokens', 0)} tokens in {f.get('seconds', 0):.2f} s"),
    "checkpoint": lambda f: (f"Checkpoint of step {f['step']} committed: training blocked "
                             f"{f.get('blocked_s', 0):.3f} s, save took "
                             f"{f.get('total_s', 0):.2f} s"),
    "checkpoint_failed": lambda f: (f"Checkpoint of step {f['step']} failed and training goes on: "
                                    f"{f.get('cause', 'unknown cause')}"),
    "checkpoint_loaded": lambda f: (f"Loaded the checkpoint of step {f['step']} in "
                                    f"{f.get('seconds', 0):.1f} s"
                                    + (f" from {f['source']}" if f.get("source") else "")),
    # the controller relays rank 0's first snapshot of an attempt, without its `rank`
    "snapshot": lambda f: (f"Rank {f.get('rank', 0)} kept step {f['step']} in memory "
                           f"({f.get('bytes', 0)} bytes in {f.get('seconds', 0):.3f} s)"),
    "snapshots_off": lambda f: f"In-memory snapshots are off: {f.get('reason', '')}",
    "tracking_off": lambda f: (f"Tracking to {f.get('backend', 'a backend')}"
                               + (" (the job's own run)" if f.get("run") == "job" else "")
                               + f" is off from step {f.get('step', '?')} and training goes on: "
                               f"{f.get('reason', '')}"),
    "started": lambda f: f"Rank {f.get('rank', 0)} started at step {f['step']}",
    "straggler": lambda f: (f"Rank {f['rank']} is a straggler (score {f['score']:.2f} of the "
                            f"median); action {f.get('action', 'alert')}" + (
                                f"; stacks sampled: tenax diagnose {f['diagnostics']}"
                                if f.get("diagnostics") else "")),
    "profile": lambda f: (f"Profiled steps {f['steps'][0]}-{f['steps'][1]} on every rank: "
                          f"traces at {f['diagnostics']}"),
    "chaos": lambda f: f"Chaos drill {f['kind']}: {f.get('detail', '')}",
    # the verdict, then every row that did not pass (what `tenax status` keeps as `preflight`)
    "preflight": lambda f: f"Preflight {f['verdict']}" + "".join(
        f"; {r['name']} {r['verdict']}: {r.get('detail') or r.get('measured', '')}"
        for r in f.get("rows") or () if r.get("verdict") != "pass"),
    "resumed": lambda f: (f"The service restarted and resumes the job (it was "
                          f"{f.get('was', '?')}): {f.get('reason', '')}"),
    "rank_done": lambda f: f"Rank {f.get('rank', '?')} finished",
    "cancel_requested": lambda f: "Cancel was requested" + (f": {f['reason']}"
                                                            if f.get("reason") else ""),
    **{kind: _service(kind) for kind in SERVICE_KINDS},
}
KINDS = tuple(_RENDER)
