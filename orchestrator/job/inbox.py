"""Requests from outside the controller's loop: cancel, scale, a node reported lost.

Why an inbox: gRPC handler threads (tenax serve), Ctrl-C, drills and, next, the scheduler all
want to change a running job, but only the controller's loop may change its state. They post
a request object here (thread-safe, never blocks on the loop, and ends the loop's idle wait);
the loop drains the inbox once per iteration and its policies see the requests in the
snapshot. New kinds of request (the
scheduler's shrink/grow/preempt) are new dataclasses, not new locks in the controller.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Union

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CancelRequest:
    reason: str = "cancel requested"


@dataclass(frozen=True)
class ScaleRequest:
    nodes: int


@dataclass(frozen=True)
class NodeLostReport:
    """A node-sized block of the current placement (ranks [k*g, (k+1)*g)) is gone, as told by
    someone who knows before the heartbeats do (a preemption notice, a `kill node` drill)."""
    block: int
    reason: str


@dataclass(frozen=True)
class PreemptRequest:
    """The service's scheduler wants the job's GPUs back: stop at a checkpoint boundary (the
    planned rescale stop) and end; the service requeues the job instead of recording an end."""
    reason: str


@dataclass(frozen=True)
class CapacityNotice:
    """The nodes the job may use changed (the service's scheduler grew or shrank its grant): the
    loop looks at its capacity now instead of at its next periodic look."""
    reason: str


Request = Union[CancelRequest, ScaleRequest, NodeLostReport, PreemptRequest, CapacityNotice]


class Inbox:
    """A thread-safe queue of requests; `drain` hands the loop everything posted so far."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[Request] = []
        self._scale_target: int | None = None
        self.wake = threading.Event()  # set by every post: the loop's idle wait ends at once

    def post(self, request: Request) -> None:
        with self._lock:
            self._items.append(request)
            if isinstance(request, ScaleRequest):
                self._scale_target = request.nodes
        self.wake.set()
        logger.info("inbox: %s posted", request)

    def drain(self) -> list[Request]:
        with self._lock:
            items, self._items = self._items, []
            self._scale_target = None
        return items

    def pending_scale(self) -> int | None:
        """The newest scale target not yet drained (status answers it before the loop does)."""
        with self._lock:
            return self._scale_target
