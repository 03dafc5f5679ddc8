"""Environment for local Ray clusters that must stay on 127.0.0.1.

Ray reads `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER` when it is imported, and only with it set to 0
does a node started with `_node_ip_address="127.0.0.1"` register that address (otherwise it
registers the primary interface's). So this must run before the first `import ray`.
"""
from __future__ import annotations

import os


def loopback_env() -> None:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
