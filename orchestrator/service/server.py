"""`tenax serve`: the JobService gRPC API over durable jobs, one controller thread per job.

Why a service: a pretraining job runs for weeks, longer than any terminal. The server owns the
jobs; `tenax submit/status/watch/scale/cancel` are thin clients. What makes it durable:
- every event is appended to the job store (orchestrator/service/store.py) before watchers
  see it, so the store is the single source of truth for WatchJob (history replay, then
  live events);
- on start, every job whose stored state is not terminal gets a new Controller with the same
  job id and spec; its ranks resume from the newest committed checkpoint under checkpoint.uri,
  so a killed service (even SIGKILL) loses at most the steps since that checkpoint;
- graceful shutdown (SIGTERM/SIGINT) stops accepting calls, stops the workers WITHOUT writing
  CANCELLED (jobs stay RUNNING in the store) and leaves committed checkpoints intact.

What each call checks and answers, and how errors map to gRPC codes: servicer.py.

Auth (`--token-file`, orchestrator/service/auth.py): every call needs
`authorization: Bearer <token>` metadata except `grpc.health.v1.Health` (probes cannot send
metadata); reflection is behind the token like the API. A token file line may name the
token's identity and its highest priority (`token name max_priority`). One state dir serves
one server at a time (an flock on `<state-dir>/lock`): two servers would resume the same jobs
twice.
"""
from __future__ import annotations

import logging
import threading
from concurrent import futures
from dataclasses import dataclass, field
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tenax.orchestrator.service.auth import TokenAuth, check_exposure
from tenax.orchestrator.service.jobs import JobManager, connect_ray
from tenax.orchestrator.service.lifecycle import (on_signals, print_ready, restore_signals,
                                                  shutdown_all)
from tenax.orchestrator.service.limits import Identity, ServiceLimits
from tenax.orchestrator.service.servicer import MAX_WORKERS, SERVICE_NAME, JobServicer
from tenax.orchestrator.service.storage_roots import StorageRoots
from tenax.orchestrator.service.store import JobStore
from tenax.proto import jobs_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

KEEPALIVE = [("grpc.keepalive_time_ms", 20_000), ("grpc.keepalive_timeout_ms", 10_000),
             ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
             ("grpc.keepalive_permit_without_calls", 1)]


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 50051
    tokens: list[str] | dict[str, Identity] | None = None  # dict: token -> who (--token-file)
    tls_cert: str | None = None
    tls_key: str | None = None


class JobServer:
    """gRPC server + health + reflection around a JobManager; `stop()` is graceful."""

    def __init__(self, manager: JobManager, options: ServerOptions) -> None:
        self.manager, self.options = manager, options
        auth = TokenAuth(options.tokens) if options.tokens else None
        interceptors = [auth] if auth else []
        self.server = grpc.server(futures.ThreadPoolExecutor(MAX_WORKERS, "tenax-rpc"),
                                  interceptors=interceptors, options=KEEPALIVE,
                                  maximum_concurrent_rpcs=MAX_WORKERS)
        pb_grpc.add_JobServiceServicer_to_server(JobServicer(manager, auth), self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        self.port = self._bind(options)

    def _bind(self, o: ServerOptions) -> int:
        host = f"[{o.host}]" if ":" in o.host else o.host
        address = f"{host}:{o.port}"
        try:
            if bool(o.tls_cert) != bool(o.tls_key):
                raise ValueError("--tls-cert and --tls-key go together")
            if o.tls_cert:
                with open(o.tls_cert, "rb") as c, open(o.tls_key, "rb") as k:
                    creds = grpc.ssl_server_credentials([(k.read(), c.read())])
                port = self.server.add_secure_port(address, creds)
            else:
                port = self.server.add_insecure_port(address)
        except (RuntimeError, OSError) as err:
            raise ValueError(f"cannot listen on {address}: {err}") from None
        if not port:
            raise ValueError(f"cannot listen on {address}")
        if o.tokens and not o.tls_cert and o.host not in ("127.0.0.1", "localhost", "::1"):
            logger.warning("tokens travel in clear text on %s: add --tls-cert/--tls-key", address)
        return port

    def start(self) -> None:
        self.server.start()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def stop(self, grace_s: float = 5.0) -> None:
        """Refuse new calls, end watch streams, detach jobs (they stay RUNNING in the store)."""
        self.health.enter_graceful_shutdown()
        self.manager.stopping.set()
        self.manager.wake_all()
        done = self.server.stop(grace_s)
        done.wait(grace_s + 5.0)
        self.manager.detach_all()


@dataclass
class ServeConfig:
    state_dir: str
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int | None = 9400  # None: no exporter; 0: any free port
    address: str | None = None  # Ray cluster; None: embedded local Ray on 127.0.0.1
    tokens: list[str] | dict[str, Identity] | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    gpus: int | None = None  # embedded Ray only: GPU slots (default: GPUs, else CPU count)
    cpus: int | None = None
    storage_roots: list[str] = field(default_factory=list)  # besides file:// under state_dir
    insecure: bool = False  # allow a non-loopback host without tokens
    metrics_host: str = "127.0.0.1"
    autoscale_max: tuple[int, int] | None = None  # (nodes, GPUs each) the cluster may grow to
    limits: ServiceLimits = field(default_factory=ServiceLimits)


def serve(config: ServeConfig, ready: Callable[[str], None] | None = None,
          stop: threading.Event | None = None) -> int:
    """Run the service until SIGTERM/SIGINT (or `stop` is set); returns the exit code.

    The signal handlers stay installed during shutdown, so a second signal cannot interrupt
    it half-way (which would leave controller threads calling into a Ray that is gone);
    shutdown is bounded (about grace + DETACH_TIMEOUT_S). SIGKILL is the hard stop.
    """
    from tenax.orchestrator.job.metrics import MetricsServer

    check_exposure(config.host, bool(config.tokens), config.insecure)
    store = JobStore(config.state_dir, exclusive=True)
    roots = StorageRoots.default(str(store.path.parent), config.storage_roots)
    stop = stop or threading.Event()
    metrics, server, previous, link = None, None, None, None
    try:
        link = connect_ray(config.address, config.gpus, config.cpus)
        previous = on_signals(stop)  # after ray.init, which installs a SIGTERM handler of its own
        if config.metrics_port is not None:
            metrics = MetricsServer(config.metrics_port, config.metrics_host)
        manager = JobManager(store, metrics.collector if metrics else None, roots,
                             config.autoscale_max, config.limits, link.forkserver)
        server = JobServer(manager, ServerOptions(config.host, config.port, config.tokens,
                                                  config.tls_cert, config.tls_key))
        resumed = manager.resume_unfinished()  # after binding: a busy port starts no job
        server.start()
        (ready or print_ready)(
            f"tenax serve: listening on {config.host}:{server.port}; metrics "
            f"{f'on http://{config.metrics_host}:{metrics.port}/metrics' if metrics else 'off'}; "
            f"state dir {store.path.parent}; resumed {len(resumed)} job(s)")
        while not stop.wait(1.0):
            pass
        logger.info("shutting down: jobs stay resumable from their committed checkpoints")
    finally:
        shutdown_all(server, metrics, store)
        if link is not None:
            link.close()  # after Ray: no job forks from it any more
        restore_signals(previous)
    return 0
