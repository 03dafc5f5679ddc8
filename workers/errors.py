"""The exceptions the workers layer raises to its callers.

Message-only constructors: an error raised in a rank's agent crosses Ray's actor boundary
pickled, and `pickle` rebuilds an exception from its arguments.
"""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

__all__ = ["SpecError", "ZygoteError"]


class SpecError(ValueError):
    """A job spec that cannot run; the message names every bad field and its value."""


class ZygoteError(RuntimeError):
    """A node's zygote could not start its forkserver (its agents fork from their own then)."""
