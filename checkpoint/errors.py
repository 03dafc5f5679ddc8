"""Checkpoint exceptions. Message-only constructors, so they pickle across Ray actor boundaries."""
from __future__ import annotations


class CheckpointError(Exception):
    """A checkpoint cannot be saved or loaded as asked; the message names URI, step, field."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


class CheckpointTimeoutError(CheckpointError):
    """A save did not finish within its deadline."""


class ModelMismatchError(CheckpointError):
    """The checkpoint was written for a different model spec (hash mismatch)."""


class StateProviderError(CheckpointError):
    """The object given to the manager cannot provide training state."""
