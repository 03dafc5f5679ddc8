"""ray.nodes() with a deadline, shared by whoever reads Ray's node table.

ray.nodes() is a GCS call with no deadline of its own. Ray is imported only when the call
runs, so a module that reads node memory (host_memory.py, which `tenax plan` imports without
Ray) can share this reader with the capacity check.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from tenax.orchestrator.errors import RayNodesTimeout

logger = logging.getLogger(__name__)

__all__ = ["NODES_TIMEOUT_S", "NodesReader"]

NODES_TIMEOUT_S = 10.0


class NodesReader:
    """ray.nodes() with a deadline: the call runs on a daemon thread and the caller waits at
    most `timeout_s`. One call at a time: callers arriving while one hangs wait on that same
    call, so a hung GCS costs one stuck thread, not one per caller."""

    def __init__(self, list_nodes: Any = None) -> None:
        self.list_nodes = list_nodes  # None: ray.nodes, looked up at each call
        self._lock = threading.Lock()
        self._call: Future | None = None
        self.last: list[dict[str, Any]] | None = None  # the newest answer, for stale_ok

    def nodes(self, timeout_s: float = NODES_TIMEOUT_S,
              stale_ok: bool = False) -> list[dict[str, Any]]:
        """Ray's node table; with `stale_ok` the last answer when this one is late (logged),
        else RayNodesTimeout naming the deadline. Errors of ray.nodes() itself propagate."""
        with self._lock:
            if self._call is None or self._call.done():
                self._call = Future()
                threading.Thread(target=self._run, args=(self._call,), daemon=True,
                                 name="tenax-ray-nodes").start()
            call = self._call
        try:
            nodes = call.result(timeout=timeout_s)
        except FutureTimeout:
            if stale_ok and self.last is not None:
                logger.warning("ray.nodes() did not answer within %g s; using its previous "
                               "answer", timeout_s)
                return self.last
            raise RayNodesTimeout(f"ray.nodes() did not answer within {timeout_s:g} s: is the "
                                  f"Ray GCS reachable?") from None
        self.last = nodes
        return nodes

    def _run(self, call: Future) -> None:
        try:
            if self.list_nodes is None:
                import ray  # here, not at import: the plan CLI reads node memory without Ray

                call.set_result(list(ray.nodes()))
            else:
                call.set_result(list(self.list_nodes()))
        except BaseException as err:  # handed to the waiting caller
            call.set_exception(err)
