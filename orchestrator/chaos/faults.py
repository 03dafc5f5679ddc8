"""Fault injection for drills and tests: `--chaos "kill rank=1 at=30; hang rank=0 at=50"`.

The faults are real, not simulated: a killed rank's process gets SIGKILL, a killed node's ranks
all die and the node is treated as lost, a hung rank stops stepping (its peers block in their
next collective), a slow rank sleeps so each step takes F times as long, a corrupted checkpoint
has bytes flipped on storage. A drill is how a user learns to trust a job before it runs on
hundreds of GPUs for weeks.

Each fault fires once per job, not once per attempt: a restart resumes from an earlier step and
would otherwise meet the same `at=` again forever. A small Ray actor (the ledger) records what
fired; a rank claims an event before injecting it. The rank side (`ChaosEvent`,
`ChaosInjector`) lives in workers/chaos_injector.py, re-exported here.
"""
from __future__ import annotations

import logging
import re
import time

from tenax.orchestrator.errors import ChaosError
from tenax.workers import ChaosEvent, ChaosInjector

logger = logging.getLogger(__name__)

KINDS = ("kill", "hang", "slow", "scale", "corrupt-checkpoint")
__all__ = ["KINDS", "ChaosEvent", "ChaosInjector", "ChaosLedger",
           "corrupt_newest_checkpoint", "parse_chaos", "validate_for_job"]


_FIELD = re.compile(r"^(rank|node|at|factor|nodes)=([^=\s]+)$")


def _parse_one(text: str) -> ChaosEvent:
    words = text.split()
    kind = words[0]
    if kind not in KINDS:
        raise ChaosError(f"--chaos {text!r}: unknown fault {kind!r} (known: {', '.join(KINDS)})")
    fields: dict[str, str] = {}
    for word in words[1:]:
        match = _FIELD.match(word)
        if not match:
            raise ChaosError(f"--chaos {text!r}: cannot read {word!r} (expected KEY=VALUE with "
                             "KEY in rank, node, at, factor, nodes)")
        fields[match.group(1)] = match.group(2)
    try:
        event = ChaosEvent(kind=kind, at=int(fields["at"]),
                           rank=int(fields["rank"]) if "rank" in fields else None,
                           node=int(fields["node"]) if "node" in fields else None,
                           factor=float(fields.get("factor", 1.0)),
                           nodes=int(fields["nodes"]) if "nodes" in fields else None)
    except KeyError:
        raise ChaosError(f"--chaos {text!r}: missing at=STEP") from None
    except ValueError as err:
        raise ChaosError(f"--chaos {text!r}: {err}") from None
    _check(event, text)
    return event


def _check(e: ChaosEvent, text: str) -> None:
    if e.at < 1:
        raise ChaosError(f"--chaos {text!r}: at={e.at} must be >= 1")
    if e.kind == "kill" and (e.rank is None) == (e.node is None):
        raise ChaosError(f"--chaos {text!r}: kill needs exactly one of rank=R or node=N")
    if e.kind in ("hang", "slow") and e.rank is None:
        raise ChaosError(f"--chaos {text!r}: {e.kind} needs rank=R")
    if e.kind == "slow" and e.factor <= 1.0:
        raise ChaosError(f"--chaos {text!r}: factor={e.factor} must be > 1")
    if e.kind == "scale" and (e.nodes is None or e.nodes < 1):
        raise ChaosError(f"--chaos {text!r}: scale needs nodes=N >= 1")


def parse_chaos(spec: str | None) -> list[ChaosEvent]:
    """Parse `kill rank=R at=STEP; ...` (events separated by `;`)."""
    if not spec:
        return []
    return [_parse_one(part.strip()) for part in spec.split(";") if part.strip()]


def validate_for_job(events: list[ChaosEvent], world: int, nodes: int, steps: int) -> None:
    for e in events:
        if e.rank is not None and not 0 <= e.rank < world:
            raise ChaosError(f"--chaos {e.kind} rank={e.rank}: the job has ranks 0..{world - 1}")
        if e.node is not None and not 0 <= e.node < nodes:
            raise ChaosError(f"--chaos {e.kind} node={e.node}: the job has nodes 0..{nodes - 1}")
        if e.at > steps:
            raise ChaosError(f"--chaos {e.kind} at={e.at}: the job stops at train.steps={steps}")


class ChaosLedger:
    """Ray actor body: remembers which (event, rank) faults already fired in this job."""

    def __init__(self) -> None:
        self.fired: dict[str, float] = {}

    def claim(self, key: str) -> bool:
        if key in self.fired:
            return False
        self.fired[key] = time.time()  # when it fired: detection latency is measured from here
        return True

    def fired_events(self) -> dict[str, float]:
        return dict(self.fired)


def corrupt_newest_checkpoint(uri: str) -> str:
    """Flip bytes in the middle of the largest shard of the newest committed version."""
    from tenax.checkpoint import Catalog, Storage, version_name

    catalog = Catalog(Storage(uri))
    steps = catalog.committed_steps()
    if not steps:
        return "no committed checkpoint to corrupt"
    step = steps[-1]
    files = catalog.manifest(step).files
    rel, entry = max(files.items(), key=lambda item: item[1].size)
    path = f"{version_name(step)}/{rel}"
    data = bytearray(catalog.storage.read_bytes(path))
    middle = len(data) // 2
    for i in range(middle, min(middle + 16, len(data))):
        data[i] ^= 0xFF
    catalog.storage.write_bytes(path, bytes(data))
    logger.warning("chaos: corrupted %s of step %d", rel, step)
    return f"flipped 16 bytes of {path}"
