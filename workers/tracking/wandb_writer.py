"""Weights & Biases backend: the tracker's scalars as one W&B run per job.

The run id comes from the service's job id, or for `tenax run` and the local launcher from the
spec's name and checkpoint URI (`tracker.wandb_run_id`, `tracker.TrackingStart`), and every
attempt of rank 0 opens it with `resume="allow"`, so a recovery, a rescale, a restarted service
or `tenax run` run again appends to the same run instead of starting a new one. After a restart
the controller's job/restarts and job/lost_steps join the attempt's first row. The spec is the
run's config. W&B's history only moves forward: online, the values of steps redone after a
failure are dropped by W&B (the first value of such a step stays; TensorBoard keeps the final
one). Offline (`mode: offline`), each attempt is its
own directory under WANDB_DIR, all with the same id; `wandb sync` uploads them into one run.

System metrics sampling and console capture are off: the first costs a CPU thread in the
training process, the second wraps its stdout and stderr.

Why the run's `.wandb` file is flushed every `TRANSACTION_LOG_FLUSH_S`: wandb's service process
writes it through a buffer it empties every 15 s by default, and a failure kills rank 0's
process (and with it the service) without `finish`, so an attempt that ran less than that
before a failure left an empty run directory: offline, its steps were lost for good, the ones
no later attempt redoes included. Flushing each second bounds that loss to about a second.

Why the tracker hands this backend its records every `BATCH_S` rather than at each step: every
`run.log` wakes wandb's service process and the writer thread, which on a host whose cores
the ranks keep busy preempts a rank at each step; in batches the wake-ups are few whatever
the step time. A killed attempt may then lose up to `BATCH_S` more of its newest records
(`tracking_bench`; TensorBoard and the JSON log keep them).
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

logger = logging.getLogger(__name__)

TRANSACTION_LOG_FLUSH_S = 1.0  # seconds of records a killed attempt may lose (module doc)
BATCH_S = 0.5  # how often the tracker hands this backend its records (module doc)


class WandbWriter:
    """A tracking backend (workers/tracking/tracker.py `Backend`) for one W&B run."""
    name = "wandb"
    batch_s = BATCH_S  # the tracker hands records over this often (module doc)

    def __init__(self, section: Mapping[str, Any], run_id: str, job_name: str,
                 figures: Mapping[str, float] | None = None) -> None:
        self.section, self.run_id, self.job_name = dict(section), run_id, job_name
        self.figures = dict(figures or {})  # the controller's job/* totals at this start
        self.run: Any = None
        self._pending: dict[int, dict[str, Any]] = {}

    def open(self, first_step: int, spec: Mapping[str, Any]) -> None:
        import wandb

        s = self.section
        settings = wandb.Settings(**run_settings(wandb))
        self.run = wandb.init(project=s.get("project") or "tenax", entity=s.get("entity"),
                              name=s.get("name") or self.job_name, id=self.run_id,
                              resume="allow", mode=s.get("mode") or "online",
                              config=dict(spec), settings=settings, reinit="create_new")
        logger.info("wandb: run %s (%s) from step %d", self.run_id, s.get("mode"), first_step)
        if self.figures:  # in the row of the attempt's first step (steps only move forward)
            self._pending.setdefault(first_step + 1, {}).update(self.figures)

    def scalars(self, step: int, values: Mapping[str, float], wall_time: float) -> None:
        # One log call per step: eval and checkpoint records of a step join its row.
        self._pending.setdefault(step, {}).update(values)

    def text(self, step: int, tag: str, text: str, wall_time: float) -> None:
        self._pending.setdefault(step, {})[tag] = text

    def flush(self) -> None:
        if self.run is None:
            raise RuntimeError("wandb: the run is not open")
        for step in sorted(self._pending):
            self.run.log(self._pending[step], step=step)
        self._pending.clear()

    def close(self) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            if self._pending:
                for step in sorted(self._pending):
                    run.log(self._pending[step], step=step)
                self._pending.clear()
            run.finish()


def run_settings(wandb: Any) -> dict[str, Any]:
    """The run's `wandb.Settings`: quiet, no system metrics, no console capture, and the
    `.wandb` file flushed every TRANSACTION_LOG_FLUSH_S where this wandb has that setting
    (0.19 has not: it keeps its own flushing)."""
    out: dict[str, Any] = {"silent": True, "console": "off", "x_disable_stats": True}
    if "x_transaction_log_flush_interval" in getattr(wandb.Settings, "model_fields", {}):
        out["x_transaction_log_flush_interval"] = TRANSACTION_LOG_FLUSH_S
    return out
