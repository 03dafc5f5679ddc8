"""The rank side of fault injection: the events a drill describes, the one object a drill hands
to the workers (`RankChaos`), and the injector that fires the faults aimed at a rank between
its steps.

It lives in workers/ because it runs inside a rank's training process and imports point one
way (orchestrator -> workers); `tenax.orchestrator.chaos.faults` parses `--chaos` into these
events and re-exports them. A job without a drill hands the workers no `RankChaos` at all
(None): production ranks carry no fault-injection state. Each fault fires once per job, not
once per attempt: a restart resumes from an earlier step and would otherwise meet the same
`at=` again forever, so a rank claims an event (through the job's ledger) before injecting it.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChaosEvent:
    kind: str  # kill | hang | slow | scale | corrupt-checkpoint
    at: int  # fires when the job is about to run step `at`
    rank: int | None = None
    node: int | None = None  # placement order: node k holds ranks [k*g, (k+1)*g)
    factor: float = 1.0
    nodes: int | None = None  # scale target

    @property
    def id(self) -> str:
        target = f"rank={self.rank}" if self.rank is not None else f"node={self.node}"
        return f"{self.kind}:{target}:at={self.at}:nodes={self.nodes}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def targets(self, rank: int, gpus_per_node: int) -> bool:
        """Whether this rank injects the fault (controller-side kinds target no rank)."""
        if self.kind in ("scale", "corrupt-checkpoint"):
            return False
        if self.node is not None:
            return rank // gpus_per_node == self.node
        return self.rank == rank


@dataclass(frozen=True)
class RankChaos:
    """What a drill hands every rank's agent (picklable; crosses Ray). None in production."""
    events: tuple[dict[str, Any], ...]  # ChaosEvent.to_dict() of each fault of the drill
    ledger: Any = None  # the job's ledger actor: a rank claims an event there before injecting
    gpus_per_node: int = 1  # `node=k` targets the ranks [k*g, (k+1)*g)
    head_node: str = ""  # the driver's node: a `kill node` drill never kills its raylet

    def injector(self, rank: int, node_id: str, claim: Callable[[str], bool]) -> ChaosInjector:
        """The fault hook of the training process of `rank`, placed on node `node_id`."""
        return ChaosInjector(list(self.events), rank, self.gpus_per_node, claim,
                             node_killable=node_id != self.head_node)


class ChaosInjector:
    """Runs inside a rank's training process, between steps: injects the faults aimed at it.

    The rank loop's fault hook (workers/rank.py `FaultHook`): `before_step` when the rank is
    about to run a step, `slow_factor` read before each step."""

    def __init__(self, events: list[dict[str, Any]], rank: int, gpus_per_node: int,
                 claim: Callable[[str], bool], node_killable: bool = False) -> None:
        self.events = [ChaosEvent(**e) for e in events]
        self.rank, self.gpus_per_node = rank, gpus_per_node
        self.claim, self.node_killable = claim, node_killable
        self.slow_factor = 1.0

    def before_step(self, step: int) -> None:
        """Called when this rank is about to run `step` (1-based)."""
        for e in self.events:
            if e.at == step and e.targets(self.rank, self.gpus_per_node) \
                    and self.claim(f"{e.id}:{self.rank}"):
                self._inject(e)

    def _inject(self, e: ChaosEvent) -> None:
        logger.warning("chaos: injecting %s on rank %d", e.id, self.rank)
        if e.kind == "kill" and e.node is not None and self.node_killable:
            kill_raylet()
        if e.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif e.kind == "slow":
            self.slow_factor = e.factor  # the trainer stretches this rank's compute by it
        elif e.kind == "hang":
            # Stop stepping but keep the process (and its heartbeats) alive: only the hang
            # timeout can tell. The controller kills this process when it recovers.
            while True:
                time.sleep(1.0)


def slow_down(seconds: float) -> None:
    """A `slow` drill's extra compute time, in a frame of its own so that a straggler's stack
    samples name it (orchestrator/job/health_evidence.py)."""
    time.sleep(seconds)


def kill_raylet() -> None:
    """A real node loss: SIGKILL the raylet this process runs under (never the head's)."""
    import psutil

    for parent in psutil.Process(os.getpid()).parents():
        if parent.name() == "raylet":
            logger.warning("chaos: killing raylet pid %d", parent.pid)
            parent.kill()
            return
