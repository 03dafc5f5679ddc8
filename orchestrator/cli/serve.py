"""`tenax serve`: the job service (gRPC) with its durable job store, in the foreground.

Separate from the client (orchestrator/cli/client.py) because it runs the server, not calls
to one: it starts or joins Ray, opens the state directory and serves until SIGTERM/SIGINT.
Exit codes: 0 stopped; 2 a busy state directory, an unreachable Ray, an unsafe bind or a bad
flag.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

EXIT_USAGE = 2


def default_state_dir() -> str:
    return os.environ.get("TENAX_STATE_DIR") or str(Path.home() / ".local/state/tenax")


def cmd_serve(args: argparse.Namespace) -> int:
    # Both must precede `import ray`. No auto-connect: a controller thread that calls Ray after
    # shutdown must fail, not start a new local cluster at exit.
    os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
    if not args.address:  # an embedded Ray stays on loopback
        from tenax.orchestrator.loopback import loopback_env

        loopback_env()
    from tenax.orchestrator.errors import StoreError
    from tenax.orchestrator.service.auth import read_identities
    from tenax.orchestrator.service.limits import ServiceLimits
    from tenax.orchestrator.service.server import ServeConfig, serve

    if not args.verbose:  # a server reports job transitions; the CLI default is WARNING
        logging.getLogger().setLevel(logging.INFO)
    try:
        config = ServeConfig(
            state_dir=args.state_dir, host=args.host, port=args.port,
            metrics_port=None if args.no_metrics else args.metrics_port, address=args.address,
            tokens=read_identities(args.token_file) if args.token_file else None,
            tls_cert=args.tls_cert, tls_key=args.tls_key, gpus=args.gpus, cpus=args.cpus,
            storage_roots=args.storage_roots, insecure=args.insecure,
            metrics_host=args.metrics_host, autoscale_max=args.autoscale_max,
            limits=ServiceLimits(args.max_queued_per_token, args.max_queued,
                                 args.keep_finished))
        return serve(config)
    except (StoreError, ConnectionError, ValueError) as err:  # state dir busy, Ray
        # unreachable, an unsafe bind or a bad --storage-root
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE


def register(sub: argparse._SubParsersAction) -> None:
    """Add `tenax serve` to the `tenax` parser (orchestrator/cli/main.py REGISTRARS)."""
    p = sub.add_parser("serve", help="run the job service (gRPC) with a durable job store")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0: any free port)")
    p.add_argument("--metrics-port", type=int, default=9400,
                   help="Prometheus port for every job's metrics (0: any free port)")
    p.add_argument("--no-metrics", action="store_true", help="no Prometheus exporter")
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="metrics listen address (default 127.0.0.1, whatever --host is)")
    p.add_argument("--storage-root", dest="storage_roots", action="append", default=[],
                   metavar="URI", help="a root jobs may use for checkpoint.uri/data.source "
                   "(repeatable; file:// under --state-dir is always allowed)")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --host without --token-file")
    p.add_argument("--state-dir", default=default_state_dir(),
                   help="job store directory (default: $TENAX_STATE_DIR or ~/.local/state/tenax)")
    p.add_argument("--address", help="Ray cluster address (default: start a local one)")
    p.add_argument("--token-file", help="require 'authorization: Bearer <token>'; lines "
                   "'token [name [max_priority]]'")
    _limit_flags(p)
    p.add_argument("--tls-cert", help="PEM certificate chain: serve TLS")
    p.add_argument("--tls-key", help="PEM private key for --tls-cert")
    p.add_argument("--gpus", type=int, help="embedded Ray: GPU slots (default: the GPUs, "
                   "else one per CPU core)")
    p.add_argument("--cpus", type=int, help="embedded Ray: CPUs (default: max(cores, slots))")
    p.add_argument("--autoscale-max", type=_nodes_by_gpus, metavar="NxG",
                   help="the autoscaler may grow the cluster to N nodes of G GPUs (KubeRay: the "
                   "GPU group's maxReplicas x GPUs per pod); jobs that fit that shape queue "
                   "instead of being refused")
    p.set_defaults(func=cmd_serve)


def _limit_flags(p: argparse.ArgumentParser) -> None:
    from tenax.orchestrator.service.limits import (DEFAULT_KEEP_FINISHED, DEFAULT_MAX_QUEUED,
                                                   DEFAULT_MAX_QUEUED_PER_TOKEN)

    p.add_argument("--max-queued-per-token", type=int, default=DEFAULT_MAX_QUEUED_PER_TOKEN,
                   metavar="N", help="queued jobs one token may have (default "
                   f"{DEFAULT_MAX_QUEUED_PER_TOKEN}); more are refused")
    p.add_argument("--max-queued", type=int, default=DEFAULT_MAX_QUEUED, metavar="N",
                   help=f"queued jobs in all (default {DEFAULT_MAX_QUEUED}); more are refused")
    p.add_argument("--keep-finished", type=int, default=DEFAULT_KEEP_FINISHED, metavar="N",
                   help="finished jobs whose record and history are kept (default "
                   f"{DEFAULT_KEEP_FINISHED}); older ones are forgotten")


def _nodes_by_gpus(text: str) -> tuple[int, int]:
    nodes, _, gpus = text.lower().partition("x")
    if not (nodes.isdigit() and gpus.isdigit() and int(nodes) > 0 and int(gpus) > 0):
        raise argparse.ArgumentTypeError(f"--autoscale-max: {text!r} is not NxG, e.g. 4x8")
    return int(nodes), int(gpus)
