"""WorkerGroup: one RankWorker actor per GPU slot, placed so that tp groups share a node.

One STRICT_PACK placement group per node-sized block of `gpus_per_node` consecutive ranks
(`node_blocks.py` makes and releases them): since the layout orders ranks with tp fastest,
every tp group (and cp/ep group within it) is on one node, while pp and dp span nodes. After
placement the actors' real node ids are checked against that promise, so a mis-placement is an
error, not a silent slowdown.

Warm recovery: actors (and their placement groups) outlive a failed attempt. `reuse()` keeps
every node block whose actors are alive, replaces dead actors inside their block, drops blocks
on lost nodes and adds blocks for new nodes; `start()` then only forks fresh training
processes. `shutdown()` is the cold fallback.

All calls that can block take a timeout; heartbeats are polled with at most one request in
flight per rank, so a dead node shows up as a heartbeat that stops answering.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import replace
from typing import Any

import ray

from tenax.orchestrator.errors import PlacementError
from tenax.orchestrator.placement.node_blocks import NodeBlocks
from tenax.orchestrator.placement.rank_handle import (PhaseMarks, RankHandle, RankHealth,
                                                      progressed)
from tenax.orchestrator.placement.recovery import MemoryStart
from tenax.parallel import ParallelLayout
from tenax.workers import RankChaos, RankRun, ReplicaTerms
from tenax.workers.tracking import TrackingStart

logger = logging.getLogger(__name__)

__all__ = ["PhaseMarks", "RankHandle", "RankHealth", "WorkerGroup", "progressed"]


WATCH_S = 30.0  # how long one `wait_ended` call may hold an agent thread before it is renewed
WAKE_POLL_S = 0.05  # how often a wait for ended processes looks at the controller's inbox


class WorkerGroup:
    def __init__(self, job_id: str, gpus_per_node: int, cpus_per_rank: float = 0.5,
                 marks: PhaseMarks | None = None, forkserver: dict[str, Any] | None = None) -> None:
        self.job_id, self.gpus_per_node = job_id, gpus_per_node
        self.node_blocks = NodeBlocks(job_id, gpus_per_node, cpus_per_rank, forkserver)
        self.marks = marks  # the cold start's phases; None: not measured
        self.forkservers_timed = False  # their readiness is asked once: the cold start's
        self.ranks: list[RankHandle] = []  # the active ranks of the current layout, in order
        self.blocks: list[dict[str, Any]] = []  # per node: placement group + g actor slots
        self.layout: ParallelLayout | None = None
        self.watches: dict[Any, tuple[RankHandle, int]] = {}  # wait_ended call -> (rank, attempt)

    # ---- placement ---------------------------------------------------------------------------
    def create(self, layout: ParallelLayout, timeout_s: float) -> dict[str, int]:
        """Reserve slots and actors for `layout`, reusing live ones; PlacementError on timeout.

        Returns how many actors were reused and created (warm vs cold work)."""
        self.layout = layout
        g = self.gpus_per_node
        needed = math.ceil(layout.world_size / g)
        keep = [b for b in self.blocks if b["lost"] is False][:needed]
        for block in self.blocks:
            if block not in keep:
                self.node_blocks.remove(block)
        reused = sum(1 for b in keep for h in b["slots"] if h.dead is None)
        self.blocks = keep
        for block in self.blocks:
            self.node_blocks.replace_dead(block)
        new = [self.node_blocks.new(len(self.blocks) + i) for i in range(needed - len(self.blocks))]
        adopting = self.node_blocks.forkserver is not None
        if not adopting:  # Ray holds them until their bundles are reserved: their processes
            self.node_blocks.populate(new)  # start sooner
        ready, _ = ray.wait([b["pg"].ready() for b in new], num_returns=len(new), timeout=timeout_s)
        if len(ready) < len(new):
            for block in new:  # not in self.blocks yet: release them here or they leak GPUs
                self.node_blocks.remove(block)
            self.shutdown()
            raise PlacementError(f"placing {layout.world_size} ranks ({needed} nodes x {g} GPUs) "
                                 f"did not finish within {timeout_s:.0f} s; not enough free GPUs?")
        self._mark("placement_groups_ready")
        if adopting:  # where each block landed decides whether it needs a zygote
            self.node_blocks.populate(new)
        self.blocks.extend(new)
        slots = [h for b in self.blocks for h in b["slots"]]
        self.ranks = slots[:layout.world_size]
        self._collect_info(timeout_s)
        self._mark("agents_started")
        return {"reused": reused, "created": len(slots) - reused}

    def _mark(self, phase: str, at: float | None = None) -> None:
        if self.marks is not None:
            self.marks.mark(phase, at)

    def mark_lost(self, node_id: str) -> None:
        """A node is gone: its blocks are never reused (their actors die with it)."""
        for block in self.blocks:
            if any(h.node_id == node_id for h in block["slots"]):
                block["lost"] = True

    def mark_blocks_lost(self, blocks: tuple[int, ...]) -> None:
        """Node blocks (placement order: block k holds ranks [k*g, (k+1)*g)) are gone. Unlike
        `mark_lost`, blocks that share the Ray node of a lost one stay: on one raylet that
        simulates several nodes, the survivors keep their agents and the replicas they hold.
        A lost block's agents hold nothing usable from now on (`live_holders` skips them) and
        die with their placement group at the next `create`."""
        for k in blocks:
            if 0 <= k < len(self.blocks):
                self.blocks[k]["lost"] = True

    def _collect_info(self, timeout_s: float) -> None:
        slots = [h for b in self.blocks for h in b["slots"]]
        infos = ray.get([h.actor.info.remote() for h in slots], timeout=timeout_s)
        for handle, info in zip(slots, infos):
            handle.node_id, handle.ip, handle.pid = info["node_id"], info["ip"], info["pid"]
        for rank, handle in enumerate(self.ranks):
            handle.rank = rank
        for group in self.layout.groups("tp"):
            nodes = {self.ranks[r].node_id for r in group}
            if len(nodes) > 1:
                raise PlacementError(f"tp group {group} spans nodes {sorted(nodes)}")
        logger.info("placed %d ranks on %d nodes", len(self.ranks), len(self.node_ids()))

    def node_ids(self) -> list[str]:
        """Distinct node ids in rank order."""
        return list(dict.fromkeys(h.node_id for h in self.ranks))

    # ---- run ---------------------------------------------------------------------------------
    def start(self, spec: dict[str, Any], timeout_s: float, memory: MemoryStart | None = None,
              chaos: RankChaos | None = None,
              tracking: TrackingStart | None = None) -> tuple[str, int]:
        """Rendezvous on rank 0's node and (re)start every rank's training process.
        `chaos`: a drill's rank-side faults, handed to every agent (None in production)."""
        self.stop_training(timeout_s)
        addr = self.ranks[0].ip
        port = ray.get(self.ranks[0].actor.free_port.remote(), timeout=timeout_s)
        refs = []
        for h in self.ranks:
            run = RankRun(spec, self.layout.to_dict(), h.rank, len(self.ranks), addr, port,
                          node_id=h.node_id, job_id=self.job_id, chaos=chaos, tracking=tracking)
            if memory is not None:
                run = replace(run, job_id=memory.job_id, generation=memory.generation,
                              snapshot_every=memory.snapshot_every,
                              restore_uri=memory.restore_uris.get(h.node_id),
                              peer=self.peer_of(h.rank) if memory.snapshot_every > 0 else None,
                              replicas=self.replica_terms(h.rank, memory))
            refs.append(h.actor.start.remote(run))
        warm = [] if self.marks is None or self.forkservers_timed else \
            [h.actor.forkserver_ready.remote(timeout_s) for h in self.ranks]
        attempts = ray.get(refs, timeout=timeout_s)
        self._mark_forked(warm, timeout_s)
        now = time.monotonic()
        for h, attempt in zip(self.ranks, attempts):
            h.attempt, h.last_reply, h.step_seen_at = attempt, now, now
            h.n_events, h.pending, h.dead, h.status = 0, None, None, {}
        return addr, port

    def _mark_forked(self, warm: list[Any], timeout_s: float) -> None:
        """The cold start's forkservers_ready (asked once, alongside the starts: a start waits
        for its agent's forkserver anyway) and ranks_forked."""
        if warm:
            self.forkservers_timed = True
            try:
                self._mark("forkservers_ready", max(ray.get(warm, timeout=timeout_s)))
            except (ray.exceptions.RayError, TimeoutError) as err:  # a figure, never a failure:
                logger.debug("forkserver readiness not known: %s", err)  # heartbeats tell
        self._mark("ranks_forked")

    def peer_of(self, rank: int) -> Any:
        """The agent holding `rank`'s replica: same slot, next node block (ring); None on one
        node (a replica on the same node would die with it)."""
        world, g = len(self.ranks), self.gpus_per_node
        return None if world <= g else self.ranks[(rank + g) % world].actor

    def replica_terms(self, rank: int, memory: MemoryStart) -> ReplicaTerms | None:
        """What `rank`'s agent takes from its own peer: the replica of the rank one node
        back (the inverse of `peer_of`), from that node's address, under the job's secret."""
        world, g = len(self.ranks), self.gpus_per_node
        if memory.snapshot_every <= 0 or world <= g:
            return None
        source = self.ranks[(rank - g) % world]
        return ReplicaTerms(memory.secret, world, (source.rank,), (source.ip,), memory.rank_bytes,
                            memory.max_step)

    def live_holders(self) -> list[tuple[Any, str]]:
        """(actor, node id) of every actor of every block not known dead (snapshot holders,
        old layout included)."""
        return [(h.actor, h.node_id) for b in self.blocks if not b["lost"] for h in b["slots"]
                if h.dead is None]

    def kept_nodes(self, layout: ParallelLayout) -> set[str]:
        """The nodes whose blocks `create(layout)` keeps (it keeps the first live ones)."""
        needed = math.ceil(layout.world_size / self.gpus_per_node)
        kept = [b for b in self.blocks if b["lost"] is False][:needed]
        return {h.node_id for b in kept for h in b["slots"] if h.node_id}

    def agents_by_node(self) -> dict[str, list[Any]]:
        """Node id -> the job's agents there that Ray has not reported dead (probe targets)."""
        out: dict[str, list[Any]] = {}
        for h in self.ranks:
            if h.dead is None and h.node_id:
                out.setdefault(h.node_id, []).append(h.actor)
        return out

    def drop_snapshots(self, timeout_s: float) -> None:
        """The job ended: every live agent stops accepting replicas and removes the job's
        snapshots on its node (all of them, so a late replica cannot recreate any)."""
        refs = [h.actor.drop_snapshots.remote() for b in self.blocks for h in b["slots"]
                if h.dead is None and not b["lost"]]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)

    def stop_training(self, timeout_s: float) -> None:
        """Kill every slot's training process (not the actors): survivors stay warm. A lost
        node's agents are not asked (a frozen one would hold this call to its timeout)."""
        slots = [h for b in self.blocks if not b["lost"] for h in b["slots"] if h.dead is None]
        refs = [h.actor.stop.remote() for h in slots]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for h, ref in zip(slots, refs):
            if ref not in ready:
                h.dead = "did not stop its training process in time"
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayError as err:
                h.dead = f"{type(err).__name__}"

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
        if reply["attempt"] != h.attempt:
            return []  # an answer about the previous training process
        events = reply.pop("events")
        h.n_events = reply["n_events"]
        if progressed(h.status, reply):
            h.step_seen_at = h.last_reply
        h.status = reply
        return [{**e, "rank": h.rank} for e in events]

    def wait_for_change(self, timeout_s: float, wake: threading.Event) -> None:
        """Up to `timeout_s`; sooner when a rank's training process ends (its agent answers a
        `wait_ended` call kept in flight per rank) or `wake` is set: a killed process is seen at
        once, not at the next heartbeat poll."""
        deadline = time.monotonic() + timeout_s
        for h in self.ranks:
            if h.dead is None and h.ended < h.attempt != h.watching:
                h.watching = h.attempt
                self.watches[h.actor.wait_ended.remote(h.attempt, WATCH_S)] = (h, h.attempt)
        while not wake.is_set() and (left := deadline - time.monotonic()) > 0:
            if not self.watches:
                wake.wait(left)
                return
            ready, _ = ray.wait(list(self.watches), num_returns=1, timeout=min(left, WAKE_POLL_S))
            if ready:
                for ref in ready:
                    self._watch_answered(ref)
                return

    def _watch_answered(self, ref: Any) -> None:
        h, attempt = self.watches.pop(ref)
        try:
            ended = bool(ray.get(ref, timeout=0))
        except (ray.exceptions.RayError, TimeoutError):
            ended = True  # the agent is gone: its heartbeat says so, no new watch
        if h.watching == attempt:
            h.watching = 0
        if ended:
            h.ended = max(h.ended, attempt)

    def health(self) -> list[RankHealth]:
        now = time.monotonic()
        return [RankHealth(rank=h.rank, node_id=h.node_id, dead=h.dead,
                           heartbeat_age_s=now - h.last_reply,
                           state=h.status.get("state", "starting"), step=h.status.get("step", 0),
                           step_age_s=now - h.step_seen_at, error=h.status.get("error"))
                for h in self.ranks]

    def shutdown(self) -> None:
        """Kill every actor and release the placement groups (never blocks for long)."""
        for block in self.blocks:
            self.node_blocks.remove(block)
        self.ranks, self.blocks = [], []

