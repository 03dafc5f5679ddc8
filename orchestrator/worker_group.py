"""WorkerGroup: one RankWorker actor per GPU slot, placed so that tp groups share a node.

One STRICT_PACK placement group per node-sized block of `gpus_per_node` consecutive ranks:
since the layout orders ranks with tp fastest, every tp group (and cp/ep group within it) is on
one node, while pp and dp span nodes. After placement the actors' real node ids are checked
against that promise, so a mis-placement is an error, not a silent slowdown.

All calls that can block take a timeout; heartbeats are polled with at most one request in
flight per rank, so a dead node shows up as a heartbeat that stops answering.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from parallel.layout import ParallelLayout
from workers.worker import RankRun, RankWorker

logger = logging.getLogger(__name__)


class PlacementError(RuntimeError):
    """The GPUs asked for could not be placed within the timeout."""


@dataclass
class RankHandle:
    rank: int
    actor: Any
    node_id: str = ""
    ip: str = ""
    pid: int = 0
    pending: Any = None  # in-flight heartbeat ObjectRef
    pending_since: float = 0.0
    last_reply: float = field(default_factory=time.monotonic)
    n_events: int = 0
    step_seen_at: float = field(default_factory=time.monotonic)  # controller clock, no skew
    status: dict[str, Any] = field(default_factory=dict)
    dead: str | None = None  # why Ray says this actor is gone


@dataclass
class RankHealth:
    """What the policies see of one rank (pure data)."""
    rank: int
    node_id: str
    dead: str | None
    heartbeat_age_s: float
    state: str
    step: int
    step_age_s: float
    error: str | None


class WorkerGroup:
    def __init__(self, job_id: str, gpus_per_node: int, cpus_per_rank: float = 0.5) -> None:
        self.job_id, self.gpus_per_node, self.cpus_per_rank = job_id, gpus_per_node, cpus_per_rank
        self.ranks: list[RankHandle] = []
        self.pgs: list[Any] = []
        self.layout: ParallelLayout | None = None

    # ---- placement ---------------------------------------------------------------------------
    def create(self, layout: ParallelLayout, timeout_s: float) -> None:
        """Reserve the slots and start one actor per rank; PlacementError on timeout."""
        self.layout = layout
        world, g = layout.world_size, self.gpus_per_node
        sizes = [min(g, world - k * g) for k in range(math.ceil(world / g))]
        bundle = {"GPU": 1.0, "CPU": self.cpus_per_rank}
        self.pgs = [placement_group([dict(bundle) for _ in range(n)], strategy="STRICT_PACK",
                                    name=f"tenax-{self.job_id}-node{i}") for i, n in enumerate(sizes)]
        ready, _ = ray.wait([pg.ready() for pg in self.pgs], num_returns=len(self.pgs),
                            timeout=timeout_s)
        if len(ready) < len(self.pgs):
            self.shutdown()
            raise PlacementError(f"placing {world} ranks ({len(sizes)} nodes x {g} GPUs) did not "
                                 f"finish within {timeout_s:.0f} s; not enough free GPUs?")
        actor_cls = ray.remote(RankWorker)
        for rank in range(world):
            pg, index = self.pgs[rank // g], rank % g
            actor = actor_cls.options(
                num_gpus=1, num_cpus=self.cpus_per_rank, max_concurrency=4,
                name=f"tenax-{self.job_id}-rank{rank}-{time.monotonic_ns()}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=index)).remote()
            self.ranks.append(RankHandle(rank, actor))
        self._collect_info(timeout_s)

    def _collect_info(self, timeout_s: float) -> None:
        infos = ray.get([h.actor.info.remote() for h in self.ranks], timeout=timeout_s)
        for handle, info in zip(self.ranks, infos):
            handle.node_id, handle.ip, handle.pid = info["node_id"], info["ip"], info["pid"]
        for group in self.layout.groups("tp"):
            nodes = {self.ranks[r].node_id for r in group}
            if len(nodes) > 1:
                raise PlacementError(f"tp group {group} spans nodes {sorted(nodes)}")
        logger.info("placed %d ranks on %d nodes", len(self.ranks), len(self.node_ids()))

    def node_ids(self) -> list[str]:
        """Distinct node ids in rank order."""
        return list(dict.fromkeys(h.node_id for h in self.ranks))

    # ---- run ---------------------------------------------------------------------------------
    def start(self, spec: dict[str, Any], chaos: list[dict[str, Any]], ledger: Any,
              timeout_s: float) -> tuple[str, int]:
        """Rendezvous on rank 0's node and start every rank's training thread."""
        addr = self.ranks[0].ip
        port = ray.get(self.ranks[0].actor.free_port.remote(), timeout=timeout_s)
        now = time.monotonic()
        refs = []
        for h in self.ranks:
            run = RankRun(spec, self.layout.to_dict(), h.rank, len(self.ranks), addr, port,
                          self.gpus_per_node, chaos, ledger)
            refs.append(h.actor.start.remote(run))
            h.last_reply, h.step_seen_at, h.n_events, h.pending, h.dead = now, now, 0, None, None
        ray.get(refs, timeout=timeout_s)
        return addr, port

    def poll(self, wait_s: float) -> list[dict[str, Any]]:
        """Send heartbeats where none is in flight, collect replies; returns new records."""
        now = time.monotonic()
        for h in self.ranks:
            if h.pending is None and h.dead is None:
                h.pending, h.pending_since = h.actor.heartbeat.remote(h.n_events), now
        pending = [h.pending for h in self.ranks if h.pending is not None]
        if pending:
            ray.wait(pending, num_returns=len(pending), timeout=wait_s)
        records: list[dict[str, Any]] = []
        for h in self.ranks:
            records.extend(self._collect(h))
        return records

    def _collect(self, h: RankHandle) -> list[dict[str, Any]]:
        if h.pending is None:
            return []
        ready, _ = ray.wait([h.pending], timeout=0)
        if not ready:
            return []
        try:
            reply = ray.get(h.pending)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as err:
            h.dead = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            return []
        finally:
            h.pending = None
        h.last_reply = time.monotonic()
        events = reply.pop("events")
        h.n_events = reply["n_events"]
        if reply["step"] != h.status.get("step") or reply["state"] != h.status.get("state"):
            h.step_seen_at = h.last_reply
        h.status = reply
        return [{**e, "rank": h.rank} for e in events]

    def health(self) -> list[RankHealth]:
        now = time.monotonic()
        return [RankHealth(rank=h.rank, node_id=h.node_id, dead=h.dead,
                           heartbeat_age_s=now - h.last_reply,
                           state=h.status.get("state", "starting"), step=h.status.get("step", 0),
                           step_age_s=now - h.step_seen_at, error=h.status.get("error"))
                for h in self.ranks]

    def shutdown(self) -> None:
        """Kill every actor and release the placement groups (never blocks for long)."""
        for h in self.ranks:
            try:
                ray.kill(h.actor, no_restart=True)
            except Exception as err:  # already dead: nothing to release
                logger.debug("kill rank %d: %s", h.rank, err)
        for pg in self.pgs:
            try:
                remove_placement_group(pg)
            except Exception as err:
                logger.debug("remove placement group: %s", err)
        self.ranks, self.pgs = [], []
