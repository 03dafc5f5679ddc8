"""Helpers for tests of `tenax serve`: server subprocesses, stubs, bounded waits on streams.

The jobs they submit are `tenax.testing.jobs.job_overrides` (the small job every real-Ray test
runs).
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import grpc

from tenax.testing import jobs
from tenax.proto import jobs_pb2 as pb
from tenax.proto import jobs_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[1]


def auth(token: str | None) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")] if token else []


def stub(port: int) -> pb_grpc.JobServiceStub:
    return pb_grpc.JobServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))


def submit(s: pb_grpc.JobServiceStub, md: list, overrides: list[str], spec: str = "{}") -> str:
    request = pb.SubmitJobRequest(spec_json=spec, overrides=overrides)
    return s.SubmitJob(request, timeout=15, metadata=md).job_id


def watch(s: pb_grpc.JobServiceStub, md: list, job_id: str, timeout_s: float,
          until: Callable[[dict[str, Any]], bool] | None = None,
          after_seq: int = 0) -> list[dict[str, Any]]:
    """Events (JSON + seq) until the stream ends, or until `until(event)` holds (then cancel).

    The stream's deadline bounds the wait: a job that never gets there fails the test with
    DEADLINE_EXCEEDED instead of hanging it."""
    call = s.WatchJob(pb.WatchJobRequest(job_id=job_id, after_seq=after_seq), timeout=timeout_s,
                      metadata=md)
    events = []
    for message in call:
        event = {**json.loads(message.json), "seq": message.seq, "kind": message.kind}
        events.append(event)
        if until is not None and until(event):
            call.cancel()
            break
    return events


def of(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e.get("event") == kind]


def states(events: list[dict[str, Any]]) -> list[str]:
    return [e["state"] for e in of(events, "state")]


def code_of(fn: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    """The status code and details of a call that must fail."""
    try:
        fn()
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    raise AssertionError("the call succeeded; an error status was expected")


def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


def children(pid: int) -> list[int]:
    """The live processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):  # not a process, or gone meanwhile
            continue
        if fields[0] != "Z" and int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


def pids_mentioning(text: str) -> list[int]:
    """Processes whose command line mentions `text` (a private temp dir of a test)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue  # gone meanwhile, or not ours to read
    return pids


def kill_mentioning(text: str) -> None:
    """SIGKILL every process whose command line mentions `text`: what a test started under its
    private temp dir and left running (only those)."""
    for pid in pids_mentioning(text):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class ServerProcess:
    """`tenax serve` in a subprocess; `port` once its ready line was printed."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None,
                 ready_timeout_s: float = 90) -> None:
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tenax.orchestrator.cli.main", "serve", "--port", "0", *args],
            cwd=REPO, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
            stderr=open(log, "ab"), text=True)
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in self.proc.stdout],
                         daemon=True).start()
        try:
            line = lines.get(timeout=ready_timeout_s)
        except queue.Empty:
            self.kill()
            raise AssertionError(f"tenax serve not ready in {ready_timeout_s} s: {self.tail()}")
        if "listening on" not in line:
            self.kill()
            raise AssertionError(f"unexpected first line {line!r}: {self.tail()}")
        self.port = int(line.split("listening on ")[1].split(";")[0].rsplit(":", 1)[1])

    def tail(self, n: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def terminate(self, timeout_s: float) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"tenax serve ignored SIGTERM for {timeout_s} s: {self.tail()}")


def run_cli(args: list[str], env: dict[str, str] | None = None,
            timeout_s: float = 120) -> subprocess.CompletedProcess:
    """`tenax ARGS` run from the repository root, as `ServerProcess` runs `tenax serve`."""
    return jobs.run_cli(args, env, timeout_s, cwd=REPO)


