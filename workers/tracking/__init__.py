"""tenax.workers.tracking — what users plot, written by rank 0's process off the training thread.

- `Tracker`: records in through a bounded queue, backends written on one thread; `open_tracker`
  (rank 0 with a `logging` section), `tee_hooks` (a RankHooks whose records also go there, and
  a switched-off backend's `tracking_off` event out); `TrackingStart` (the W&B run id and the
  controller's restart totals, handed to the ranks at each start).
- Backends: `TensorBoardWriter` (`logging.tensorboard_dir`, any fsspec URI), `WandbWriter`
  (`logging.wandb`); `scalars_of`/`texts_of` map records to their series for both.
- `device_figures`: `mfu` and `peak_allocated_bytes` of a step on CUDA.
- `JobEvents` / `job_events`: the controller's failures, recoveries and rescales as the
  TensorBoard run `<tensorboard_dir>/job`.

Names resolve lazily (PEP 562): importing this package imports neither tensorboard nor wandb.
"""
from __future__ import annotations

from tenax.faces import lazy_face

_MODULES = {
    "tracker": ("Backend", "Tracker", "TrackerStats", "TrackingStart", "backends_for",
                "open_tracker", "scalars_of", "tee_hooks", "texts_of", "wandb_run_id"),
    "tensorboard_writer": ("TensorBoardWriter", "event_file_name", "tfrecord"),
    "wandb_writer": ("WandbWriter",),
    "figures": ("device_figures",),
    "job_events": ("JobEvents", "job_events"),
}

__all__, __getattr__, __dir__ = lazy_face(__name__, _MODULES)
