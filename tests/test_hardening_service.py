"""The service's hardening and the SubmitJob fuzz: a real gRPC server on 127.0.0.1.

The server here runs a real JobManager, JobStore and JobServer, with storage roots that admit
only `file://` under its state dir. No test here ever has a job start (every submission is
refused before a controller exists), so no Ray cluster is needed.
"""
from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tenax.orchestrator.errors import StorageRootError
from tenax.orchestrator.service.auth import check_exposure
from tenax.orchestrator.service.storage_roots import StorageRoots, canonical_uri, overlapping
from tenax.orchestrator.spec import SpecError, load_spec
from tenax.proto import jobs_pb2 as pb
from tests.service_helpers import code_of, run_cli, stub

INVALID = grpc.StatusCode.INVALID_ARGUMENT
# the reproducer: 338 characters, x9 per nesting level once aliases expand
BOMB = ("model.moe=[&a [1,1,1,1,1,1,1,1,1], &b [*a,*a,*a,*a,*a,*a,*a,*a,*a], "
        "&c [*b,*b,*b,*b,*b,*b,*b,*b,*b], &d [*c,*c,*c,*c,*c,*c,*c,*c,*c], "
        "&e [*d,*d,*d,*d,*d,*d,*d,*d,*d], &f [*e,*e,*e,*e,*e,*e,*e,*e,*e], "
        "&g [*f,*f,*f,*f,*f,*f,*f,*f,*f], [*g,*g,*g,*g,*g,*g,*g,*g,*g]]")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from tenax.orchestrator.service.jobs import JobManager
    from tenax.orchestrator.service.server import JobServer, ServerOptions
    from tenax.orchestrator.service.store import JobStore

    state = tmp_path_factory.mktemp("state")
    store = JobStore(state, exclusive=True)
    manager = JobManager(store, None, StorageRoots.default(str(state)))
    srv = JobServer(manager, ServerOptions("127.0.0.1", 0))
    srv.start()
    try:
        yield {"stub": stub(srv.port), "store": store, "state": state}
    finally:
        srv.stop(1.0)
        store.close()


def submit_code(s: Any, spec: str, overrides: list[str]) -> tuple[grpc.StatusCode, str]:
    request = pb.SubmitJobRequest(spec_json=spec, overrides=overrides)
    return code_of(lambda: s.SubmitJob(request, timeout=30))


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- an override cannot exhaust the server --------------------------------------------
@pytest.mark.slow  # an in-process gRPC server
def test_alias_bomb_override_is_refused_with_a_short_message(server: dict[str, Any]) -> None:
    before = rss_bytes()
    code, details = submit_code(server["stub"], "{}", [BOMB])
    assert code == INVALID and "aliases" in details and len(details) < 400
    assert rss_bytes() - before < 50 << 20
    with pytest.raises(SpecError, match="aliases"):
        load_spec(overrides=[BOMB])  # tenax run / tenax.workers.launch parse the same way


def test_a_long_bad_value_is_echoed_as_a_short_prefix() -> None:
    with pytest.raises(SpecError) as err:
        load_spec(overrides=["train.lr=" + "9" * 3000])
    assert len(str(err.value)) < 300 and "chars" in str(err.value)
    with pytest.raises(SpecError) as err:
        load_spec(overrides=["model.dim=[" + ",".join(["1"] * 1300) + "]"])
    assert len(str(err.value)) < 300


# ---- numbers must fit their wire type ----------------------------------------------
@pytest.mark.slow  # an in-process gRPC server
@pytest.mark.parametrize("override", ["train.steps=9223372036854775808",
                                      "train.steps=100000000", "resources.nodes=2147483648",
                                      "resources.gpus_per_node=4294967296",
                                      "parallel.tp=2147483648",
                                      "train.seed=18446744073709551616", "train.lr=.inf"])
def test_numbers_beyond_their_wire_type_are_refused_and_nothing_stored(
        server: dict[str, Any], override: str) -> None:
    s = server["stub"]
    before = s.ListJobs(pb.ListJobsRequest(), timeout=30).jobs
    code, details = submit_code(s, "{}", [override])
    assert code == INVALID and override.split("=")[0] in details
    assert s.ListJobs(pb.ListJobsRequest(), timeout=30).jobs == before  # listing still works


@pytest.mark.slow  # an in-process gRPC server
def test_a_json_spec_with_a_huge_step_count_is_refused(server: dict[str, Any]) -> None:
    code, details = submit_code(server["stub"], json.dumps({"train": {"steps": 2**63}}), [])
    assert code == INVALID and "train.steps" in details


