"""`tenax submit|status|watch|scale|cancel`: the service's command-line client.

Why the client is thin: the server owns jobs, validation and state; the client reads a YAML or
JSON spec file, sends it as JSON (DESIGN.md pins JSON on the wire) with the `--set` overrides,
and prints answers: rich tables for people, `--json` for scripts. Every unary call has a
deadline (`--timeout`); `watch` holds one long stream and, when the server goes away
(UNAVAILABLE), reconnects with the last event's seq for up to `--reconnect-s` so nothing is
printed twice or missed, then fails with a clear message.

Exit codes: 0 fine; 1 an RPC failed (the message names the server, the gRPC status code and
its details) or, for `watch`, the job ended FAILED or CANCELLED; 2 a bad spec file or flag.
The server address comes from `--server`, else TENAX_SERVER, else 127.0.0.1:50051; the token
from `--token`, else TENAX_TOKEN; a CA bundle for TLS from `--tls-ca`, else TENAX_TLS_CA.
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

from tenax.orchestrator.errors import RpcFailed
from tenax.workers import human, layout_text

logger = logging.getLogger(__name__)

DEFAULT_SERVER = "127.0.0.1:50051"
RPC_TIMEOUT_S = 15.0
RECONNECT_S = 60.0
EXIT_RPC, EXIT_USAGE = 1, 2
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
CHANNEL_OPTIONS = [("grpc.keepalive_time_ms", 20_000), ("grpc.keepalive_timeout_ms", 10_000)]


class Client:
    """A channel and stub to one server, with the token and a deadline on every unary call."""

    def __init__(self, server: str, token: str | None, timeout_s: float,
                 tls_ca: str | None = None) -> None:
        import grpc

        from tenax.orchestrator.service.auth import bearer_metadata
        from tenax.proto import jobs_pb2_grpc

        self.server, self.timeout_s = server, timeout_s
        if tls_ca:
            creds = grpc.ssl_channel_credentials(read_ca(tls_ca))
            self.channel = grpc.secure_channel(server, creds, options=CHANNEL_OPTIONS)
        else:
            self.channel = grpc.insecure_channel(server, options=CHANNEL_OPTIONS)
        self.stub = jobs_pb2_grpc.JobServiceStub(self.channel)
        self.metadata = bearer_metadata(token)

    def call(self, method: str, request: Any) -> Any:
        import grpc

        try:
            return getattr(self.stub, method)(request, timeout=self.timeout_s,
                                              metadata=self.metadata)
        except grpc.RpcError as err:
            raise RpcFailed(rpc_error_text(self.server, method, err)) from None

    def close(self) -> None:
        self.channel.close()


def read_ca(path: str) -> bytes:
    """The CA bundle's bytes; ValueError (exit 2) naming the flag when it cannot be read."""
    try:
        return Path(path).read_bytes()
    except OSError as err:  # a directory, no permission, gone: a bad flag, not a traceback
        raise ValueError(f"--tls-ca: cannot read {path!r}: {err.strerror or err}") from None


# What to try next, for the failures a client (not the server) can fix.
HINTS = {"UNAVAILABLE": "is `tenax serve` running at that address (--server, $TENAX_SERVER)?",
         "UNAUTHENTICATED": "pass the server's token with --token or $TENAX_TOKEN",
         "DEADLINE_EXCEEDED": "no answer within --timeout; a busy server may need a longer one"}


def rpc_error_text(server: str, method: str, err: Any) -> str:
    """One line: server, method, status code name and details (multi-line details joined),
    and what to try where the client can fix it."""
    code = err.code().name if hasattr(err, "code") and err.code() else "UNKNOWN"
    details = "; ".join(line.strip() for line in (err.details() or "").splitlines() if line.strip())
    hint = f"; {HINTS[code]}" if code in HINTS else ""
    return f"{method} on {server} failed: {code}: {details}{hint}"


def _client(args: argparse.Namespace) -> Client:
    token = args.token or os.environ.get("TENAX_TOKEN") or None
    ca = args.tls_ca or os.environ.get("TENAX_TLS_CA") or None
    return Client(args.server or os.environ.get("TENAX_SERVER") or DEFAULT_SERVER, token,
                  args.timeout, ca)


