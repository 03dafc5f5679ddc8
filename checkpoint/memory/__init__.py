"""tenax.checkpoint.memory — per-step snapshots in host memory, and restoring from them.

- `MemorySnapshotter`: one rank's state copied every step into memory its agent owns (what a
  storage save of that step would write), off the critical path.
- `SnapshotDir`, `SnapshotStamp`, `crc32c_of`: the `.partial`/stamp layout that makes a copy
  killed half-way invisible; torch-free, for agents.
- The tmpfs tree (`tmpfs_tree`): `snapshot_root` (checked: ours alone), `SNAPSHOT_ENV`,
  `job_dir`, `file_name_of`, `makedirs_private`, `JobLock`, `snapshot_trees` and
  `sweep_stale` (jobs that are gone), `free_space`, `used_bytes`; its base (`snapshot_base`:
  never one where another user could swap the tree) and `few_inodes`.
- `BufferMaps`: the kept memory mappings of the double buffer.
- `assemble_version`: every rank's pieces of one step committed as an ordinary version, which
  the manager then loads (and reshards) like storage.

Names resolve lazily (PEP 562); the errors live in `tenax.checkpoint.errors`.
"""
from __future__ import annotations

from tenax.faces import lazy_face

_MODULES = {
    "snapshot": ("MemorySnapshotter",),
    "snapshot_store": ("SnapshotDir",),
    "snapshot_stamp": ("SnapshotStamp", "crc32c_of"),
    "tmpfs_tree": ("SNAPSHOT_ENV", "JobLock", "file_name_of", "free_space", "job_dir",
                   "makedirs_private", "snapshot_root", "snapshot_trees", "sweep_stale",
                   "used_bytes"),
    "snapshot_base": ("few_inodes", "snapshot_base"),
    "buffer_maps": ("BufferMaps",),
    "restore": ("assemble_version",),
}

__all__, __getattr__, __dir__ = lazy_face(__name__, _MODULES)
