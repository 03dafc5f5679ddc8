"""NodeBlocks: a node block's Ray resources, made, repaired and released.

A node block is `gpus_per_node` consecutive ranks on one node: one STRICT_PACK placement group
(a bundle per GPU slot), one rank agent (`RankWorker`) per bundle, and the forkserver the agents
fork their training processes from. That forkserver is the block's zygote (`workers/zygote.py`,
a Ray actor without resources of its own), except on the node where `tenax run` or `tenax
serve` started an embedded Ray: there the launcher started a forkserver before Ray, whose
imports overlapped Ray's start, and the agents fork from it directly, so one Ray actor fewer
starts before the first step (on 2 cores Ray prestarts two workers; a third actor waited for a
new worker process).

A block is a plain dict (`pg`, `slots`, `lost`, `index`, `zygote`, `adopt`), owned by the
`WorkerGroup` that holds its blocks in placement order.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import ray
from ray.util.placement_group import (placement_group, placement_group_table,
                                      remove_placement_group)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tenax.orchestrator.placement.rank_handle import RankHandle
from tenax.workers import RankWorker, Zygote

logger = logging.getLogger(__name__)

AGENT_THREADS = 6  # heartbeat, stop, wait_ended, snapshot reads and a peer's replica at once
ZYGOTE_RESTARTS = 3  # a zygote whose process died comes back (one import) this many times


class NodeBlocks:
    """Makes, repairs and releases the node blocks of one job. `forkserver`: the launcher's
    ({"node_id", "endpoint"}), which the agents on its node fork from; None: every block gets a
    zygote."""

    def __init__(self, job_id: str, gpus_per_node: int, cpus_per_rank: float,
                 forkserver: dict[str, Any] | None) -> None:
        self.job_id, self.gpus_per_node, self.cpus_per_rank = job_id, gpus_per_node, cpus_per_rank
        self.forkserver = forkserver

    def new(self, index: int) -> dict[str, Any]:
        """A block whose placement group is asked for; its actors come with `populate`."""
        bundle = {"GPU": 1.0, "CPU": self.cpus_per_rank}
        pg = placement_group([dict(bundle) for _ in range(self.gpus_per_node)],
                             strategy="STRICT_PACK",
                             name=f"tenax-{self.job_id}-{time.monotonic_ns()}")
        return {"pg": pg, "slots": [], "lost": False, "index": index, "zygote": None,
                "adopt": None}

    def populate(self, blocks: list[dict[str, Any]]) -> None:
        """Each block's agents, and its zygote unless the block is on the launcher's node
        (known only once its placement group is reserved)."""
        for block in blocks:
            block["adopt"] = self.adoptable(block["pg"])
            if block["adopt"] is None:
                block["zygote"] = self.new_zygote(block["pg"])
            block["slots"] = [self.new_agent(block, i) for i in range(self.gpus_per_node)]

    def adoptable(self, pg: Any) -> dict[str, Any] | None:
        """The launcher's forkserver when the (reserved) placement group is on its node."""
        if self.forkserver is None:
            return None
        try:
            node = placement_group_table(pg)["bundles_to_node_id"][0]
        except Exception as err:  # its zygote adopts the forkserver where it finds itself there
            logger.info("where placement group %s landed is not known (%s): its block gets a "
                        "zygote", pg.id.hex(), err)
            return None
        if node != self.forkserver["node_id"]:
            return None
        logger.info("the agents on node %s fork from the launcher's forkserver (pid %s): no "
                    "zygote there", node[:8], self.forkserver["endpoint"].get("pid"))
        return self.forkserver

    def new_zygote(self, pg: Any) -> Any:
        """The block's forkserver (workers/zygote.py): no resources of its own, on the block's
        node; Ray restarts it if its process dies (the agents ask it again)."""
        return ray.remote(Zygote).options(
            num_cpus=0, num_gpus=0, max_restarts=ZYGOTE_RESTARTS, max_concurrency=AGENT_THREADS,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=0)).remote(adopt=self.forkserver)

    def new_agent(self, block: dict[str, Any], index: int) -> RankHandle:
        actor = ray.remote(RankWorker).options(
            num_gpus=1, num_cpus=self.cpus_per_rank, max_concurrency=AGENT_THREADS,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=block["pg"], placement_group_bundle_index=index)
        ).remote(block["zygote"], adopt=block.get("adopt"))
        return RankHandle(-1, actor)

    def replace_dead(self, block: dict[str, Any]) -> None:
        """A new agent in each slot whose agent died (its training processes fork from the
        block's forkserver like the others')."""
        for i, h in enumerate(block["slots"]):
            if h.dead is not None:
                kill_quietly(h.actor)
                block["slots"][i] = self.new_agent(block, i)

    def remove(self, block: dict[str, Any]) -> None:
        """Kill the block's actors and release its placement group (never blocks for long)."""
        for h in block["slots"]:
            kill_quietly(h.actor)
        if block.get("zygote") is not None:
            kill_quietly(block["zygote"])
        try:
            remove_placement_group(block["pg"])
        except Exception as err:  # its node may be gone already
            logger.debug("remove placement group: %s", err)


def kill_quietly(actor: Any) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception as err:  # already dead: nothing to release
        logger.debug("kill actor: %s", err)
