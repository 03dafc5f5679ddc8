"""The orchestrator's exceptions, in one module that imports nothing of the project.

Why one module: callers catch these across rooms (the CLI catches the chaos parser's and the
client's, the gRPC server the store's and the submission's), and a module of plain classes can
be imported from any of them without pulling in Ray, gRPC or torch. Every constructor takes
its message (and plain values) only, so each of them survives a pickle round trip, as an
exception crossing a Ray actor boundary must.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc

logger = logging.getLogger(__name__)

__all__ = ["ChaosError", "PlacementError", "PreflightInterrupted", "ProfileUnavailable",
           "RayNodesTimeout", "RpcAbort", "RpcFailed", "StorageRootError", "StoreError",
           "SubmitError"]


class ChaosError(ValueError):
    """A --chaos spec that cannot be parsed; the message names the event and the problem."""


class PlacementError(RuntimeError):
    """The GPUs asked for could not be placed within the timeout."""


class PreflightInterrupted(Exception):
    """Ctrl-C (or the caller's stop) ended a scratch job: no verdict, and no run after it."""


class ProfileUnavailable(RuntimeError):
    """The job has no running group to profile."""


class RayNodesTimeout(ConnectionError):
    """ray.nodes() did not answer in time (the GCS is down, partitioned or overloaded)."""


class RpcFailed(Exception):
    """An RPC answered an error status; the message is the one line the user sees."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


class SubmitError(ValueError):
    """A submission that cannot start; `kind` is invalid | conflict | unavailable."""

    def __init__(self, message: str, kind: str = "invalid") -> None:
        super().__init__(message, kind)
        self.message, self.kind = message, kind

    def __str__(self) -> str:
        return self.message


class StorageRootError(ValueError):
    """A URI that is malformed or outside every allowed root; the message names the field."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


class StoreError(Exception):
    """The job store cannot be opened or written; the message names the file."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


class RpcAbort(Exception):
    """Raised inside a gRPC handler to answer a status code with details."""

    def __init__(self, code: "grpc.StatusCode", details: str) -> None:
        super().__init__(code, details)
        self.code, self.details = code, details
