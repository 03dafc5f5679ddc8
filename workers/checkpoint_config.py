"""The checkpoint layer's config, built from the job spec (the caller's side of the seam).

`checkpoint/` cannot import the pydantic spec (it sits below workers/), so the rank loop, the
tests and the benchmarks turn the spec's `checkpoint`, `fault_tolerance`, `name` and `model`
sections into the plain `CheckpointConfig` the manager takes, here and nowhere else.
"""
from __future__ import annotations

import logging

from tenax.checkpoint import CheckpointConfig, spec_hash
from tenax.workers.spec import JobSpec

logger = logging.getLogger(__name__)


def checkpoint_config(spec: JobSpec) -> CheckpointConfig:
    """The job's storage checkpoint settings; the model hash covers the whole `model` section
    (canonical JSON), so a checkpoint never loads into a differently shaped model."""
    ck = spec.checkpoint
    return CheckpointConfig(uri=ck.uri, job=spec.name,
                            model_hash=spec_hash(spec.model.hash_dump()),
                            every_steps=ck.every_steps, keep_last=ck.keep_last,
                            keep_every=ck.keep_every, async_save=ck.async_,
                            timeout_s=spec.fault_tolerance.hang_timeout_s)
