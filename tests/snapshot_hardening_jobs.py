"""Per-rank jobs for the snapshot hardening tests (importable by spawned ranks)."""
from __future__ import annotations

import os
from typing import Any


def out_of_space_job(rank: int, world: int, roots: list[str], numel: int,
                     steps: int) -> dict[str, Any]:
    """Every rank snapshots every step into its own root (rank 0's on a small tmpfs). Returns
    the events it was told, the complete steps it held after each step, whether it stopped,
    and any `.partial` left behind."""
    from tenax.checkpoint.collectives import all_ranks_agree
    from tenax.checkpoint.memory.snapshot import MemorySnapshotter
    from tenax.checkpoint.memory.snapshot_store import SnapshotDir
    from tests.ckpt_jobs import DictState, ckpt_config

    root = roots[rank]
    state, store, events = DictState(numel=numel), SnapshotDir(root), []
    snaps = MemorySnapshotter(ckpt_config(f"file://{root}-ckpt"), state, rank, world, root, 5,
                              all_ranks_agree, events.append)
    held = []
    for step in range(1, steps + 1):
        state.train()
        snaps.snapshot(step)
        snaps.wait()
        held.append(sorted(s.step for s in store.complete()))
    snaps.close()
    partials = [name for base, dirs, _ in os.walk(root) for name in dirs
                if name.endswith(".partial")]
    return {"events": events, "held": held, "stopped": snaps.stopped, "partials": partials}