# ---- storage roots -------------------------------------------------------------------
def test_uris_are_normalised_before_the_root_check(tmp_path: Path) -> None:
    roots = StorageRoots([f"file://{tmp_path}/jobs", "s3://bucket/tenax"])
    assert str(roots.check(f"file://{tmp_path}/jobs/a//b/", "checkpoint.uri")) == \
        f"file://{tmp_path}/jobs/a/b"
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "link").symlink_to("/etc")
    for bad in (f"file://{tmp_path}/jobs/../../etc", f"file://{tmp_path}/jobs/link/x",
                "http://169.254.169.254/latest", "s3://bucket/tenax/../other", "s3a://bucket/x",
                "simplecache::file:///etc", f"file://{tmp_path}/jobsx", "relative/dir",
                "memory://bucket/tenax"):
        with pytest.raises(StorageRootError, match="checkpoint.uri"):
            roots.check(bad, "checkpoint.uri")
    assert str(roots.check("s3a://bucket/tenax/run1", "checkpoint.uri")) == \
        "s3://bucket/tenax/run1"


def test_the_servers_own_state_is_not_a_jobs_storage(tmp_path: Path) -> None:
    """The state dir is the default root, but its database and lock are the server's: a job
    naming them (or the directory holding them) would write over or read the job store."""
    state = tmp_path / "state"
    state.mkdir()
    roots = StorageRoots.default(str(state))
    assert str(roots.check(f"file://{state}/ckpt/run1", "checkpoint.uri")) == \
        f"file://{state.resolve()}/ckpt/run1"
    for field, bad in (("checkpoint.uri", f"file://{state}"),
                       ("checkpoint.uri", f"file://{state}/ckpt/../"),
                       ("data.tokenizer", f"file://{state}/tenax.db"),
                       ("logging.tensorboard_dir", f"file://{state}/tenax.db-wal"),
                       ("data.source", f"{state}/lock")):
        with pytest.raises(StorageRootError, match=f"{field}.*server's own state"):
            roots.check(bad, field)


def test_two_spellings_of_one_root_overlap(tmp_path: Path) -> None:
    a = f"file://{tmp_path}/ck"
    assert overlapping(a, f"{tmp_path}/x/../ck/") and overlapping(a, f"file://{tmp_path}//ck")
    assert overlapping(a, f"{a}/inner") and not overlapping(a, f"{a}2")
    assert canonical_uri("S3://b/p/./q").path == "b/p/q"


@pytest.mark.slow  # an in-process gRPC server
def test_the_server_refuses_uris_outside_its_roots(server: dict[str, Any],
                                                   tmp_path: Path) -> None:
    s, state = server["stub"], server["state"]
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-CONTENT\n" * 10)
    for field, uri in (("checkpoint.uri", f"file://{state}/../../etc"),
                       ("checkpoint.uri", "http://127.0.0.1:1/x"),
                       ("data.source", f"file://{secret}")):
        inside = f"checkpoint.uri=file://{state}/jobs/{field}"  # only `field` is outside
        code, details = submit_code(s, "{}", [inside, f"{field}={uri}"])
        assert code == INVALID and field in details and "TOP-SECRET" not in details
    assert s.ListJobs(pb.ListJobsRequest(), timeout=30).jobs == []


@pytest.mark.slow  # an in-process gRPC server
def test_files_that_validation_opens_are_root_checked_before_they_are_opened(
        server: dict[str, Any], tmp_path: Path) -> None:
    """A tokenizer (read for `vocab_size: auto`) or `init_from` outside the roots is refused
    before the server opens it: here a FIFO, which would block the server if it were opened."""
    s, state = server["stub"], server["state"]
    fifo = tmp_path / "tokenizer.json"
    os.mkfifo(fifo)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    os.mkfifo(hf_dir / "config.json")
    inside = f"checkpoint.uri=file://{state}/jobs/raw-check"
    for overrides, field in (([f"data.tokenizer=file://{fifo}", "model.vocab_size=auto"],
                              "data.tokenizer"),
                             ([f"model.init_from=file://{hf_dir}"], "model.init_from")):
        code, details = submit_code(s, "{}", [inside, *overrides])
        assert code == INVALID and field in details and "storage roots" in details, details
    assert s.ListJobs(pb.ListJobsRequest(), timeout=30).jobs == []


