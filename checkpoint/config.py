"""The checkpoint layer's own config: a plain frozen dataclass the caller builds from the spec.

`checkpoint/` sits below `workers/` (orchestrator -> workers -> checkpoint -> parallel), so it
cannot see the user-facing pydantic spec; like `parallel/config.py`, it takes only what it
reads. The spec validated the user's values once; the checks here are the ones the layer
itself relies on, so a config built by hand (tests, benchmarks) fails early and by name.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from tenax.checkpoint.errors import CheckpointError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointConfig:
    """What one job's storage checkpoints need.

    `job` (the job's name) and `model_hash` (`spec_hash` of the model section) go into every
    manifest; a checkpoint loads only into a model of the same hash. `async_save` picks the
    thread writer, else saves are synchronous (the manager's `writer` argument overrides it).
    `timeout_s` bounds every wait of a save or load (the spec's fault_tolerance.hang_timeout_s).
    """

    uri: str
    job: str
    model_hash: str
    every_steps: int = 20
    keep_last: int = 3
    keep_every: int = 0
    async_save: bool = True
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name, minimum in (("every_steps", 1), ("keep_last", 1), ("keep_every", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise CheckpointError(f"checkpoint config: {name} must be an int >= {minimum}, "
                                      f"got {value!r}")
        if not self.timeout_s > 0:
            raise CheckpointError(f"checkpoint config: timeout_s must be > 0, got "
                                  f"{self.timeout_s!r}")
        if not self.uri:
            raise CheckpointError("checkpoint config: uri must not be empty")
