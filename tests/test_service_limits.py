"""`tenax serve`'s limits: job names, queue caps, per-token identities, paging, retention.

No test here starts a job: without a Ray connection the scheduler admits nothing, so every
accepted submission stays QUEUED, which is exactly what the queue caps count.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest

from tenax.orchestrator.spec import SpecError, load_spec
from tenax.proto import jobs_pb2 as pb
from tests.service_helpers import auth, code_of, stub

EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
TOKENS = "alice-token alice 10\nbob-token bob\n"


def spec(state: Path, name: str, **extra: Any) -> str:
    doc = {"name": name, "checkpoint": {"uri": f"file://{state}/ck/{name}-{time.monotonic_ns()}"},
           **extra}
    return json.dumps(doc)


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[dict[str, Any]]:
    from tenax.orchestrator.service.auth import read_identities
    from tenax.orchestrator.service.jobs import JobManager
    from tenax.orchestrator.service.limits import ServiceLimits
    from tenax.orchestrator.service.server import JobServer, ServerOptions
    from tenax.orchestrator.service.storage_roots import StorageRoots
    from tenax.orchestrator.service.store import JobStore

    (tmp_path / "tokens").write_text(TOKENS)
    identities = read_identities(str(tmp_path / "tokens"))
    store = JobStore(tmp_path / "state", exclusive=True)
    limits = ServiceLimits(max_queued_per_token=2, max_queued=3, keep_finished=5)
    manager = JobManager(store, None, StorageRoots.default(str(tmp_path / "state")),
                         limits=limits)
    srv = JobServer(manager, ServerOptions("127.0.0.1", 0, tokens=identities))
    srv.start()
    try:
        yield {"stub": stub(srv.port), "port": srv.port, "store": store,
               "state": tmp_path / "state", "manager": manager}
    finally:
        srv.stop(1.0)
        store.close()


def submit(server: dict[str, Any], token: str, name: str, **extra: Any) -> str:
    request = pb.SubmitJobRequest(spec_json=spec(server["state"], name, **extra))
    return server["stub"].SubmitJob(request, timeout=30, metadata=auth(token)).job_id


def submit_code(server: dict[str, Any], token: str, name: str,
                **extra: Any) -> tuple[grpc.StatusCode, str]:
    return code_of(lambda: submit(server, token, name, **extra))


# ---- job names ----------------------------------------------------------------------------
def test_a_job_name_is_at_most_63_characters() -> None:
    assert load_spec(overrides=["name=" + "a" * 63]).name == "a" * 63
    with pytest.raises(SpecError, match="name"):
        load_spec(overrides=["name=" + "a" * 64])


def test_a_long_name_is_refused_before_anything_is_stored(server: dict[str, Any]) -> None:
    code, details = submit_code(server, "alice-token", "x" * 300)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "name" in details
    assert server["store"].list_jobs() == []
    assert server["manager"].dispatcher.queue == {}


def test_the_longest_name_gives_a_job_that_can_be_fetched_and_cancelled(
        server: dict[str, Any]) -> None:
    s, md = server["stub"], auth("alice-token")
    job_id = submit(server, "alice-token", "n" * 63)
    assert s.GetJob(pb.GetJobRequest(job_id=job_id), timeout=10, metadata=md).job_id == job_id
    job = s.CancelJob(pb.CancelJobRequest(job_id=job_id), timeout=10, metadata=md)
    assert job.state == pb.JOB_STATE_CANCELLED


# ---- queue caps and identities ------------------------------------------------------------
def test_queued_jobs_are_capped_per_token_and_in_total(server: dict[str, Any]) -> None:
    submit(server, "alice-token", "a1")
    submit(server, "alice-token", "a2")
    code, details = submit_code(server, "alice-token", "a3")
    assert code == EXHAUSTED and "--max-queued-per-token" in details and "alice" in details
    submit(server, "bob-token", "b1")
    code, details = submit_code(server, "bob-token", "b2")
    assert code == EXHAUSTED and "--max-queued " in details
    assert len(server["store"].list_jobs()) == 3  # the refused ones left nothing behind


def test_a_priority_above_the_tokens_maximum_is_refused(server: dict[str, Any]) -> None:
    code, details = submit_code(server, "alice-token", "greedy", priority=1000)
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert "priority" in details and "10" in details and "alice" in details
    assert server["store"].list_jobs() == []
    job_id = submit(server, "alice-token", "fair", priority=10)
    assert server["store"].get_job(job_id).owner == "alice"
    submit(server, "bob-token", "unlimited", priority=1000)  # no maximum on bob's line


def test_token_file_lines_name_their_identity(tmp_path: Path) -> None:
    from tenax.orchestrator.service.auth import read_identities, read_tokens

    path = tmp_path / "tokens"
    path.write_text("t1 alice 5\n\nt2 bob\nt3\n")
    ids = read_identities(str(path))
    assert [(t, i.name, i.max_priority) for t, i in ids.items()] == [
        ("t1", "alice", 5), ("t2", "bob", None), ("t3", "token-4", None)]
    assert read_tokens(str(path)) == ["t1", "t2", "t3"]
    for bad in ("t1 alice high\n", "t1 a 1 extra\n", "t1 a\nt1 b\n"):
        path.write_text(bad)
        with pytest.raises(ValueError, match="line"):
            read_identities(str(path))


def test_the_overlap_check_does_not_normalise_every_job(server: dict[str, Any],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from tenax.orchestrator.service import storage_roots

    manager = server["manager"]
    manager.limits.max_queued_per_token = manager.limits.max_queued = 100
    for i in range(30):
        submit(server, "bob-token", f"j{i}")
    calls = []
    real = storage_roots.canonical_uri
    monkeypatch.setattr(storage_roots, "canonical_uri",
                        lambda *a, **k: calls.append(a) or real(*a, **k))
    submit(server, "bob-token", "one-more")
    assert len(calls) <= 4  # the new URI's checks, not one per queued job
    busy = json.loads(manager.store.list_jobs()[0].spec_json)["checkpoint"]["uri"]
    code, details = code_of(lambda: server["stub"].SubmitJob(pb.SubmitJobRequest(
        spec_json=json.dumps({"name": "inside", "checkpoint": {"uri": busy + "/sub"}})),
        timeout=30, metadata=auth("bob-token")))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "in use" in details


# ---- paging and retention -----------------------------------------------------------------
def fill(store: Any, count: int, pad: int = 0, state: str = "SUCCEEDED",
         prefix: str = "j") -> list[str]:
    """`count` stored jobs, newest last; `pad` characters of filler in each spec."""
    ids = []
    for i in range(count):
        name = f"{prefix}{i:03d}"
        doc = {"name": name, "train": {"steps": 10}, "filler": "x" * pad}
        record = store.add_job(f"{name}-0000", name, json.dumps(doc), f"file:///ck/{name}")
        store.append_event(record.job_id, {"event": "state", "state": state, "job": record.job_id})
        ids.append(record.job_id)
    return ids


def test_list_jobs_pages_through_every_job_once(server: dict[str, Any]) -> None:
    ids = fill(server["store"], 23)
    s, md = server["stub"], auth("bob-token")
    seen, token, pages = [], "", 0
    while True:
        reply = s.ListJobs(pb.ListJobsRequest(page_size=5, page_token=token), timeout=10,
                           metadata=md)
        assert len(reply.jobs) <= 5
        seen += [j.job_id for j in reply.jobs]
        pages, token = pages + 1, reply.next_page_token
        if not token:
            break
    assert seen == ids[::-1] and pages == 5
    code, details = code_of(lambda: s.ListJobs(pb.ListJobsRequest(page_token="garbage"),
                                               timeout=10, metadata=md))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "page_token" in details


def test_a_listing_larger_than_a_reply_comes_in_pages(server: dict[str, Any]) -> None:
    from tenax.orchestrator.cli.client import Client, list_all_jobs

    ids = fill(server["store"], 12, pad=600_000)  # 7 MB of specs: more than one 4 MiB reply
    reply = server["stub"].ListJobs(pb.ListJobsRequest(), timeout=10,
                                    metadata=auth("bob-token"))
    assert 0 < len(reply.jobs) < 12 and reply.next_page_token
    client = Client(f"127.0.0.1:{server['port']}", "bob-token", 30)
    try:
        assert [j.job_id for j in list_all_jobs(client)] == ids[::-1]
    finally:
        client.close()


def test_finished_jobs_beyond_keep_finished_are_forgotten(tmp_path: Path) -> None:
    from tenax.orchestrator.service.store import JobStore

    store = JobStore(tmp_path)
    done = fill(store, 6)
    running = fill(store, 1, state="RUNNING", prefix="r")
    assert store.prune_finished(keep=4) == done[:2]
    assert {j.job_id for j in store.list_jobs()} == set(done[2:] + running)
    assert store.events(done[0]) == [] and store.events(done[2]) != []
    assert store.prune_finished(keep=4) == []
    store.close()


def test_the_manager_applies_keep_finished(server: dict[str, Any]) -> None:
    done = fill(server["store"], 8)
    server["manager"].housekeeping(force=True)
    assert [j.job_id for j in server["store"].list_jobs()] == done[::-1][:5]


def test_a_stored_job_with_a_name_past_the_cap_is_failed_not_resumed(tmp_path: Path) -> None:
    from tenax.orchestrator.service.jobs import JobManager
    from tenax.orchestrator.service.store import JobStore

    store = JobStore(tmp_path)
    name = "y" * 300  # stored by a server that had no cap
    doc = {"name": name, "checkpoint": {"uri": f"file://{tmp_path}/ck"}}
    store.add_job(f"{name}-0000", name, json.dumps(doc), f"file://{tmp_path}/ck", "QUEUED")
    try:
        assert JobManager(store).resume_unfinished() == []
        record = store.get_job(f"{name}-0000")
        assert record.state == "FAILED" and "name" in record.cause
    finally:
        store.close()


@pytest.mark.slow  # hypothesis: ~2 s idle, more on a loaded machine
def test_the_claims_index_agrees_with_the_pairwise_overlap_check(tmp_path: Path) -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from tenax.orchestrator.service.limits import UriClaims
    from tenax.orchestrator.service.storage_roots import overlapping

    part = st.sampled_from(["a", "b", "ab", "a.b", "..", "."])
    path = st.lists(part, min_size=0, max_size=4).map("/".join)
    uri = st.one_of(path.map(lambda p: f"file://{tmp_path}/{p}"),
                    path.map(lambda p: f"s3://bucket/{p}"), path.map(lambda p: f"s3://{p}"),
                    st.sampled_from(["file://relative", "", "/", "file:///"]))

    @settings(max_examples=50, deadline=None)
    @given(held=st.lists(uri, max_size=6), new=uri)
    def check(held: list[str], new: str) -> None:
        claims = UriClaims()
        for i, u in enumerate(held):
            claims.claim(f"j{i}", u)
        want = sorted(f"j{i}" for i, u in enumerate(held) if overlapping(u, new))
        assert claims.holders(new, lambda job: True) == want

    check()


def test_one_token_cannot_hold_every_watch_stream() -> None:
    from tenax.orchestrator.service.limits import WatcherSlots

    slots = WatcherSlots(total=5, per_caller=3)
    assert [slots.acquire("alice") for _ in range(3)] == [None] * 3
    refused = slots.acquire("alice")
    assert refused is not None and "for alice" in refused and "3 per token" in refused
    assert slots.acquire("bob") is None and slots.acquire("carol") is None
    assert "at most 5" in (slots.acquire("dave") or "")
    slots.release("alice")
    assert slots.acquire("dave") is None  # a released slot serves anyone


def big_versions(root: Path, steps: list[int], ranks: int) -> None:
    """Committed versions whose manifests name `ranks` files each (~65 bytes a file), and one
    version left uncommitted; written the way a job's catalog lays them out."""
    from tenax.checkpoint.format.catalog import MANIFEST_NAME, version_name
    from tenax.checkpoint.format.manifest import FileEntry, Manifest

    for step in steps:
        where = root / version_name(step)
        where.mkdir(parents=True)
        files = {f"__{r}_0.distcp": FileEntry(1 << 20, "crc32c:0badf00d") for r in range(ranks)}
        manifest = Manifest(step=step, layout={"dp": ranks}, world_size=ranks, model_hash="h",
                            data_cursor=step, seed=0, lr_step=step, files=files)
        (where / MANIFEST_NAME).write_text(manifest.to_json())
    (root / version_name(steps[-1] + 1)).mkdir()  # a save that never committed


