"""tenax.checkpoint.save — planning a save once and writing it off the training thread.

- `SavePlans`, `PlanCache`, `PlannedSave`, `plan_save`, `STEP_KEY`: DCP's save plan, reused
  while the state's tensors stay the same (storage checkpoints and snapshots share it).
- `encode_plan`, `decode_plan`: a plan handed to the next process as JSON, never trusted.
- `StateProvider`, `TrainerState`: what the manager needs from a trainer.
- `commit_event`: the `checkpoint` event of a committed version, from its manifest.
- `as_background`, `os_thread_name`, `SNAPSHOT_THREAD`, `WRITER_THREAD`: the low-priority
  threads that write and copy.

Names resolve lazily (PEP 562); the errors live in `tenax.checkpoint.errors`.
"""
from __future__ import annotations

from tenax.faces import lazy_face

_MODULES = {
    "planning": ("PlanCache", "PlannedSave", "STEP_KEY", "SavePlans", "plan_save"),
    "plan_codec": ("decode_plan", "encode_plan"),
    "state": ("StateProvider", "TrainerState"),
    "writer": ("commit_event",),
    "background": ("SNAPSHOT_THREAD", "WRITER_THREAD", "as_background", "os_thread_name"),
}

__all__, __getattr__, __dir__ = lazy_face(__name__, _MODULES)