def rpc_command(func: Callable[[argparse.Namespace, Client], int]) -> Callable[..., int]:
    @functools.wraps(func)
    def run(args: argparse.Namespace) -> int:
        client = _client(args)
        try:
            return func(args, client)
        except RpcFailed as err:
            print(f"error: {err}", file=sys.stderr)
            return EXIT_RPC
        except BrokenPipeError:  # `tenax watch ... | head`: the reader is gone, stop quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_RPC
        finally:
            client.close()
    return run


# ---- commands ------------------------------------------------------------------------------
def read_spec_json(path: str) -> str:
    """A YAML or JSON spec file as JSON text; SpecError (exit 2) if unreadable."""
    from tenax.orchestrator.spec import SpecError, parse_spec_text

    p = Path(path)
    if not p.is_file():
        raise SpecError(f"spec file {path!r} does not exist")
    return json.dumps(parse_spec_text(p.read_text(), path), default=str)


@rpc_command
def cmd_submit(args: argparse.Namespace, client: Client) -> int:
    from tenax.proto import jobs_pb2 as pb

    request = pb.SubmitJobRequest(spec_json=read_spec_json(args.spec), overrides=args.overrides)
    print(client.call("SubmitJob", request).job_id)
    return 0


@rpc_command
def cmd_status(args: argparse.Namespace, client: Client) -> int:
    from tenax.orchestrator.service.wire import job_dict
    from tenax.proto import jobs_pb2 as pb

    if args.job_id:
        job = job_dict(client.call("GetJob", pb.GetJobRequest(job_id=args.job_id)))
        if args.json:
            _print_json(job)
        else:
            _print_job(job)
        return 0
    jobs = [job_dict(j) for j in list_all_jobs(client, args.page_size)]
    if args.json:
        _print_json(jobs)
    else:
        _print_jobs(jobs)
    return 0


def list_all_jobs(client: Client, page_size: int = 0) -> list[Any]:
    """Every job, newest first, one ListJobs page per call (a server keeps each reply
    below gRPC's message limit, so a long history never fails the listing)."""
    from tenax.proto import jobs_pb2 as pb

    jobs: list[Any] = []
    token = ""
    while True:
        reply = client.call("ListJobs", pb.ListJobsRequest(page_size=page_size, page_token=token))
        jobs += reply.jobs
        if not reply.next_page_token or reply.next_page_token == token:
            return jobs
        token = reply.next_page_token


@rpc_command
def cmd_scale(args: argparse.Namespace, client: Client) -> int:
    from tenax.proto import jobs_pb2 as pb

    job = client.call("ScaleJob", pb.ScaleJobRequest(job_id=args.job_id, nodes=args.nodes))
    print(f"job {job.job_id}: target {job.target_nodes} node(s); it re-plans at the next step")
    return 0


@rpc_command
def cmd_cancel(args: argparse.Namespace, client: Client) -> int:
    from tenax.orchestrator.service.wire import state_name
    from tenax.proto import jobs_pb2 as pb

    job = client.call("CancelJob", pb.CancelJobRequest(job_id=args.job_id))
    print(f"job {job.job_id}: cancel requested (state {state_name(job.state)})")
    return 0


@rpc_command
def cmd_watch(args: argparse.Namespace, client: Client) -> int:
    """Stream events until the job ends; reconnect after the last seq if the server drops."""
    import grpc

    from tenax.orchestrator.service.wire import event_dict, state_name
    from tenax.proto import jobs_pb2 as pb

    # Fail fast on a wrong server or job id; only a stream that was up gets reconnected.
    client.call("GetJob", pb.GetJobRequest(job_id=args.job_id))
    after, final, lost_at = 0, None, None
    while True:
        try:
            stream = client.stub.WatchJob(pb.WatchJobRequest(job_id=args.job_id, after_seq=after),
                                          metadata=client.metadata)
            for message in stream:
                event, after, lost_at = event_dict(message), message.seq, None
                print(json.dumps(event) if args.json else human_line(event), flush=True)
                if message.kind == "state" and event.get("state") in TERMINAL:
                    final = event["state"]
            break
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.UNAVAILABLE:
                raise RpcFailed(rpc_error_text(client.server, "WatchJob", err)) from None
            lost_at = lost_at or time.monotonic()
            if time.monotonic() - lost_at > args.reconnect_s:
                text = rpc_error_text(client.server, "WatchJob", err)
                raise RpcFailed(f"{text}; gave up after {args.reconnect_s:.0f} s") from None
            print(f"connection to {client.server} lost ({err.code().name}); reconnecting "
                  f"after event {after}", file=sys.stderr, flush=True)
            time.sleep(min(5.0, 0.5 + (time.monotonic() - lost_at) / 4))
    if final is None:  # history started after the terminal event: ask
        final = state_name(client.call("GetJob", pb.GetJobRequest(job_id=args.job_id)).state)
    return 0 if final == "SUCCEEDED" else EXIT_RPC


