"""tenax.orchestrator.placement — where a job's ranks run and where they resume from.

- `WorkerGroup`: one Ray agent per GPU slot in STRICT_PACK placement groups; heartbeats,
  start, stop, shutdown. Its view of a rank (rank_handle.py): `RankHandle`, `RankHealth`
  (what the policies read), `progressed` (what restarts a rank's hang clock). Its node blocks
  (node_blocks.py): `NodeBlocks` makes, repairs and releases a block's placement group, agents
  and zygote (none on the launcher's node, whose forkserver the agents there fork from).
- `Placer`: PLACING's executor (warm re-join first, cold fallback); `PLACEMENT_ERRORS`.
- Capacity: `Capacity`, `cluster_capacity`, `cluster_gpus` (the GPUs as Ray names them),
  `NodeProbes` (is a suspect node still there?);
  `ray_nodes` (`NodesReader`, nodes_reader.py, also read by host_memory.py): ray.nodes() with
  a deadline (`RayNodesTimeout`).
- Recovery source: `choose_recovery_source` (pure: memory, replica or storage) over
  `SnapshotPiece`s into a `RecoverySource`; `MemoryRecovery`, `MemoryStart`.
- Host memory: `plan_snapshot_memory` (do in-memory snapshots fit the nodes?),
  `ray_node_memory_bytes`, `snapshot_tmpfs_room`.

Names resolve lazily (PEP 562).
"""
from __future__ import annotations

from tenax.faces import lazy_face

_MODULES = {
    "rank_handle": ("PhaseMarks", "RankHandle", "RankHealth", "progressed"),
    "worker_group": ("WorkerGroup",),
    "node_blocks": ("NodeBlocks",),
    "placer": ("PLACEMENT_ERRORS", "Placer"),
    "capacity": ("Capacity", "NodeProbes", "cluster_capacity", "cluster_gpus", "ray_nodes"),
    "nodes_reader": ("NodesReader", "RayNodesTimeout"),
    "recovery_policy": ("RecoverySource", "SnapshotPiece", "choose_recovery_source"),
    "recovery": ("MemoryRecovery", "MemoryStart"),
    "host_memory": ("plan_snapshot_memory", "ray_node_memory_bytes", "snapshot_tmpfs_room"),
}

__all__, __getattr__, __dir__ = lazy_face(__name__, _MODULES)
