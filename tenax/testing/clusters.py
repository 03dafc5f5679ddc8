"""Real Ray on 127.0.0.1 for tests and benchmarks: an embedded single node, or a
`ray.cluster_utils.Cluster` of several raylets (the multi-node case without several hosts).

Everything stays on loopback: `loopback()` must run before the first `import ray` (see
orchestrator/loopback.py), and every function here calls it first; it also has each node
used as soon as its raylet registers. Each start gets a private
temp dir, so concurrent runs on one host never share Ray's sockets or logs.
"""
from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from typing import Any, Iterator

logger = logging.getLogger(__name__)


def loopback() -> None:
    """Loopback-only Ray and gloo. Every endpoint of these clusters is 127.0.0.1, so gloo is
    told to use `lo` whatever the caller's environment names (another interface would make
    the ranks' rendezvous fail)."""
    from tenax.orchestrator.loopback import loopback_env, prompt_node_start

    loopback_env()
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    prompt_node_start()  # after loopback_env: it imports Ray


def start_local_ray(gpus: int, cpus: int = 4) -> str:
    """An embedded single-node Ray with `gpus` fake GPU slots, started the way `tenax run`
    starts one; its temp dir. The caller shuts it down (`ray.shutdown()`)."""
    loopback()
    import ray

    tmp = tempfile.mkdtemp(prefix="tenax-ray-")
    ray.init(num_cpus=cpus, num_gpus=gpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             _temp_dir=tmp, log_to_driver=False, configure_logging=False)
    return tmp


@contextlib.contextmanager
def local_ray(gpus: int, cpus: int = 4) -> Iterator[dict[str, Any]]:
    """`start_local_ray` for a block; yields {"tmp", "init_s"} (how long `ray.init` took);
    always shut down."""
    t0 = time.monotonic()
    tmp = start_local_ray(gpus, cpus)
    import ray  # only now: start_local_ray set the loopback environment first

    info = {"tmp": tmp, "init_s": time.monotonic() - t0}
    logger.info("local Ray up in %.1f s (temp dir %s)", info["init_s"], tmp)
    try:
        yield info
    finally:
        ray.shutdown()


def start_cluster(gpu_nodes: int, gpus_per_node: int = 2, head_cpus: int = 1,
                  node_cpus: int = 2) -> tuple[Any, list[Any]]:
    """A GPU-less head plus `gpu_nodes` raylets, all on 127.0.0.1, with this driver connected;
    (cluster, nodes). The caller runs `ray.shutdown()` then `cluster.shutdown()`."""
    loopback()
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="tenax-cluster-")  # private to this run
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": head_cpus, "num_gpus": 0, "node_ip_address": "127.0.0.1"})
    try:
        nodes = [cluster.add_node(num_cpus=node_cpus, num_gpus=gpus_per_node,
                                  node_ip_address="127.0.0.1") for _ in range(gpu_nodes)]
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        cluster.wait_for_nodes()
    except BaseException:
        ray.shutdown()
        cluster.shutdown()
        raise
    return cluster, nodes


@contextlib.contextmanager
def ray_cluster(gpu_nodes: int, gpus_per_node: int = 2, head_cpus: int = 1,
                node_cpus: int = 2) -> Iterator[tuple[Any, list[Any]]]:
    """`start_cluster` for a block; yields (cluster, nodes); always shut down."""
    cluster, nodes = start_cluster(gpu_nodes, gpus_per_node, head_cpus, node_cpus)
    import ray  # only now: start_cluster set the loopback environment first

    try:
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()
