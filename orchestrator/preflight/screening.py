"""Bad node screening (`resources.exclude_slow_nodes: true`): which node a preflight singles
out, and keeping the job off it.

Why a hold and not a placement rule: Ray's placement groups cannot exclude a node, and the job's
placement (orchestrator/placement) must not grow a per-job blacklist for a preflight. A small
actor pinned to the node (hard node affinity) holding every GPU slot of it keeps any placement
group, the job's included, off that node for as long as the hold lives; the caller releases
it when the job ends (Ray also reaps it with its owner, the driver or the service).
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Sequence

logger = logging.getLogger(__name__)


def singled_out(slow_groups: Sequence[Sequence[str]], slow_rank_nodes: Sequence[str],
                all_nodes: set[str]) -> str:
    """The one node most named by the slow link groups and the slow ranks (each names its
    nodes once); "" when none is named, when two tie, or when it is the job's only node."""
    votes: Counter = Counter()
    for group in slow_groups:
        votes.update(set(group))
    votes.update(set(slow_rank_nodes))
    if not votes:
        return ""
    ranked = votes.most_common()
    if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:
        return ""
    node = ranked[0][0]
    return node if all_nodes - {node} else ""


class NodeHold:
    """Ray actor body: exists only to hold a node's GPU slots."""

    def ready(self) -> bool:
        return True


@dataclass
class Cordon:
    """A held node; `release()` gives its slots back."""
    node_id: str
    actor: Any

    def release(self) -> None:
        import ray

        try:
            ray.kill(self.actor)
        except Exception as err:  # noqa: BLE001 - Ray already gone: nothing is held
            logger.debug("releasing the hold on %s: %s", self.node_id, err)
        logger.info("node %s is no longer kept from the job", self.node_id)


def cordon_node(node_id: str, timeout_s: float) -> Cordon:
    """Hold every GPU slot of `node_id` (TimeoutError when they do not come free in time)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = next((n for n in ray.nodes() if n["NodeID"] == node_id and n.get("Alive")), None)
    if node is None:
        raise ValueError(f"node {node_id} is not an alive Ray node")
    gpus = float(node.get("Resources", {}).get("GPU", 0))
    actor = ray.remote(NodeHold).options(
        num_cpus=0, num_gpus=gpus, scheduling_strategy=NodeAffinitySchedulingStrategy(
            node_id, soft=False)).remote()
    try:
        ray.get(actor.ready.remote(), timeout=timeout_s)
    except Exception:
        ray.kill(actor)
        raise
    logger.info("node %s (%g GPU slots) is kept from the job", node_id, gpus)
    return Cordon(node_id, actor)


def screened(first: Any, again: Callable[[], Any], timeout_s: float) -> Any:
    """Keep the job off the node `first` (a preflight `Report`) singled out and run the
    preflight `again` once; its report, with a `screening` row and the hold to release when
    the job ends. When the node cannot be held, `first` with a `screening` row saying why."""
    from tenax.orchestrator.preflight.rows import Row

    name = first.slow_node_name or first.slow_node
    why = "; ".join(f"{r.name}: {r.detail}" for r in first.rows
                    if r.name in ("links", "throughput") and r.verdict != "pass")
    try:
        cordon = cordon_node(first.slow_node, timeout_s)
    except Exception as err:  # noqa: BLE001 - the job runs as placed; the row says why
        first.rows.append(Row("screening", f"{name} not excluded", "a node kept from the job",
                              "warn", f"could not hold {name}: {err}"))
        return first
    try:
        second = again()
    except BaseException:
        cordon.release()
        raise
    second.cordon = cordon
    after = (f"; the repeated preflight singles out {second.slow_node_name}"
             if second.slow_node else "; the repeated preflight singles out no node")
    second.rows.append(Row("screening", f"excluded {name}", "no node singled out", "warn",
                           f"the first preflight ({first.verdict}) singled out {name} ({why}); "
                           f"the job was re-placed without it{after}"))
    return second
