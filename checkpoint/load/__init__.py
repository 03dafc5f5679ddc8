"""tenax.checkpoint.load — reading a committed version back into any layout.

- `RawReader`: DCP's storage reader over `Storage`; it fetches exactly the byte ranges DCP's
  load plan asks for (the plan does the resharding). `LocalChunkReader` reads those ranges
  from a local filesystem with pread, straight into the destination; `read_pieces` reads many
  such ranges on parallel threads.
- `training_state`, `apply_training_state`: a trainer's state as layout-free tensors keyed by
  canonical names, and back.

Names resolve lazily (PEP 562); the errors live in `tenax.checkpoint.errors`.
"""
from __future__ import annotations

from tenax.faces import lazy_face

_MODULES = {
    "raw_reader": ("RawReader",),
    "local_reads": ("LocalChunkReader",),
    "parallel_reads": ("read_pieces",),
    "reshard": ("apply_training_state", "training_state"),
}

__all__, __getattr__, __dir__ = lazy_face(__name__, _MODULES)
