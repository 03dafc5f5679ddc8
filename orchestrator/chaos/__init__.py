"""tenax.orchestrator.chaos — drills: faults injected on purpose, through the doors a user has.

- `parse_chaos`, `validate_for_job`: `--chaos "kill rank=1 at=30; ..."` into `ChaosEvent`s,
  checked against the job (a bad one raises `tenax.orchestrator.errors.ChaosError`).
- `ChaosDriver`: the controller-side half (scale, node-loss reports, corrupted checkpoints);
  it builds the one `RankChaos` the ranks get, and a job without a drill has none.
- `ChaosLedger`: the Ray actor where ranks claim a fault so it fires once per job;
  `corrupt_newest_checkpoint`; `KINDS`.

Names resolve lazily (PEP 562).
"""
from __future__ import annotations

from tenax.faces import lazy_face

_MODULES = {
    "faults": ("KINDS", "ChaosEvent", "ChaosLedger", "corrupt_newest_checkpoint", "parse_chaos",
               "validate_for_job"),
    "driver": ("ChaosDriver",),
}

__all__, __getattr__, __dir__ = lazy_face(__name__, _MODULES)
