"""What the cluster can give a job now: whole nodes of `gpus_per_node` slots, and whether a
node still answers.

Ray declares a SIGKILLed node dead only after ~14 s, so the controller keeps its own record of
slots it knows are gone (`lost_slots`) and probes a suspect node directly: one of the job's
agents there answers a ping, or a task pinned to the node runs, within the heartbeat timeout,
or the node is treated as lost.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import ray

from tenax.orchestrator.loopback import tcp_probe
from tenax.orchestrator.placement.nodes_reader import NODES_TIMEOUT_S, NodesReader
from tenax.parallel import DetectedGpus, gpus_from_ray_resources

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Capacity:
    """Whole nodes (of `gpus_per_node` slots) the job may use now, and their GPUs as Ray
    names them (None: unnamed, or a model the planner's table does not know)."""
    nodes: int
    detail: str = ""
    gpus: DetectedGpus | None = None


RAYLET_CONNECT_S = 0.5
RAY_NODES_TIMEOUT_S = NODES_TIMEOUT_S  # ray_nodes()'s deadline (nodes_reader.py)

READER = NodesReader()


def ray_nodes(timeout_s: float | None = None, stale_ok: bool = False) -> list[dict[str, Any]]:
    """`NodesReader.nodes` of the process-wide reader (None: RAY_NODES_TIMEOUT_S)."""
    return READER.nodes(RAY_NODES_TIMEOUT_S if timeout_s is None else timeout_s, stale_ok)
TASK_AFTER_S = 0.5  # a node whose agents' pings are unanswered this long gets a pinned task


@ray.remote(num_cpus=0)
def _probe() -> bool:
    return True


def cluster_capacity(gpus_per_node: int, lost_slots: dict[str, int]) -> Capacity:
    """Alive Ray nodes' GPU slots, minus those known lost, in whole job nodes. A late
    ray.nodes() answer falls back to its previous one (a GCS hiccup is not a lost cluster);
    RayNodesTimeout when there is none."""
    nodes, parts, usable_resources = 0, [], []
    for node in ray_nodes(stale_ok=True):
        gpus = int(node.get("Resources", {}).get("GPU", 0)) if node.get("Alive") else 0
        usable = max(0, gpus - lost_slots.get(node["NodeID"], 0)) // gpus_per_node
        nodes += usable
        if gpus:
            parts.append(f"{node['NodeID'][:8]}: {usable} node(s)")
        if usable:
            usable_resources.append(node.get("Resources", {}))
    return Capacity(nodes, f"({', '.join(parts)})", gpus_from_ray_resources(usable_resources))


def cluster_gpus(gpus_per_node: int) -> DetectedGpus | None:
    """The GPUs the controller's plan uses (`Capacity.gpus`), for a plan made outside PLACING
    (the preflight's); None when the cluster cannot be read now."""
    try:
        return cluster_capacity(gpus_per_node, {}).gpus
    except Exception as exc:  # the plan then assumes what it does without a cluster
        logger.info("cannot read the cluster's GPU types: %s", exc)
        return None


def raylets_down(node_ids: tuple[str, ...]) -> set[str]:
    """Nodes whose raylet port refuses a TCP connection: the process is gone. A crashed
    node's kernel answers with a reset at once, while Ray takes ~14 s to declare it dead."""
    try:
        nodes = ray_nodes(RAYLET_CONNECT_S * 4)
    except Exception as exc:  # the GCS is unreachable or late: no proof either way
        logger.warning("cannot list Ray nodes to probe raylets: %s", exc)
        return set()
    gone = {n["NodeID"] for n in nodes if n["NodeID"] in node_ids and not n.get("Alive")}
    where = {n["NodeID"]: (n["NodeManagerAddress"], int(n["NodeManagerPort"])) for n in nodes
             if n["NodeID"] in node_ids and n.get("NodeManagerPort") and n["NodeID"] not in gone}
    if not where:
        return gone
    with ThreadPoolExecutor(max_workers=min(16, len(where))) as pool:
        refused = list(pool.map(lambda a: tcp_probe(*a, RAYLET_CONNECT_S) == "refused",
                                where.values()))
    return gone | {node for node, down in zip(where, refused) if down}


class NodeProbes:
    """Probes of suspect nodes, all in flight at once and collected without blocking the loop
    for longer than one wait; the policy decides what an unanswered probe means.

    A live agent's ping answers in milliseconds and proves its node alive, so the pinned task
    (which needs a Ray worker process on the node: the first one is a fresh interpreter, about
    a second of CPU there, and on a busy host it slowed the job's first recovery and the steps
    after it) is sent only where no ping can answer: a node without live agents of the job,
    one whose pings all failed, or one still silent `TASK_AFTER_S` after its pings went out.
    Only the task can say a node is gone."""

    def __init__(self) -> None:
        self.nodes: tuple[str, ...] = ()  # every node being probed
        self.refs: dict[str, Any] = {}  # node -> its pinned task
        self.pings: dict[Any, str] = {}  # a live agent's ping -> its node (answers in ms)
        self.answered: set[str] = set()
        self.refused: set[str] = set()  # the probe failed outright: the node is unreachable
        self.started = False
        self.sent_at = 0.0

    def start(self, node_ids: tuple[str, ...], agents: dict[str, list[Any]] | None = None) -> None:
        """Ping each node's agents now; pinned tasks go out as `collect` finds them needed."""
        self.started, self.nodes, self.sent_at = True, tuple(node_ids), time.monotonic()
        for node in node_ids:
            for actor in (agents or {}).get(node, []):
                self.pings[actor.ping.remote()] = node
        down = raylets_down(node_ids)
        if down:
            logger.warning("raylet of node(s) %s refuses connections: lost",
                           ", ".join(n[:8] for n in down))
        self.refused |= down
        if node_ids:
            logger.info("probing %d node(s) at once: %s", len(node_ids),
                        ", ".join(n[:8] for n in node_ids))

    def _send_tasks(self) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        late = time.monotonic() - self.sent_at > TASK_AFTER_S
        pinged = set(self.pings.values())
        for node in self.nodes:
            if node in self.refs or node in self.answered or node in self.refused:
                continue
            if node in pinged and not late:
                continue
            why = ("its agents' pings are unanswered" if node in pinged
                   else "no agent of the job answers")
            logger.info("probing node %s with a pinned task: %s", node[:8], why)
            strategy = NodeAffinitySchedulingStrategy(node, soft=False)
            self.refs[node] = _probe.options(scheduling_strategy=strategy).remote()

    def collect(self, wait_s: float) -> None:
        self._send_tasks()
        done = self.answered | self.refused
        tasks = {ref: node for node, ref in self.refs.items() if node not in done}
        pings = {ref: node for ref, node in self.pings.items() if node not in done}
        if not tasks and not pings:
            return
        waiting = list(tasks) + list(pings)
        ready, _ = ray.wait(waiting, num_returns=1, timeout=min(wait_s, TASK_AFTER_S))
        ready, _ = ray.wait(waiting, num_returns=len(waiting), timeout=0)
        for ref in ready:
            node = tasks.get(ref) or pings[ref]
            try:
                ok = bool(ray.get(ref, timeout=0))
            except (ray.exceptions.RayError, TimeoutError):
                ok = False
            if ok:
                self.answered.add(node)
            elif ref in tasks:  # a dead agent says nothing about its node; a failed task does
                self.refused.add(node)
            self.pings.pop(ref, None)
        self.refused -= self.answered

    def reset(self) -> None:
        self.nodes, self.refs, self.started = (), {}, False
        self.answered, self.refused = set(), set()
        self.pings, self.sent_at = {}, 0.0
