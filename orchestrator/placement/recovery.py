"""MemoryRecovery: executes the recovery-source decision with the job's agents.

Before a re-placement (the old agents are still there): ask every live agent at once what it
holds (one short deadline: an agent that does not answer holds nothing usable), read the
newest committed storage step, let `choose_recovery_source` decide, and when memory wins get
the chosen pieces ready: a rank's own piece on a node the new placement keeps is located
where it lies, its sizes checked (its node's assembler will hard-link it: no byte moves or is
copied, and the ranks check its checksums while they load it); any other
piece is read now (checksummed, into Ray's object store), so it survives its holder being
replaced by the placement. After placement, one agent per node of the new layout assembles
the pieces into a committed version on its node (checkpoint/memory/restore.py) and the node's ranks
resume from it through the ordinary resharding load. Anything that fails here falls back to
storage, with the reason logged: memory only ever makes recovery faster.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from tenax.orchestrator.placement.recovery_policy import (RecoverySource, SnapshotPiece,
                                                          choose_recovery_source)

logger = logging.getLogger(__name__)


@dataclass
class PreparedRestore:
    """A decision and, when it reads memory, where each rank's piece comes from: `located`
    (rank -> a snapshot located on a node that keeps its agents, to be linked
    there) or `reads` (rank -> the in-flight read of its bytes). `holders` (rank -> agent)
    serve a located piece's bytes to a node that does not hold it."""
    decision: RecoverySource
    reads: dict[int, Any] = field(default_factory=dict)
    located: dict[int, dict[str, str]] = field(default_factory=dict)
    holders: dict[int, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MemoryStart:
    """What the ranks of one placement need: snapshot series, and where to resume from."""
    job_id: str
    generation: int
    snapshot_every: int  # the placement's decision: every N steps (0: none), replicated if on
    restore_uris: dict[str, str] = field(default_factory=dict)  # node id -> assembled version
    secret: str = field(default="", repr=False)  # the job's replica secret (never logged)
    rank_bytes: int = 0  # the planned bytes of one rank's snapshot (caps a replica)
    max_step: int = 0  # the job's last step (train.steps): no replica may claim a later one


class MemoryRecovery:
    def __init__(self, job_id: str, checkpoint_uri: str, probe_s: float, timeout_s: float) -> None:
        self.job_id, self.checkpoint_uri = job_id, checkpoint_uri
        self.probe_s, self.timeout_s = probe_s, timeout_s

    def prepare(self, holders: list[tuple[Any, str]], kept_nodes: set[str]) -> PreparedRestore:
        """Inventory every agent (actor, node id), decide, and verify or read the pieces.

        A rank's own (`local`) piece on a node the new placement keeps is only located where
        it lies: that node's assembler links it, so its bytes never travel or get copied. Any
        other piece is read now, while its holder is surely alive (the placement may replace
        it)."""
        actors = [actor for actor, _ in holders]
        decision = choose_recovery_source(self.inventory(actors), self.storage_step())
        logger.info("job %s: recovery source %s (step %s): %s", self.job_id, decision.source,
                    decision.step, decision.reason)
        if decision.source == "storage":
            return PreparedRestore(decision)
        prepared, located = PreparedRestore(decision), {}
        for rank, holder, kind in decision.holders:
            actor, node = holders[holder]
            prepared.holders[rank] = actor
            if kind == "local" and node in kept_nodes:
                located[rank] = actor.locate_snapshot.remote(decision.generation, rank,
                                                             decision.step)
            else:
                prepared.reads[rank] = actor.read_snapshot.remote(kind, decision.generation,
                                                                  rank, decision.step)
        refs = [*prepared.reads.values(), *located.values()]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s,
                            fetch_local=False)
        if len(ready) < len(refs):
            return self._fallback(decision, f"{len(refs) - len(ready)} piece(s) not read in "
                                            f"{self.timeout_s:.0f}s")
        try:
            prepared.located = dict(zip(located, ray.get(list(located.values()), timeout=0)))
        except (ray.exceptions.RayError, TimeoutError) as exc:
            return self._fallback(decision, f"verifying a snapshot failed: {type(exc).__name__}: "
                                            f"{str(exc)[:300]}")
        logger.info("job %s: %d piece(s) located (to link), %d read", self.job_id,
                    len(prepared.located), len(prepared.reads))
        return prepared

    def inventory(self, actors: list[Any]) -> list[SnapshotPiece]:
        refs = [a.snapshot_inventory.remote() for a in actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.probe_s) if refs else ([], [])
        pieces = []
        for holder, ref in enumerate(refs):
            if ref not in ready:
                continue
            try:
                held = ray.get(ref, timeout=0)
            except (ray.exceptions.RayError, TimeoutError):
                continue  # a dead agent holds nothing
            pieces += [SnapshotPiece(holder, h["kind"], int(h["generation"]), int(h["rank"]),
                                     int(h["world"]), int(h["step"])) for h in held]
        logger.info("job %s: %d of %d agents answered, holding %d snapshot piece(s)",
                    self.job_id, len(ready), len(refs), len(pieces))
        return pieces

    def storage_step(self) -> int | None:
        """The newest committed step under checkpoint.uri (None if none or unreadable)."""
        from tenax.checkpoint import Catalog, Storage

        try:
            steps = Catalog(Storage(self.checkpoint_uri, timeout_s=self.probe_s)).committed_steps()
        except Exception as exc:  # the ranks will read storage themselves if memory loses
            logger.warning("job %s: cannot list %s (%s); comparing memory with nothing",
                           self.job_id, self.checkpoint_uri, exc)
            return None
        return max(steps) if steps else None

    def assemble(self, prepared: PreparedRestore | None, ranks: list[Any]) -> dict[str, str]:
        """One agent per node of the new layout assembles the pieces; node id -> URI."""
        if prepared is None or prepared.decision.source == "storage":
            return {}
        d, t0 = prepared.decision, time.monotonic()
        first = {h.node_id: h for h in reversed(ranks)}
        refs = {node: h.actor.assemble_restore.remote(
                    self.job_id, d.generation, f"{node[:12]}-s{d.step}",
                    *[self._piece_for(prepared, rank, node) for rank in range(d.world)])
                for node, h in first.items()}
        try:
            uris = dict(zip(refs, ray.get(list(refs.values()), timeout=self.timeout_s)))
        except (ray.exceptions.RayError, TimeoutError) as exc:
            self._fallback(d, f"assembling failed: {type(exc).__name__}: {str(exc)[:300]}")
            return {}
        logger.info("job %s: step %d assembled from %s on %d node(s) in %.2fs", self.job_id,
                    d.step, d.source, len(uris), time.monotonic() - t0)
        return uris

    @staticmethod
    def _piece_for(prepared: PreparedRestore, rank: int, node: str) -> Any:
        """What `node`'s assembler gets for `rank`: the place to link, or the bytes (read
        from the holder now if nobody has yet; shared by every node that needs them)."""
        where = prepared.located.get(rank)
        if where is not None and where["node"] == node:
            return where
        if rank not in prepared.reads:
            d = prepared.decision
            prepared.reads[rank] = prepared.holders[rank].read_snapshot.remote(
                "local", d.generation, rank, d.step)
        return prepared.reads[rank]

    def _fallback(self, decision: RecoverySource, why: str) -> PreparedRestore:
        logger.warning("job %s: in-memory step %s unusable (%s); resuming from storage",
                       self.job_id, decision.step, why)
        return PreparedRestore(RecoverySource("storage", None, reason=why))
