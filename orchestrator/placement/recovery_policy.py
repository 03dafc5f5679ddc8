"""RecoverySourcePolicy (pure): resume from which step, read from where.

Facts: what every live agent holds (`SnapshotPiece`: its own rank's snapshots, `local`, and
the replicas it keeps for the previous node's ranks, `replica`) and the newest committed
storage step. A step is usable from memory only when every rank of the layout that took it
(one generation, one world size) has a complete piece of that step on some live agent — the
in-memory equivalent of manifest-last. The newest usable step wins; storage wins only when it
is strictly newer (memory loads faster, so a tie goes to memory). Per rank a local piece is
preferred over a replica (no extra copy). The source is `memory` when every piece is some
agent's own, `replica` when any piece comes from a replica, `storage` otherwise.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SnapshotPiece:
    holder: int  # index of the agent that holds it (in the list the controller asked)
    kind: str  # local | replica
    generation: int
    rank: int
    world: int
    step: int


@dataclass(frozen=True)
class RecoverySource:
    source: str  # memory | replica | storage
    step: int | None
    generation: int = -1
    world: int = 0
    holders: tuple[tuple[int, int, str], ...] = ()  # (rank, holder index, kind), by rank
    reason: str = ""


def choose_recovery_source(pieces: Sequence[SnapshotPiece],
                           storage_step: int | None) -> RecoverySource:
    """The newest complete in-memory step vs the newest committed storage step."""
    sets: dict[tuple[int, int, int], dict[int, SnapshotPiece]] = {}
    for p in pieces:
        chosen = sets.setdefault((p.step, p.generation, p.world), {})
        if p.rank not in chosen or (chosen[p.rank].kind != "local" and p.kind == "local"):
            chosen[p.rank] = p
    complete = [(key, by_rank) for key, by_rank in sets.items()
                if set(by_rank) == set(range(key[2]))]
    stored = "none committed" if storage_step is None else f"step {storage_step}"
    if not complete:
        partial = max(sets, default=None)
        why = ("no agent holds a snapshot" if partial is None else
               f"step {partial[0]} is missing ranks "
               f"{sorted(set(range(partial[2])) - set(sets[partial]))}")
        return RecoverySource("storage", storage_step,
                              reason=f"no complete in-memory step ({why}); storage: {stored}")
    (step, generation, world), by_rank = max(complete, key=lambda c: (c[0][0], c[0][1]))
    if storage_step is not None and storage_step > step:
        return RecoverySource("storage", storage_step,
                              reason=f"storage step {storage_step} is newer than the newest "
                                     f"complete in-memory step {step}")
    holders = tuple((r, by_rank[r].holder, by_rank[r].kind) for r in range(world))
    source = "replica" if any(kind == "replica" for _, _, kind in holders) else "memory"
    replicas = [r for r, _, kind in holders if kind == "replica"]
    via = f", ranks {replicas} from replicas" if replicas else ""
    return RecoverySource(source, step, generation, world, holders,
                          reason=f"step {step} is complete in memory ({world} ranks{via}); "
                                 f"storage: {stored}")
