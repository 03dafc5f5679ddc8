"""tenax.orchestrator.preflight — a smoke test of a job before a long run (docs/preflight.md).

- `run_preflight(spec, steps)`: the job itself for a few steps on its own placement and layout,
  on scratch checkpoints removed afterwards; a `Report` of `Row`s (data, memory, progress,
  throughput, links, recovery), each pass | warn | fail, and the `preflight` event.
- The rows' rules (pure): `data_row`, `memory_plan_row`, `memory_row`, `progress_row`,
  `throughput_row`, `links_row`, `recovery_row`, `memory_restore`, `overall`;
  `links_check(spec, layout)` runs the links probes (workers/preflight_links.py) on the job's
  slots; `recovery_check` runs the recovery row's jobs (another layout, an in-memory restore).

Names resolve lazily (PEP 562): importing this package imports neither Ray nor torch.
"""
from __future__ import annotations

from tenax.faces import lazy_face

_MODULES = {
    "smoke": ("DEFAULT_STEPS", "PreflightInterrupted", "Report", "preflight_steps",
              "run_preflight", "scratch_spec"),
    "rows": ("Row", "memory_plan_row", "memory_restore", "memory_row", "overall",
             "progress_row", "recovery_row", "throughput_row"),
    "data": ("data_row", "scan_token_file"),
    "recovery": ("other_layout", "recovery_check"),
    "links": ("GroupFigure", "group_figures", "link_tasks", "links_row", "planner_sizes"),
    "links_probe": ("links_check", "slow_factors"),
}

__all__, __getattr__, __dir__ = lazy_face(__name__, _MODULES)
