"""Environment for local Ray clusters that must stay on 127.0.0.1, and start without an idle second.

Ray reads `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER` when it is imported, and only with it set to 0
does a node started with `_node_ip_address="127.0.0.1"` register that address (otherwise it
registers the primary interface's). So this must run before the first `import ray`.

A raylet connects to its own object store as soon as it has started the store's thread; when
the store is not listening yet (a race it loses about two times in three on a 2-core host),
Ray waits `raylet_client_connect_timeout_milliseconds` (1 s by default) before trying again,
and `ray.init` returns a whole second later (2.35 s against 3.35 s, bench/RESULTS.md). Tenax
asks for a retry every 50 ms with 20 times the attempts, which keeps Ray's 10 s budget for a
store that is really slow. Every Ray process started from here inherits the setting (a worker
fetching its config from the raylet retries on the same clock). A user who set either value
keeps both of theirs.
"""
from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

CONNECT_RETRY_MS = 50
CONNECT_ATTEMPTS = 200  # x 50 ms: Ray's default budget of 10 x 1 s
CONNECT_KEYS = ("RAY_raylet_client_connect_timeout_milliseconds",
                "RAY_raylet_client_num_connect_attempts")


def loopback_env() -> None:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    prompt_connect_env()


def prompt_connect_env() -> None:
    """Ray's processes retry their local connections every 50 ms instead of every second."""
    if any(key in os.environ for key in CONNECT_KEYS):
        logger.info("keeping the Ray connect retry settings from the environment (%s)",
                    ", ".join(f"{k}={os.environ.get(k)}" for k in CONNECT_KEYS))
        return
    os.environ[CONNECT_KEYS[0]] = str(CONNECT_RETRY_MS)
    os.environ[CONNECT_KEYS[1]] = str(CONNECT_ATTEMPTS)
