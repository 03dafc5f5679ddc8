"""tenax.orchestrator.cli — the `tenax` command line.

- `tenax.orchestrator.cli.main.main` (also `tenax.orchestrator.main`): the entry point
  (`tenax plan|run|data|ckpt|submit|status|watch|scale|cancel|serve`); not a name of this face,
  whose module `main` has the same name.
- `run_job`: `tenax run`, one job in the foreground (`ray_session`, `sigterm_interrupts`,
  `EventSink`).
- `Client`: the gRPC client of the service commands; `human_line`.

Names resolve lazily (PEP 562).
"""
from __future__ import annotations

from tenax.faces import lazy_face

_MODULES = {
    "runner": ("EventSink", "ray_session", "run_job", "sigterm_interrupts"),
    "client": ("Client", "human_line"),
}

__all__, __getattr__, __dir__ = lazy_face(__name__, _MODULES)
