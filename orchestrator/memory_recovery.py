"""MemoryRecovery: executes the recovery-source decision with the job's agents.

Before a re-placement (the old agents are still there): ask every live agent at once what it
holds (one short deadline: an agent that does not answer holds nothing usable), read the
newest committed storage step, let `choose_recovery_source` decide, and when memory wins start
reading the chosen pieces. The reads' results are owned by this driver, so they survive the
holders being replaced by the new placement. After placement, one agent per node of the new
layout assembles the pieces into a committed version on its node (checkpoint/restore.py) and
the node's ranks resume from it through the ordinary resharding load. Anything that fails
here falls back to storage, with the reason logged: memory only ever makes recovery faster.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from orchestrator.recovery_source import RecoverySource, SnapshotPiece, choose_recovery_source

logger = logging.getLogger(__name__)


@dataclass
class PreparedRestore:
    """A decision and, when it reads memory, the in-flight reads of its pieces (by rank)."""
    decision: RecoverySource
    reads: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class MemoryStart:
    """What the ranks of one placement need: snapshot series, and where to resume from."""
    job_id: str
    generation: int
    snapshots: bool  # take per-step snapshots (and replicate them across nodes)
    restore_uris: dict[str, str] = field(default_factory=dict)  # node id -> assembled version


class MemoryRecovery:
    def __init__(self, job_id: str, checkpoint_uri: str, probe_s: float, timeout_s: float) -> None:
        self.job_id, self.checkpoint_uri = job_id, checkpoint_uri
        self.probe_s, self.timeout_s = probe_s, timeout_s

    def prepare(self, actors: list[Any]) -> PreparedRestore:
        """Inventory every agent, decide, and start reading the chosen pieces."""
        pieces = self.inventory(actors)
        decision = choose_recovery_source(pieces, self.storage_step())
        logger.info("job %s: recovery source %s (step %s): %s", self.job_id, decision.source,
                    decision.step, decision.reason)
        if decision.source == "storage":
            return PreparedRestore(decision)
        reads = [actors[holder].read_snapshot.remote(kind, decision.generation, rank, decision.step)
                 for rank, holder, kind in decision.holders]
        ready, _ = ray.wait(reads, num_returns=len(reads), timeout=self.timeout_s,
                            fetch_local=False)
        if len(ready) < len(reads):
            return self._fallback(decision, f"{len(reads) - len(ready)} piece(s) not read in "
                                            f"{self.timeout_s:.0f}s")
        return PreparedRestore(decision, reads)

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
        from checkpoint.catalog import Catalog
        from checkpoint.storage import Storage

        try:
            steps = Catalog(Storage(self.checkpoint_uri, timeout_s=self.probe_s)).committed_steps()
        except Exception as exc:  # the ranks will read storage themselves if memory loses
            logger.warning("job %s: cannot list %s (%s); comparing memory with nothing",
                           self.job_id, self.checkpoint_uri, exc)
            return None
        return max(steps) if steps else None

    def assemble(self, prepared: PreparedRestore | None, ranks: list[Any]) -> dict[str, str]:
        """One agent per node of the new layout assembles the pieces; node id -> URI."""
        if prepared is None or not prepared.reads:
            return {}
        d, t0 = prepared.decision, time.monotonic()
        first = {h.node_id: h for h in reversed(ranks)}
        refs = {node: h.actor.assemble_restore.remote(
                    self.job_id, f"{node[:12]}-g{d.generation}-s{d.step}", *prepared.reads)
                for node, h in first.items()}
        try:
            uris = dict(zip(refs, ray.get(list(refs.values()), timeout=self.timeout_s)))
        except (ray.exceptions.RayError, TimeoutError) as exc:
            self._fallback(d, f"assembling failed: {type(exc).__name__}: {str(exc)[:300]}")
            return {}
        logger.info("job %s: step %d assembled from %s on %d node(s) in %.2fs", self.job_id,
                    d.step, d.source, len(uris), time.monotonic() - t0)
        return uris

    def _fallback(self, decision: RecoverySource, why: str) -> PreparedRestore:
        logger.warning("job %s: in-memory step %s unusable (%s); resuming from storage",
                       self.job_id, decision.step, why)
        return PreparedRestore(RecoverySource("storage", None, reason=why))