# ---- output --------------------------------------------------------------------------------
def _print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2))


def _console() -> Any:
    from rich.console import Console

    # Piped output has no terminal width: rich would assume 80 columns and cut job ids.
    return Console() if sys.stdout.isatty() else Console(width=200)


def _loss(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) else "-"


def _print_jobs(jobs: list[dict[str, Any]]) -> None:
    from rich.table import Table

    table = Table(title=f"{len(jobs)} job(s)")
    for col in ("job", "state", "prio", "step", "loss", "layout", "gpus", "restarts", "updated"):
        table.add_column(col, justify="right" if col in ("prio", "step", "loss", "gpus",
                                                         "restarts") else "left")
    for j in jobs:
        state = j["state"] + (f" #{j['queue_position']}" if j["state"] == "QUEUED" else "")
        table.add_row(j["job_id"], state, str(j["priority"]), f"{j['step']}/{j['total_steps']}",
                      _loss(j["loss"]), layout_text(j["layout"]), str(j["gpus"]),
                      str(j["restarts"]),
                      datetime.fromtimestamp(j["updated_at"]).strftime("%Y-%m-%d %H:%M:%S"))
    _console().print(table)


def _print_job(job: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title=f"job {job['job_id']}", show_header=False)
    table.add_column("field")
    table.add_column("value")
    rows = {**job, "loss": _loss(job["loss"]), "layout": layout_text(job["layout"]),
            "step": f"{job['step']}/{job['total_steps']}", "goodput": f"{job['goodput']:.1%}",
            "created_at": datetime.fromtimestamp(job["created_at"]).isoformat(timespec="seconds"),
            "updated_at": datetime.fromtimestamp(job["updated_at"]).isoformat(timespec="seconds")}
    for key, value in rows.items():
        if key not in ("total_steps",) and value not in ("", None):
            table.add_row(key, str(value))
    _console().print(table)


def human_line(e: dict[str, Any]) -> str:
    """One line per event for `tenax watch`: the time it happened, then its sentence."""
    when = datetime.fromtimestamp(e.get("time", 0)).strftime("%H:%M:%S")
    return f"{when} {human(e)}"


# ---- parser ----------------------------------------------------------------------------------
def client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", help=f"HOST:PORT (default: $TENAX_SERVER or {DEFAULT_SERVER})")
    p.add_argument("--token", help="bearer token (default: $TENAX_TOKEN)")
    p.add_argument("--tls-ca", help="CA bundle to verify a TLS server (default: $TENAX_TLS_CA)")
    p.add_argument("--timeout", type=positive_seconds, default=RPC_TIMEOUT_S,
                   help="seconds per call")


def positive_seconds(text: str) -> float:
    """A deadline in seconds: 0, a negative or a non-finite one would fail (or never end)
    every call with a DEADLINE_EXCEEDED that does not say why."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number of seconds")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    """Add the client commands to the `tenax` parser (orchestrator/cli/main.py)."""
    p = sub.add_parser("submit", help="submit a job to a server; prints the job id")
    p.add_argument("spec", help="job spec YAML/JSON")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.set_defaults(func=cmd_submit)
    p = sub.add_parser("status", help="one job, or a table of every job")
    p.add_argument("job_id", nargs="?")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--page-size", type=int, default=0, metavar="N",
                   help="jobs per ListJobs call (default: the server's page)")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("watch", help="stream a job's events until it ends")
    p.add_argument("job_id")
    p.add_argument("--json", action="store_true", help="one JSON object per event")
    p.add_argument("--reconnect-s", type=float, default=RECONNECT_S,
                   help="keep reconnecting this long when the server is unreachable")
    p.set_defaults(func=cmd_watch)
    p = sub.add_parser("scale", help="set a job's target node count")
    p.add_argument("job_id")
    p.add_argument("--nodes", type=int, required=True)
    p.set_defaults(func=cmd_scale)
    p = sub.add_parser("cancel", help="cancel a job")
    p.add_argument("job_id")
    p.set_defaults(func=cmd_cancel)
    for name in ("submit", "status", "watch", "scale", "cancel"):
        client_flags(sub.choices[name])
