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

A node Ray starts in this process (`ray.init` without an address, `Cluster.add_node`) counts
as started once its raylet is registered with the GCS: Ray asks once, 0.1 s after starting the
raylet, and then once a whole second (a fixed sleep in Ray's C++ `GetNode`). The raylet
registers only after its dashboard agent has imported and reported its ports (0.65 s on a
quiet 2-core host), so the answer came 1.1 s after the raylet started. `prompt_node_start`
makes that lookup wait for the registration itself, asking the GCS every 20 ms within Ray's
own 30 s bound, and then ask Ray (which then answers at once). Where Ray's private layout
differs (another version) or the GCS refuses connections, Ray's own lookup runs as before.

A head node also starts Ray's API server (a dashboard process, started even with
`include_dashboard=False` for Ray's usage statistics), and Ray waits until it has published its
address before it starts the raylet: two Python processes importing one after the other (a
plain `ray.init` 2.0 s, 1.0 s of it this wait). Nothing of the raylet depends on the API server
(a worker's dashboard address is built from its own arguments), so `prompt_node_start` starts
it on a thread and the lookup above waits for it together with the raylet's registration:
the node is reported started only once both are up, as before. Ray's order is kept where the
user asked for the dashboard (its failure then fails the start) and where Ray's resource
isolation needs the API server's processes before the raylet starts.
"""
from __future__ import annotations

import importlib
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Callable

logger = logging.getLogger(__name__)

CONNECT_RETRY_MS = 50
CONNECT_ATTEMPTS = 200  # x 50 ms: Ray's default budget of 10 x 1 s
CONNECT_KEYS = ("RAY_raylet_client_connect_timeout_milliseconds",
                "RAY_raylet_client_num_connect_attempts")
REGISTER_POLL_S = 0.02
REGISTER_WAIT_S = 30.0  # Ray's raylet_start_wait_time_s
PROMPT_MARK = "tenax_prompt"  # set on the lookup that waits for the registration
API_SERVER_JOIN_S = 90.0  # beyond Ray's own bound on the API server's start (60 s by default)
API_SERVERS: dict[str, "ApiServerStart"] = {}  # node id (hex) -> its API server's start


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


def prompt_node_start() -> None:
    """Nodes started by this process are used as soon as their raylet registers, and a head's
    API server starts beside its raylet (see the module's docstring); installed once, after
    `import ray` is allowed (after `loopback_env`). The API server's start is waited for by
    the wrapped lookup, so it moves only where the lookup is wrapped."""
    if wrap_once("ray._private.services", "get_node", registered_lookup):
        wrap_once("ray._private.node", "Node.start_api_server", beside_raylet)


def wrap_once(module: str, path: str, wrap: Callable[[Any], Any]) -> bool:
    """Replace `module`'s `path` (a function or a class's method) with `wrap(original)`,
    unless that was done already; False, and Ray's own code as it is, where Ray's layout
    differs (another version)."""
    owner_path, _, name = path.rpartition(".")
    try:
        owner: Any = importlib.import_module(module)
        for part in filter(None, owner_path.split(".")):
            owner = getattr(owner, part)
    except (ImportError, AttributeError) as err:
        logger.info("%s.%s is not where Tenax expects it (%s): Ray starts at its own pace",
                    module, path, err)
        return False
    original = getattr(owner, name, None)
    if original is None:
        logger.info("%s.%s is missing: Ray starts at its own pace", module, path)
        return False
    if not getattr(original, PROMPT_MARK, False):
        setattr(owner, name, wrap(original))
    return True


def registered_lookup(original: Callable[[str, str], Any]) -> Callable[[str, str], Any]:
    """`original(gcs_address, node_id)`, asked once the node is listed alive by the GCS and
    its API server, if one starts beside its raylet, is up."""

    def get_node(gcs_address: str, node_id: str) -> Any:
        await_registration(gcs_address, node_id)
        started = API_SERVERS.pop(node_id, None)
        if started is not None:
            started.join()
        return original(gcs_address, node_id)

    setattr(get_node, PROMPT_MARK, True)
    return get_node


def await_registration(gcs_address: str, node_id: str, wait_s: float = REGISTER_WAIT_S) -> bool:
    """Whether node `node_id` (hex) was listed alive by the GCS at `gcs_address` within
    `wait_s`; False at once when the GCS cannot be asked (the caller's own lookup decides).
    A GCS that accepts connections but never answers holds this as long as Ray's own client
    waits for it (Ray's lookup, which makes the same connection, would wait as long)."""
    if not accepts(gcs_address, min(wait_s, 1.0)):  # Ray's client would wait ~40 s for it
        logger.info("the GCS at %s refuses connections: Ray's own lookup decides", gcs_address)
        return False
    try:
        from ray._raylet import GcsClient, NodeID
        from ray.core.generated.gcs_pb2 import GcsNodeInfo
        from ray.core.generated.gcs_service_pb2 import GetAllNodeInfoRequest

        client = GcsClient(address=gcs_address)
        selectors = [GetAllNodeInfoRequest.NodeSelector(node_id=NodeID.from_hex(node_id).binary())]
        alive = GcsNodeInfo.GcsNodeState.ALIVE
    except Exception as err:  # another Ray's layout: its own lookup only
        logger.info("cannot ask the GCS for node %s (%s: %s): Ray's own lookup decides",
                    node_id, type(err).__name__, err)
        return False
    deadline = time.monotonic() + wait_s
    while True:
        left = deadline - time.monotonic()
        try:
            if client.get_all_node_info(timeout=max(0.1, min(left, 1.0)),
                                        node_selectors=selectors, state_filter=alive):
                return True
        except Exception as err:  # a GCS that does not answer: Ray's lookup reports it
            logger.debug("asking the GCS for node %s: %s", node_id, err)
            return False
        if left <= 0:
            return False
        time.sleep(min(REGISTER_POLL_S, left))


class NodeView:
    """What Ray's `Node.start_api_server` sees of its node on the thread: the node for reading,
    its own record of processes and of what it assigns. Only the waiting thread hands them to
    the node, so the node's own thread never iterates a dict another thread changes."""

    def __init__(self, node: Any) -> None:
        object.__setattr__(self, "node", node)
        object.__setattr__(self, "all_processes", {})
        object.__setattr__(self, "assigned", {})

    def __getattr__(self, name: str) -> Any:
        assigned = self.assigned
        return assigned[name] if name in assigned else getattr(self.node, name)

    def __setattr__(self, name: str, value: Any) -> None:
        self.assigned[name] = value

    def hand_over(self) -> None:
        self.node.all_processes.update(self.all_processes)
        for name, value in self.assigned.items():
            setattr(self.node, name, value)


class ApiServerStart:
    """Ray's `Node.start_api_server` run on the API servers' thread; `join` waits for it, hands
    its processes to the node and raises what it raised, as the call would have.

    One thread for all, for the life of this process: Ray has Linux kill a process it starts
    when the thread that started it ends (`PR_SET_PDEATHSIG` follows the thread, not the
    process), so a thread per start would take its API server with it."""

    pool: ThreadPoolExecutor | None = None

    def __init__(self, start: Callable[..., Any], node: Any, kwargs: dict[str, Any]) -> None:
        self.view = NodeView(node)
        if ApiServerStart.pool is None:
            ApiServerStart.pool = ThreadPoolExecutor(1, thread_name_prefix="tenax-api-servers")
        self.future = ApiServerStart.pool.submit(start, self.view, **kwargs)

    def join(self) -> None:
        if not wait([self.future], API_SERVER_JOIN_S).done:
            logger.warning("Ray's API server has not started within %.0f s; the node is used "
                           "without waiting for it", API_SERVER_JOIN_S)
            return
        self.view.hand_over()
        self.future.result()  # raises what the start raised


def beside_raylet(original: Callable[..., Any]) -> Callable[..., Any]:
    """`Node.start_api_server` that returns at once and leaves the wait to the node lookup,
    unless the dashboard was asked for or resource isolation is on (Ray's order then)."""

    def start_api_server(node: Any, **kwargs: Any) -> Any:
        isolation = getattr(node, "resource_isolation_config", None)
        node_id = getattr(node, "node_id", None)
        if kwargs.get("include_dashboard") is True or not isinstance(node_id, str) or \
                isolation is None or isolation.is_enabled():
            return original(node, **kwargs)
        API_SERVERS[node_id] = ApiServerStart(original, node, kwargs)
        return None

    setattr(start_api_server, PROMPT_MARK, True)
    return start_api_server


def accepts(address: str, timeout_s: float) -> bool:
    """Whether `host:port` accepts a TCP connection within `timeout_s`."""
    host, _, port = address.rpartition(":")
    try:
        return tcp_probe(host.strip("[]"), int(port), max(timeout_s, 0.05)) == "open"
    except ValueError:  # not host:port
        return False


def tcp_probe(host: str, port: int, timeout_s: float) -> str:
    """One TCP connection to `host:port`: "open" when it was accepted within `timeout_s`,
    "refused" when the host refused it (nothing listens there: the process is gone), "silent"
    otherwise (a timeout or an unreachable host proves neither)."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "silent"
    return "open"
