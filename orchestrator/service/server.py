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

Errors map to gRPC codes: a bad spec or argument -> INVALID_ARGUMENT (details name the field
path, e.g. `parallel.tp: 3 does not divide model.n_heads=8`), unknown job -> NOT_FOUND,
cancel/scale of a finished job or a checkpoint URI in use -> FAILED_PRECONDITION, too many
watchers or queued jobs -> RESOURCE_EXHAUSTED, a priority above the token's maximum ->
PERMISSION_DENIED, shutting down -> UNAVAILABLE. ListJobs answers in pages
(orchestrator/service/limits.py), so no listing outgrows one reply.

Auth (`--token-file`, orchestrator/service/auth.py): every call needs
`authorization: Bearer <token>` metadata except `grpc.health.v1.Health` (probes cannot send
metadata); reflection is behind the token like the API. A token file line may name the
token's identity and its highest priority (`token name max_priority`). One state dir serves
one server at a time (an flock on `<state-dir>/lock`): two servers would resume the same jobs
twice.

Each WatchJob stream holds a worker thread, so watchers are capped (MAX_WATCHERS) below the
pool size and unary calls always find a thread, and one token holds at most
MAX_WATCHERS_PER_TOKEN of them.
"""
from __future__ import annotations

import functools
import inspect
import logging
import threading
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tenax.checkpoint import CatalogError, StorageError
from tenax.orchestrator.errors import RpcAbort, StorageRootError, StoreError, SubmitError
from tenax.orchestrator.service.auth import TokenAuth, caller_of, check_exposure
from tenax.orchestrator.service.jobs import JobManager, connect_ray
from tenax.orchestrator.service.lifecycle import (on_signals, print_ready, restore_signals,
                                                  shutdown_all)
from tenax.orchestrator.service.limits import (MAX_JOB_ID, Identity, ServiceLimits, WatcherSlots,
                                               decode_page_token, encode_page_token, fill_page,
                                               page_size)
from tenax.orchestrator.service.storage_roots import StorageRoots
from tenax.orchestrator.service.store import JobRecord, JobStore
from tenax.orchestrator.service.wire import event_message, job_message, set_layout, state_name
from tenax.orchestrator.spec import SpecError
from tenax.proto import jobs_pb2 as pb
from tenax.proto import jobs_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["JobService"].full_name
MAX_WORKERS = 64
MAX_WATCHERS = 48  # leaves threads for unary calls: each stream holds one worker thread
MAX_WATCHERS_PER_TOKEN = 16  # with tokens: one identity cannot hold every stream
WATCH_BATCH = 500
WATCH_WAKE_S = 1.0
KEEPALIVE = [("grpc.keepalive_time_ms", 20_000), ("grpc.keepalive_timeout_ms", 10_000),
             ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
             ("grpc.keepalive_permit_without_calls", 1)]


_SUBMIT_CODES = {"invalid": grpc.StatusCode.INVALID_ARGUMENT,
                 "conflict": grpc.StatusCode.FAILED_PRECONDITION,
                 "exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
                 "denied": grpc.StatusCode.PERMISSION_DENIED,
                 "unavailable": grpc.StatusCode.UNAVAILABLE}


def _rpc(method: Callable[..., Any]) -> Callable[..., Any]:
    """Turn RpcAbort, SpecError and surprises into gRPC statuses (never a crash or a hang).

    Handlers raise RpcAbort and never call `context.abort` themselves (it raises a bare
    Exception that this wrapper could not tell from a bug)."""

    def fail(err: BaseException, context: grpc.ServicerContext) -> None:
        if isinstance(err, RpcAbort):
            context.abort(err.code, err.details)
        if isinstance(err, SubmitError):
            context.abort(_SUBMIT_CODES.get(err.kind, grpc.StatusCode.INVALID_ARGUMENT), str(err))
        if isinstance(err, SpecError):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        if isinstance(err, (StoreError, StorageError, CatalogError)):
            context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        logger.exception("%s failed", method.__name__)
        context.abort(grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}")

    if inspect.isgeneratorfunction(method):
        @functools.wraps(method)
        def stream(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                yield from method(self, request, context)
            except Exception as err:  # GeneratorExit (client went away) is not an Exception
                fail(err, context)
        return stream

    @functools.wraps(method)
    def unary(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except Exception as err:
            fail(err, context)
    return unary


def _job_id(value: str) -> str:
    if not value or len(value) > MAX_JOB_ID:
        raise RpcAbort(grpc.StatusCode.INVALID_ARGUMENT,
                       f"job_id: required (1..{MAX_JOB_ID} characters)")
    return value


class JobServicer(pb_grpc.JobServiceServicer):
    def __init__(self, manager: JobManager, auth: TokenAuth | None = None) -> None:
        self.manager, self.store, self.auth = manager, manager.store, auth
        # Without tokens every caller is one identity: the per-caller cap is the total then.
        self._watchers = WatcherSlots(MAX_WATCHERS, MAX_WATCHERS if auth is None
                                      else MAX_WATCHERS_PER_TOKEN)

    def _record(self, job_id: str) -> JobRecord:
        record = self.store.get_job(_job_id(job_id))
        if record is None:
            raise RpcAbort(grpc.StatusCode.NOT_FOUND, f"job {job_id!r} not found")
        return record

    def _message(self, job_id: str) -> pb.Job:
        record = self._record(job_id)
        status, target = self.manager.live_status(record)
        return job_message(record, status, target)

    def _active(self, job_id: str, verb: str) -> None:
        record = self._record(job_id)
        if verb == "cancel" and self.manager.queued(job_id):
            return  # a queued job can be cancelled (it holds nothing yet)
        if record.terminal or not self.manager.running(job_id):
            raise RpcAbort(grpc.StatusCode.FAILED_PRECONDITION,
                           f"cannot {verb} job {job_id}: it is {record.state}")

    @_rpc
    def SubmitJob(self, request: pb.SubmitJobRequest, context: grpc.ServicerContext) -> pb.Job:
        caller = caller_of(self.auth, context.invocation_metadata())
        job_id = self.manager.submit(request.spec_json, list(request.overrides), caller)
        return self._message(job_id)

    @_rpc
    def GetJob(self, request: pb.GetJobRequest, context: grpc.ServicerContext) -> pb.Job:
        return self._message(request.job_id)

    @_rpc
    def ListJobs(self, request: pb.ListJobsRequest,
                 context: grpc.ServicerContext) -> pb.ListJobsResponse:
        try:
            states = tuple(state_name(s) for s in request.states)
        except ValueError as err:
            raise RpcAbort(grpc.StatusCode.INVALID_ARGUMENT, f"states: {err}") from None
        for name in ("limit", "page_size"):
            if getattr(request, name) < 0:
                raise RpcAbort(grpc.StatusCode.INVALID_ARGUMENT,
                               f"{name}: {getattr(request, name)} is negative")
        try:
            after = decode_page_token(request.page_token)
        except ValueError as err:
            raise RpcAbort(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None
        size = page_size(request.page_size, request.limit)
        records = self.store.list_jobs(states, size + 1, after)
        jobs, more = fill_page(records[:size], self._listed, lambda m: m.ByteSize())
        reply = pb.ListJobsResponse(jobs=jobs)
        # a bare `limit` asks for that many jobs in all, so its last page has no token
        if (more or len(records) > size) and not (request.limit and not request.page_size and
                                                  len(jobs) == request.limit):
            last = records[len(jobs) - 1]
            reply.next_page_token = encode_page_token(last.created_at, last.job_id)
        return reply

    def _listed(self, record: JobRecord) -> pb.Job:
        status, target = self.manager.live_status(record)
        return job_message(record, status, target)

    @_rpc
    def CancelJob(self, request: pb.CancelJobRequest, context: grpc.ServicerContext) -> pb.Job:
        self._active(request.job_id, "cancel")
        self.manager.cancel(request.job_id)
        return self._message(request.job_id)

    @_rpc
    def ScaleJob(self, request: pb.ScaleJobRequest, context: grpc.ServicerContext) -> pb.Job:
        self._active(request.job_id, "scale")
        try:
            self.manager.scale(request.job_id, request.nodes)
        except SubmitError as err:  # more nodes than the cluster could ever hold
            raise RpcAbort(_SUBMIT_CODES[err.kind], str(err)) from None
        except ValueError as err:  # outside [min_nodes, max_nodes]; names the field
            raise RpcAbort(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None
        return self._message(request.job_id)

    @_rpc
    def ProfileJob(self, request: pb.ProfileJobRequest,
                   context: grpc.ServicerContext) -> pb.ProfileJobResponse:
        self._active(request.job_id, "profile")
        try:
            asked = self.manager.profile(request.job_id, request.steps)
        except ValueError as err:  # steps outside [1, 1000]; names the field
            raise RpcAbort(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None
        except RuntimeError as err:  # recovering or rescaling: no ranks to ask right now
            raise RpcAbort(grpc.StatusCode.FAILED_PRECONDITION, str(err)) from None
        return pb.ProfileJobResponse(job_id=request.job_id, **asked)

    @_rpc
    def WatchJob(self, request: pb.WatchJobRequest,
                 context: grpc.ServicerContext) -> Iterator[pb.JobEvent]:
        job_id = self._record(request.job_id).job_id
        who = caller_of(self.auth, context.invocation_metadata()).name
        refused = self._watchers.acquire(who)
        if refused is not None:
            raise RpcAbort(grpc.StatusCode.RESOURCE_EXHAUSTED, refused)
        try:
            yield from self._follow(job_id, max(0, request.after_seq), context)
        finally:
            self._watchers.release(who)

    def _follow(self, job_id: str, after: int,
                context: grpc.ServicerContext) -> Iterator[pb.JobEvent]:
        """History after `after`, then live events; ends after the job's terminal event."""
        while context.is_active():
            if self.manager.stopping.is_set():
                raise RpcAbort(grpc.StatusCode.UNAVAILABLE, "server is shutting down; "
                               f"reconnect and watch again with after_seq={after}")
            version = self.manager.version()
            record = self._record(job_id)  # read before the events: see the end condition
            batch = self.store.events(job_id, after, WATCH_BATCH)
            for event in batch:
                yield event_message(event)
                after = event.seq
            if len(batch) == WATCH_BATCH:
                continue
            if record.terminal:
                return  # the terminal state event was stored with the state: all was read
            self.manager.wait_for_change(version, WATCH_WAKE_S)

    @_rpc
    def ListCheckpoints(self, request: pb.ListCheckpointsRequest,
                        context: grpc.ServicerContext) -> pb.ListCheckpointsResponse:
        record = self._record(request.job_id)
        if self.manager.roots is not None:  # a job stored before the roots were narrowed
            try:
                self.manager.roots.check(record.checkpoint_uri, "checkpoint.uri")
            except StorageRootError as err:
                raise RpcAbort(grpc.StatusCode.FAILED_PRECONDITION, str(err)) from None
        versions = self.manager.checkpoints(record.checkpoint_uri)
        out = pb.ListCheckpointsResponse(uri=record.checkpoint_uri)
        for v in versions:
            item = out.versions.add(step=v["step"], committed=v["committed"],
                                    size_bytes=v["size_bytes"], world_size=v.get("world_size", 0),
                                    created_at=v.get("created_at", ""),
                                    manifest_json=v.get("manifest_json", ""))
            set_layout(item.layout, v.get("layout"))
        return out


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
