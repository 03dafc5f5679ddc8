"""The JobService's calls (`JobServicer`): what each RPC checks, does and answers.

Errors map to gRPC codes: a bad spec or argument -> INVALID_ARGUMENT (details name the field
path, e.g. `parallel.tp: 3 does not divide model.n_heads=8`), unknown job -> NOT_FOUND,
cancel/scale of a finished job or a checkpoint URI in use -> FAILED_PRECONDITION, too many
watchers or queued jobs -> RESOURCE_EXHAUSTED, a priority above the token's maximum ->
PERMISSION_DENIED, shutting down -> UNAVAILABLE. ListJobs and ListCheckpoints answer in pages
(orchestrator/service/limits.py), so no listing outgrows one reply: a committed checkpoint
version carries its manifest, which names every rank's files (one too large for a reply alone
is replaced by a note of its size: service/wire.py).

Each WatchJob stream holds a worker thread, so watchers are capped (MAX_WATCHERS) below the
pool size (server.py) and unary calls always find a thread, and one token holds at most
MAX_WATCHERS_PER_TOKEN of them.
"""
from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Callable, Iterator

import grpc

from tenax.checkpoint import CatalogError, StorageError
from tenax.orchestrator.errors import RpcAbort, StorageRootError, StoreError, SubmitError
from tenax.orchestrator.service.auth import TokenAuth, caller_of
from tenax.orchestrator.service.jobs import JobManager
from tenax.orchestrator.service.limits import (MAX_JOB_ID, MAX_VERSION_BYTES, WatcherSlots,
                                               decode_page_token, decode_step_token,
                                               encode_page_token, encode_step_token, fill_page,
                                               page_size)
from tenax.orchestrator.service.store import JobRecord
from tenax.orchestrator.service.wire import (event_message, job_message, state_name,
                                             version_message)
from tenax.orchestrator.spec import SpecError
from tenax.proto import jobs_pb2 as pb
from tenax.proto import jobs_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["JobService"].full_name
MAX_WORKERS = 64  # the server's RPC threads (server.py)
MAX_WATCHERS = 48  # leaves threads for unary calls: each stream holds one worker thread
MAX_WATCHERS_PER_TOKEN = 16  # with tokens: one identity cannot hold every stream
WATCH_BATCH = 500
WATCH_WAKE_S = 1.0


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


def page_start(request: Any, counts: tuple[str, ...], decode: Callable[[str], Any]) -> Any:
    """Where a paged listing starts (`decode` of its page_token); INVALID_ARGUMENT naming a
    negative count or a token this server did not give."""
    for name in counts:
        if getattr(request, name) < 0:
            raise RpcAbort(grpc.StatusCode.INVALID_ARGUMENT,
                           f"{name}: {getattr(request, name)} is negative")
    try:
        return decode(request.page_token)
    except ValueError as err:
        raise RpcAbort(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None


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
        after = page_start(request, ("limit", "page_size"), decode_page_token)
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
        after = page_start(request, ("page_size",), decode_step_token)
        # a page: each committed version carries its manifest, which lists every rank's files
        versions, more = self.manager.checkpoints(record.checkpoint_uri, after,
                                                  page_size(request.page_size, 0))
        items, cut = fill_page(versions, lambda v: version_message(v, MAX_VERSION_BYTES),
                               lambda m: m.ByteSize())
        out = pb.ListCheckpointsResponse(uri=record.checkpoint_uri, versions=items)
        if more or cut:
            out.next_page_token = encode_step_token(items[-1].step)
        return out
