"""Every exception the checkpoint layer raises, in one torch-free module.

Why one module: callers (the rank loop, the controller, the service, the CLI) catch these
without importing the code that raises them, and an agent that only moves snapshots must not
pay for torch. Constructors take only a message, so every class pickles across Ray actor
boundaries.
"""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


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


class StorageError(Exception):
    """A checkpoint storage operation failed; the message names the URI."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


class StorageNotFoundError(StorageError):
    """The file or directory does not exist."""


class StorageTimeoutError(StorageError):
    """The storage call did not finish within its deadline."""


class CatalogError(Exception):
    """A checkpoint version cannot be begun, committed or read; the message names the URI."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


class ManifestError(CatalogError):
    """A manifest is unreadable, malformed or of an unknown format version."""


class CatalogUnreachableError(CatalogError):
    """Storage did not answer (an I/O error, not a checksum mismatch): nothing is known about
    the version, so it must be neither skipped as damaged nor deleted."""


class MetadataFormatError(Exception):
    """`.metadata` is not a JSON document of a known version; the message says which field."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


class PlanFormatError(ValueError):
    """A handed plan is not one this codec wrote (it is then planned anew, never trusted)."""


class CheckpointWriteError(Exception):
    """A rank could not write its part of a save, or rank 0 could not commit it."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


class SnapshotError(Exception):
    """A snapshot is missing, incomplete or fails its checksum (picklable: crosses Ray)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


def describe_error(exc: BaseException) -> str:
    """One line per failing rank: DCP's own message holds every rank's full traceback."""
    from torch.distributed.checkpoint.api import CheckpointException  # torch only when asked

    if isinstance(exc, CheckpointException):
        return "; ".join(f"rank {r}: {type(e).__name__}: {e}"
                         for r, (e, _) in sorted(exc.failures.items()))
    return f"{type(exc).__name__}: {exc}"