# ---- fuzzing (hypothesis) -----------------------------------------------------------------
def bad_specs() -> Any:
    """(spec_json, overrides) pairs that are invalid by construction."""
    from hypothesis import strategies as st

    sections = ["model", "parallel", "train", "data", "checkpoint", "resources",
                "fault_tolerance"]
    scalar = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(
        max_size=12)
    value = st.recursive(scalar, lambda c: st.lists(c, max_size=3) | st.dictionaries(
        st.text(max_size=6), c, max_size=3), max_leaves=6)

    def not_an_object(text: str) -> bool:
        try:
            return not isinstance(json.loads(text), dict)
        except ValueError:
            return True

    return st.one_of(
        st.tuples(st.text(max_size=80).filter(not_an_object), st.just([])),
        st.tuples(value.filter(lambda v: not isinstance(v, dict)).map(json.dumps), st.just([])),
        st.tuples(st.builds(lambda d, k, v: json.dumps({**d, f"zz{k}": v}), st.dictionaries(
            st.sampled_from(sections), value, max_size=2), st.text(max_size=6), value),
            st.just([])),
        st.tuples(st.builds(lambda k, v: json.dumps({k: v}), st.sampled_from(sections),
                            scalar.filter(lambda v: v is not None)), st.just([])),
        st.tuples(st.builds(lambda n: json.dumps({"train": {"steps": n}}),
                            st.integers(max_value=0)), st.just([])),
        st.tuples(st.just("{}"), st.lists(st.text(max_size=20).filter(lambda o: "=" not in o),
                                          min_size=1, max_size=3)),
        st.tuples(st.just("{}"), st.lists(st.builds(  # typed fields get YAML values: unclosed
            lambda k, v: f"{k}=[{v}", st.sampled_from(["train.steps", "parallel.tp", "model.moe",
                                                        "resources.nodes", "train.lr"]),
            st.text(max_size=10).filter(lambda v: "]" not in v)), min_size=1, max_size=2)),
        st.tuples(st.just("{}"), st.lists(st.builds(lambda k, v: f"zz{k}={v}", st.text(
            max_size=8), st.text(max_size=8)), min_size=1, max_size=2)))


def bad_rpcs() -> Any:
    """(kind, a, b) calls that must fail: unknown ids, bad enums, raw bytes, wrong tokens."""
    from hypothesis import strategies as st

    ids, ints = st.text(max_size=60), st.integers(-2**31, 2**31 - 1)
    return st.one_of(
        st.tuples(st.sampled_from(FUZZ_METHODS), ids, ints),
        st.tuples(st.just("WatchJob"), ids, ints),
        st.tuples(st.just("ListJobs"), st.just(""),
                  st.integers(max(pb.JobState.values()) + 1, 2**31 - 1) |
                  st.integers(-2**31, -1)),
        st.tuples(st.just("raw"), st.sampled_from(FUZZ_METHODS), st.binary(max_size=40)),
        st.tuples(st.just("token"), st.text(st.characters(min_codepoint=33, max_codepoint=126),
                                            max_size=30), st.just(0)))


FUZZ_METHODS = ["GetJob", "CancelJob", "ScaleJob", "ListCheckpoints"]


def fuzz_call(s: Any, channel: Any, md: list, token: str,
              case: tuple) -> tuple[grpc.StatusCode, str]:
    """Make one fuzz case's call; its status code and details."""
    kind, a, b = case
    if kind == "spec":
        return code_of(lambda: submit(s, md, b, a))
    if kind == "WatchJob":
        return code_of(lambda: watch(s, md, a, timeout_s=10, after_seq=b))
    if kind == "ListJobs":  # an enum value jobs.proto lacks, or a negative limit
        request = pb.ListJobsRequest(states=[b]) if b > 0 else pb.ListJobsRequest(limit=b)
        return code_of(lambda: s.ListJobs(request, timeout=10, metadata=md))
    if kind == "raw":  # bytes straight onto the wire, whatever they decode to
        call = channel.unary_unary(f"/tenax.v1.JobService/{a}")
        return code_of(lambda: call(b, timeout=10, metadata=md))
    if kind == "token":
        md = auth(a) if a != token else []
        return code_of(lambda: s.GetJob(pb.GetJobRequest(job_id="x"), timeout=10, metadata=md))
    request = {"GetJob": pb.GetJobRequest(job_id=a), "CancelJob": pb.CancelJobRequest(job_id=a),
               "ScaleJob": pb.ScaleJobRequest(job_id=a, nodes=b),
               "ListCheckpoints": pb.ListCheckpointsRequest(job_id=a)}[kind]
    return code_of(lambda: getattr(s, kind)(request, timeout=10, metadata=md))
