"""The chaos driver: drills from outside the controller, through the doors a user would use.

Why a driver: fault injection is not a decision the controller makes. The driver subscribes to
the controller's events and acts through the same entry points as a user, an operator or the
scheduler: `scale()` (like `tenax scale`), `report_node_lost()` (like a preemption notice from
the cluster), writes on checkpoint storage (like a bad disk). Rank-side faults (kill, hang,
slow) are handed to the ranks, which inject them between steps and claim each one in a small
Ray actor (the ledger) so that it fires once per job, not once per attempt. What placement
hands the ranks is one `RankChaos` (the faults, the ledger, the head node no drill may kill),
built here at the first placing and handed out by `for_ranks()`; the controller keeps none of
it, and a job without a drill has no driver (its ranks get None).

Event ids and the `chaos` event's fields (`kind`, `detail`) are what bench/soak.py audits.
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

from tenax.orchestrator.chaos.faults import ChaosEvent, ChaosLedger, corrupt_newest_checkpoint
from tenax.workers import RankChaos

logger = logging.getLogger(__name__)


class ChaosDriver:
    """Subscribe with `attach(controller)`; then every fault fires when the job reaches it."""

    def __init__(self, events: Sequence[ChaosEvent]) -> None:
        self.events = list(events)
        self.fired: set[str] = set()  # ids of controller-side faults that fired (soak audit)
        self.controller: Any = None
        self.rank_chaos: RankChaos | None = None  # built at the first placing

    @property
    def ledger(self) -> Any:
        """The Ray actor where the ranks claim their faults (None before the first placing)."""
        return self.rank_chaos.ledger if self.rank_chaos is not None else None

    def attach(self, controller: Any) -> None:
        self.controller = controller
        controller.subscribe(self.on_event)

    def on_event(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "state" and event.get("state") == "PLACING" and self.rank_chaos is None:
            self._hand_to_ranks()
        elif kind == "step":
            self._at_step(int(event["step"]))
        elif kind == "failure":
            self._node_losses(int(event.get("step") or 0))

    def _hand_to_ranks(self) -> None:
        import ray

        ledger = ray.remote(ChaosLedger).options(num_cpus=0).remote()
        # The driver runs on the head node; a `kill node` drill must never take it down.
        head_node = ray.get_runtime_context().get_node_id()
        self.rank_chaos = RankChaos(tuple(e.to_dict() for e in self.events), ledger,
                                    self.controller.spec.resources.gpus_per_node, head_node)

    def for_ranks(self) -> RankChaos | None:
        """What placement hands every rank's agent (None before the first placing)."""
        return self.rank_chaos

    def _due(self, e: ChaosEvent, step: int) -> bool:
        return e.id not in self.fired and step + 1 >= e.at

    def _at_step(self, step: int) -> None:
        """Controller-side faults fire when the job is about to run their step."""
        for e in self.events:
            if e.kind == "scale" and self._due(e, step):
                self.fired.add(e.id)
                self._scale(e)
            elif e.kind == "corrupt-checkpoint" and self._due(e, step):
                self.fired.add(e.id)
                detail = corrupt_newest_checkpoint(self.controller.spec.checkpoint.uri)
                self.controller.publish("chaos", kind=e.kind, detail=detail)

    def _scale(self, e: ChaosEvent) -> None:
        try:
            self.controller.scale(e.nodes)
        except ValueError as err:  # outside [min_nodes, max_nodes]: a drill, not a crash
            logger.warning("chaos %s refused: %s", e.id, err)
            self.controller.publish("chaos", kind=e.kind, detail=f"refused: {err}")
            return
        self.controller.publish("chaos", kind=e.kind, detail=f"target nodes {e.nodes}")

    def _node_losses(self, step: int) -> None:
        """A `kill node` drill took a node-sized block down: say so, as a cluster would."""
        for e in self.events:
            if e.kind == "kill" and e.node is not None and self._due(e, step):
                self.fired.add(e.id)
                self.controller.report_node_lost(e.node, f"chaos {e.id} killed its ranks")
                logger.info("chaos: reported node block %d lost (%s)", e.node, e.id)
