"""The process side of `tenax serve`: signals that stop it, and an ordered, total shutdown.

Split from orchestrator/service/server.py: how the process starts and stops is independent of
the gRPC handlers.
"""
from __future__ import annotations

import logging
import signal
import threading
from typing import Any

logger = logging.getLogger(__name__)


def shutdown_all(server: Any, metrics: Any, store: Any) -> None:
    """Every step runs even if an earlier one fails: Ray must not outlive the server."""
    import ray

    steps = [("grpc", server.stop if server else None),
             ("metrics", metrics.close if metrics else None),
             ("ray", ray.shutdown if ray.is_initialized() else None),  # embedded: stops it
             ("store", store.close)]
    for name, step in steps:
        try:
            if step is not None:
                step()
        except Exception:
            logger.exception("shutdown: %s failed", name)


def print_ready(line: str) -> None:
    print(line, flush=True)


def on_signals(stop: threading.Event) -> dict[int, Any] | None:
    """SIGTERM/SIGINT set `stop`; returns the previous handlers (None off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None  # tests run the server in a thread and stop it with `stop`

    def handler(signum: int, frame: Any) -> None:
        if stop.is_set():
            logger.warning("already shutting down (signal %d ignored); SIGKILL stops at once",
                           signum)
        stop.set()

    return {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}


def restore_signals(previous: dict[int, Any] | None) -> None:
    for sig, old in (previous or {}).items():
        signal.signal(sig, old)