def test_a_manifest_larger_than_a_reply_is_listed_as_a_note_of_its_size(
        server: dict[str, Any]) -> None:
    """One version of a 60,000-file job: its manifest alone (~3.9 MB) would pass the reply's
    limit and gRPC's, so no listing could ever get past it."""
    root = server["state"] / "ck" / "huge"
    record = server["store"].add_job("huge-0000", "huge", json.dumps({"name": "huge"}),
                                     f"file://{root}")
    big_versions(root, [10], 60_000)
    reply = server["stub"].ListCheckpoints(pb.ListCheckpointsRequest(job_id=record.job_id),
                                           timeout=30, metadata=auth("bob-token"))
    assert reply.ByteSize() <= 3 << 20 and not reply.next_page_token
    version = reply.versions[0]
    assert (version.step, version.committed, version.world_size) == (10, True, 60_000)
    note = json.loads(version.manifest_json)
    assert note["step"] == 10 and note["omitted_bytes"] > 3 << 20
    assert "tenax ckpt inspect" in note["omitted"]


def test_checkpoint_listings_larger_than_a_reply_come_in_pages(server: dict[str, Any]) -> None:
    """30 versions of a 2,000-rank job's manifests are ~4.5 MB: one reply would pass gRPC's
    4 MiB limit (RESOURCE_EXHAUSTED at the client); pages hold every version once, in order."""
    root = server["state"] / "ck" / "big"
    record = server["store"].add_job("big-0000", "big", json.dumps({"name": "big"}),
                                     f"file://{root}")
    steps = list(range(10, 310, 10))
    big_versions(root, steps, 2000)
    s, md = server["stub"], auth("bob-token")
    listed, token, pages = [], "", 0
    while True:
        reply = s.ListCheckpoints(pb.ListCheckpointsRequest(job_id=record.job_id,
                                                            page_token=token),
                                  timeout=30, metadata=md)
        assert reply.ByteSize() <= 3 << 20 and reply.uri == f"file://{root}"
        listed += [(v.step, v.committed, v.world_size) for v in reply.versions]
        pages, token = pages + 1, reply.next_page_token
        if not token:
            break
    assert pages > 1
    assert listed == [(step, True, 2000) for step in steps] + [(steps[-1] + 1, False, 0)]
    first = s.ListCheckpoints(pb.ListCheckpointsRequest(job_id=record.job_id, page_size=7),
                              timeout=30, metadata=md)
    assert [v.step for v in first.versions] == steps[:7] and first.next_page_token
    assert json.loads(first.versions[0].manifest_json)["step"] == 10
    for bad, field in ((pb.ListCheckpointsRequest(job_id=record.job_id, page_size=-1),
                        "page_size"),
                       (pb.ListCheckpointsRequest(job_id=record.job_id, page_token="garbage"),
                        "page_token")):
        code, details = code_of(lambda: s.ListCheckpoints(bad, timeout=10, metadata=md))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and field in details, details