# ---- exposure ------------------------------------------------------------------------
def test_serving_beyond_loopback_needs_a_token_or_insecure(tmp_path: Path) -> None:
    for host in ("127.0.0.1", "::1", "localhost"):
        check_exposure(host, False, False)
    check_exposure("0.0.0.0", True, False)
    check_exposure("0.0.0.0", False, True)
    with pytest.raises(ValueError, match="--insecure"):
        check_exposure("0.0.0.0", False, False)
    done = run_cli(["serve", "--host", "0.0.0.0", "--port", "0", "--state-dir",
                    str(tmp_path / "state")], timeout_s=120)
    assert done.returncode == 2 and "--token-file" in done.stderr
    assert not (tmp_path / "state").exists() or not any((tmp_path / "state").iterdir())


def test_metrics_bind_to_loopback_by_default() -> None:
    from tenax.orchestrator.service.server import ServeConfig

    assert ServeConfig(state_dir="/x", host="0.0.0.0").metrics_host == "127.0.0.1"


# ---- the fuzz --------------------------------------------------------------------------------
KEYS = ["train.steps", "train.lr", "train.seed", "resources.nodes", "parallel.tp", "model.dim",
        "model.moe", "checkpoint.uri", "data.source", "name", "checkpoint.keep_last",
        "fault_tolerance.hang_timeout_s", "parallel.dp", "zz"]
YAMLISH = st.sampled_from(["&a [1]", "*a", "[&x 1, *x]", "{a: 1}", "!!python/object:os.system",
                           "1e999", "-0", "0x10", "2**63", "~", "[[[[[[", "'", "\"", ".nan",
                           "9" * 40, "[" * 200 + "]" * 200])
VALUES = st.one_of(st.integers(-2**70, 2**70).map(str), st.floats().map(str),
                   st.text(max_size=30), YAMLISH)
OVERRIDES = st.lists(st.builds(lambda k, v: f"{k}={v}", st.sampled_from(KEYS), VALUES),
                     max_size=4)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=10), lambda c: st.lists(c, max_size=3)
    | st.dictionaries(st.sampled_from(KEYS + ["steps", "uri"]), c, max_size=3), max_leaves=12)
SPECS = st.one_of(st.just("{}"), JSON_VALUES.map(json.dumps),
                  st.dictionaries(st.sampled_from(["train", "model", "checkpoint", "data"]),
                                  JSON_VALUES, max_size=3).map(json.dumps))
STATS: dict[str, Any] = {"n": 0, "worst_s": 0.0, "rss": []}


@pytest.mark.slow  # 1000 submissions
@pytest.mark.timeout(600)
def test_fuzzed_submissions_are_ok_or_invalid_and_rss_stays_bounded(server: dict[str, Any]) -> None:
    s = server["stub"]
    submit_code(s, "{}", [BOMB])  # warm-up: first-call allocations are not growth
    start = rss_bytes()

    @settings(max_examples=1000, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(SPECS, OVERRIDES)
    def one(spec: str, overrides: list[str]) -> None:
        t0 = time.monotonic()
        try:
            job = s.SubmitJob(pb.SubmitJobRequest(spec_json=spec, overrides=overrides),
                              timeout=30)
            code, details = grpc.StatusCode.OK, job.job_id
        except grpc.RpcError as err:
            code, details = err.code(), err.details() or ""
        STATS["worst_s"] = max(STATS["worst_s"], time.monotonic() - t0)
        STATS["n"] += 1
        assert code in (grpc.StatusCode.OK, INVALID), (code, details[:300], spec[:200], overrides)
        assert len(details) < 8000, details[:300]
        if STATS["n"] % 100 == 0:
            STATS["rss"].append(rss_bytes())

    one()
    growth = max(STATS["rss"] + [rss_bytes()]) - start
    print(f"fuzz: {STATS['n']} submissions, slowest reply {STATS['worst_s']:.3f}s, "
          f"RSS growth {growth / 2**20:.1f} MiB")
    assert STATS["n"] >= 1000 and growth < 200 << 20


def test_a_stored_job_with_an_out_of_range_number_cannot_break_listing(tmp_path: Path) -> None:
    """A row stored before submissions were checked (train.steps = 2**63) still lists."""
    from tenax.orchestrator.service.store import JobStore
    from tenax.orchestrator.service.wire import job_message

    store = JobStore(tmp_path)
    try:
        record = store.add_job("old-1", "old", json.dumps({"train": {"steps": 2**63}}), "file:///x")
        msg = job_message(record, {"world_size": 2**40}, 1)
        assert msg.total_steps == 2**63 - 1 and msg.world_size == 2**31 - 1
    finally:
        store.close()
