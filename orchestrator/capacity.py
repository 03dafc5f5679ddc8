"""What the cluster can give a job now: whole nodes of `gpus_per_node` slots, and whether a
node still answers.

Ray declares a SIGKILLed node dead only after ~14 s, so the controller keeps its own record of
slots it knows are gone (`lost_slots`) and probes a suspect node directly: a task pinned to the
node either runs within the heartbeat timeout or the node is treated as lost.
"""
from __future__ import annotations

import logging

import ray

from orchestrator.policies import Capacity

logger = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
def _probe() -> bool:
    return True


def cluster_capacity(gpus_per_node: int, lost_slots: dict[str, int]) -> Capacity:
    """Alive Ray nodes' GPU slots, minus those known lost, in whole job nodes."""
    nodes, parts = 0, []
    for node in ray.nodes():
        gpus = int(node.get("Resources", {}).get("GPU", 0)) if node.get("Alive") else 0
        usable = max(0, gpus - lost_slots.get(node["NodeID"], 0)) // gpus_per_node
        nodes += usable
        if gpus:
            parts.append(f"{node['NodeID'][:8]}: {usable} node(s)")
    return Capacity(nodes, f"({', '.join(parts)})")


def node_answers(node_id: str, timeout_s: float) -> bool:
    """True when a task pinned to the node runs within `timeout_s`."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
    try:
        return bool(ray.get(_probe.options(scheduling_strategy=strategy).remote(), timeout=timeout_s))
    except (ray.exceptions.RayError, TimeoutError):
        return False
