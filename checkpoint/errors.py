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


class ShardError(Exception):
    """A shard cannot be planned or read; the message names the file and tensor."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


def describe_error(exc: BaseException) -> str:
    """One line per failing rank: DCP's own message holds every rank's full traceback."""
    from torch.distributed.checkpoint.api import CheckpointException  # torch only when asked

    if isinstance(exc, CheckpointException):
        return "; ".join(f"rank {r}: {type(e).__name__}: {e}"
                         for r, (e, _) in sorted(exc.failures.items()))
    return f"{type(exc).__name__}: {exc}"
