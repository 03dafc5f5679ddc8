"""tenax.checkpoint — a job's training state in storage checkpoints and in-memory snapshots.

- `CheckpointConfig`: what the layer needs of a job (URI, cadence, retention, writer, timeout,
  job name, model hash), a plain dataclass the caller builds from the job spec
  (`tenax.workers.checkpoint_config`).
- `CheckpointManager`: one rank's save / load / wait / close; asynchronous two-phase commits,
  reshard on load.
- Errors: every exception of the layer (checkpoint/errors.py), torch-free to import.
- `all_ranks_agree` (one tiny all-reduce of a flag), `use_control_group` (the CPU group those
  go over when the job's group is a device's), `byte_view` (a tensor's bytes as numpy),
  `register` (the `tenax ckpt` commands for the CLI's parser).
- The headline names of the rooms, also at their own faces: `Catalog`, `CommitInfo`,
  `Manifest`, `Storage`, `spec_hash`, `version_name` (format); `MemorySnapshotter`,
  `assemble_version` (memory).

Rooms, bottom to top: `format` (storage seam, catalog, manifest, retention, metadata codec),
`load` (resharding reads), `save` (plans, writers), `memory` (snapshots, restore); each
package's face lists its names. Names resolve lazily (PEP 562): importing this package or
`tenax.checkpoint.errors` imports neither torch nor the modules behind names it does not use.
"""
from __future__ import annotations

from tenax.faces import lazy_face

_MODULES = {
    "config": ("CheckpointConfig",),
    "manager": ("CheckpointManager", "WRITERS"),
    "errors": ("CatalogError", "CatalogUnreachableError", "CheckpointError",
               "CheckpointTimeoutError", "CheckpointWriteError", "ManifestError",
               "MetadataFormatError", "ModelMismatchError", "PlanFormatError", "ShardError",
               "SnapshotError", "StateProviderError", "StorageError", "StorageNotFoundError",
               "StorageTimeoutError", "describe_error"),
    "collectives": ("all_ranks_agree", "use_control_group"),
    "tensor_bytes": ("byte_view",),
    "cli": ("register",),
    "format.catalog": ("Catalog", "spec_hash", "version_name"),
    "format.manifest": ("CommitInfo", "Manifest"),
    "format.storage": ("Storage",),
    "memory.snapshot": ("MemorySnapshotter",),
    "memory.restore": ("assemble_version",),
}

__all__, __getattr__, __dir__ = lazy_face(__name__, _MODULES)
