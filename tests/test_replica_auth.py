"""Replicas are taken only from the job's own agents, only as the stamp the receiver expects:
a forged, oversized, damaged or cut stream changes nothing on the receiver and leaves no file.
"""
from __future__ import annotations

import os
import random
import socket
import struct

import pytest

from tenax.checkpoint.errors import SnapshotError
from tenax.checkpoint.memory.snapshot_store import (SNAPSHOT_ENV, SnapshotDir, SnapshotStamp,
                                                    crc32c_of)
from tenax.workers.replica_auth import MAC_BYTES, NONCE_BYTES, client_handshake
from tenax.workers.replica_stream import MAGIC, recv_exactly, send_snapshot
from tenax.workers.snapshot_keeper import ReplicaTerms, SnapshotKeeper

pytestmark = pytest.mark.timeout(300)

JOB, SECRET, RANK, GEN, WORLD = "auth-job", "k" * 64, 1, 4, 2
COMMIT = {"layout": {"dp": 2}, "model_hash": "h", "data_cursor": 8, "seed": 0, "lr_step": 3,
          "extra": {"format": "tenax-raw-2"}}
SHARD = bytes((i * 7) % 251 for i in range(3 * 4096 + 123))
REASONS = {"handshake", "header", "mac", "token", "stamp", "size", "connection", "timeout",
           "refused"}


def _files(step: int) -> dict[str, bytes]:
    return {"__1_0.distcp": SHARD[step % 7:] + bytes([step % 256]), ".metadata": b"meta"}


def _stamp(step: int, data: dict[str, bytes], **changes) -> SnapshotStamp:
    fields = {"generation": GEN, "rank": RANK, "world": WORLD, "step": step,
              "files": {n: [len(d), crc32c_of([d])] for n, d in data.items()},
              "commit": COMMIT, **changes}
    return SnapshotStamp(**fields)


@pytest.fixture
def receiver(tmp_path, monkeypatch):
    """A receiving agent holding one real replica (step 11) of the peer's rank."""
    monkeypatch.setenv(SNAPSHOT_ENV, str(tmp_path / "shm"))
    keeper = SnapshotKeeper()
    keeper.configure(JOB, 0, None, GEN, ReplicaTerms(SECRET, WORLD, (RANK,), ("127.0.0.1",),
                                                     rank_bytes=64 << 10))
    local = SnapshotDir(str(tmp_path / "sender"))
    files = _files(11)
    local.write(_stamp(11, files), files)
    _, paths = local.paths(GEN, RANK, 11)
    assert send_snapshot(keeper.endpoint("127.0.0.1"), _stamp(11, files), paths, 10.0,
                         secret=SECRET.encode(), job_id=JOB) == 11
    yield keeper
    keeper.drop_job()


def _tree(root: str) -> dict[str, bytes]:
    """Every file under `root` with its bytes (what must not change)."""
    out = {}
    for base, _, names in os.walk(root):
        for name in names:
            path = os.path.join(base, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out


def _exchange(endpoint, secret: bytes | None, header: bytes = b"",
              body: bytes = b"", junk: bytes = b"", header_mac: bytes | None = None) -> bytes:
    """One stream: junk alone, or a handshake (a wrong proof when `secret` is None), a header
    with its MAC, a body; the receiver's whole answer."""
    with socket.create_connection((endpoint.host, endpoint.port), timeout=10) as sock:
        reply = b""
        if junk:
            sock.sendall(junk)
        elif secret is None:
            sock.sendall(MAGIC + os.urandom(NONCE_BYTES))
            hello = bytearray(2 + NONCE_BYTES + MAC_BYTES)
            recv_exactly(sock, memoryview(hello))
            sock.sendall(os.urandom(MAC_BYTES) + struct.pack(">I", 3) + b"{}}" + bytes(32))
        else:
            session = client_handshake(sock, secret, MAGIC, lambda v: recv_exactly(sock, v))
            signed = session.sign(header)  # what any holder of the secret could sign
            if header_mac is not None:
                signed = header + header_mac
            sock.sendall(struct.pack(">I", len(signed) - MAC_BYTES) + signed + body)
        sock.shutdown(socket.SHUT_WR)
        while chunk := sock.recv(65536):
            reply += chunk
        return reply


def _header(stamp: SnapshotStamp, token: str, job: str = JOB) -> bytes:
    import json

    return json.dumps({"token": token, "job": job, "stamp": stamp.to_json()}).encode()


def test_a_forged_stamp_from_a_token_holder_is_refused_and_nothing_changes(receiver):
    """The token alone (handed out over Ray) lets nobody in: without the job's secret the
    handshake fails; with it, a stamp of another generation, world or rank is refused."""
    endpoint, root = receiver.endpoint("127.0.0.1"), receiver.replica_dir
    before = _tree(root)
    forged = _stamp(10**9, _files(12), generation=10**9, world=1, rank=0)
    assert b"NO" in _exchange(endpoint, None)  # the token, no secret
    for stamp in (forged, _stamp(12, _files(12), generation=GEN + 1),
                  _stamp(12, _files(12), rank=0), _stamp(12, _files(12), world=3)):
        reply = _exchange(endpoint, SECRET.encode(), _header(stamp, endpoint.token))
        assert b"NOstamp" in reply, reply[-300:]
    assert _tree(root) == before
    assert {h["step"] for h in receiver.inventory()} == {11}
    assert receiver.failure_counts() == {"handshake": 1, "stamp": 4}


def _send(keeper: SnapshotKeeper, local: SnapshotDir, step: int, **changes) -> int:
    """What any holder of the job's secret can send: a stamp of its choosing, whole."""
    files = _files(step)
    local.write(_stamp(step, files, **changes), files)
    _, paths = local.paths(GEN, RANK, step)
    return send_snapshot(keeper.endpoint("127.0.0.1"), _stamp(step, files, **changes), paths,
                         10.0, secret=SECRET.encode(), job_id=JOB)


def _replica_steps(keeper: SnapshotKeeper) -> list[int]:
    return sorted(h["step"] for h in keeper.inventory() if h["kind"] == "replica")


def test_a_stamp_dated_in_the_future_does_not_cost_the_real_double_buffer(receiver, tmp_path):
    """Replicas are kept and rewritten by the receiver's own write order: a stamp claiming a
    `written_at` far ahead was kept forever, and every real replica after it rewrote the one
    before it, so the previous step a node lost mid-send needs was never there."""
    local = SnapshotDir(str(tmp_path / "forger"), keep=8)
    assert _send(receiver, local, 40, written_at=1e12) == 40  # within the job, secret held
    for step in (12, 13, 14):
        assert _send(receiver, local, step) == step
    assert _replica_steps(receiver) == [13, 14]  # the forged one was rewritten, not kept


def test_a_step_beyond_the_jobs_last_is_refused_before_any_buffer(tmp_path, monkeypatch):
    monkeypatch.setenv(SNAPSHOT_ENV, str(tmp_path / "shm"))
    keeper = SnapshotKeeper()
    keeper.configure(JOB, 0, None, GEN, ReplicaTerms(SECRET, WORLD, (RANK,), ("127.0.0.1",),
                                                     rank_bytes=64 << 10, max_step=100))
    local = SnapshotDir(str(tmp_path / "sender"), keep=8)
    try:
        assert _send(keeper, local, 100) == 100  # the last step itself is the job's
        before = _tree(keeper.replica_dir)
        with pytest.raises(SnapshotError, match="NOstamp|stamp: .*the job ends at step 100"):
            _send(keeper, local, 10**12)
        assert _tree(keeper.replica_dir) == before and _replica_steps(keeper) == [100]
        assert keeper.failure_counts() == {"stamp": 1}
    finally:
        keeper.drop_job()


def test_the_placement_hands_every_receiver_the_jobs_last_step():
    from tenax.orchestrator.placement.rank_handle import RankHandle
    from tenax.orchestrator.placement.recovery import MemoryStart
    from tenax.orchestrator.placement.worker_group import WorkerGroup

    group = WorkerGroup(JOB, gpus_per_node=1)
    group.ranks = [RankHandle(r, None, f"n{r}", f"10.0.0.{r}") for r in range(2)]
    terms = group.replica_terms(0, MemoryStart(JOB, 3, 1, secret=SECRET, rank_bytes=8,
                                               max_step=200))
    assert terms is not None and (terms.ranks, terms.peer_addresses) == ((1,), ("10.0.0.1",))
    assert (terms.max_step, terms.rank_bytes) == (200, 8)


def test_a_header_declaring_a_gibibyte_is_refused_before_any_byte_lands(receiver):
    endpoint, root = receiver.endpoint("127.0.0.1"), receiver.replica_dir
    before = _tree(root)
    huge = _stamp(12, {"__1_0.distcp": b""}, files={"__1_0.distcp": [1 << 30, 0]})
    reply = _exchange(endpoint, SECRET.encode(), _header(huge, endpoint.token))
    assert b"NOsize" in reply and b"exceeds the planned" in reply
    assert _tree(root) == before


def test_a_peer_without_the_secret_is_sent_nothing(tmp_path, monkeypatch):
    """Mutual: a receiver that cannot prove the job's secret gets no byte of a snapshot."""
    monkeypatch.setenv(SNAPSHOT_ENV, str(tmp_path / "shm"))
    impostor = SnapshotKeeper()
    impostor.configure(JOB, 0, None, GEN, ReplicaTerms("x" * 64, WORLD, (RANK,)))
    local, files = SnapshotDir(str(tmp_path / "sender")), _files(11)
    local.write(_stamp(11, files), files)
    _, paths = local.paths(GEN, RANK, 11)
    with pytest.raises(SnapshotError, match="did not prove the job's secret"):
        send_snapshot(impostor.endpoint("127.0.0.1"), _stamp(11, files), paths, 10.0,
                      secret=SECRET.encode(), job_id=JOB)
    assert impostor.inventory() == []
    impostor.drop_job()


def test_the_secret_is_never_in_a_repr():
    from tenax.orchestrator.placement.recovery import MemoryStart
    from tenax.workers import RankRun

    terms = ReplicaTerms(SECRET, WORLD, (RANK,))
    run = RankRun({}, {}, 0, 2, "127.0.0.1", 1, replicas=terms)
    start = MemoryStart(JOB, 1, 1, secret=SECRET)
    assert SECRET not in repr(run) and SECRET not in repr(start) and SECRET not in repr(terms)


def _fuzzed(rng: random.Random, endpoint) -> dict:
    """One random stream of one kind (junk, a bad proof, a bad header, a wrong stamp, a cut
    or damaged body) as arguments of `_exchange`."""
    files = _files(12)
    good = _header(_stamp(12, files), endpoint.token)
    body = files[".metadata"] + files["__1_0.distcp"]
    kind = rng.randrange(9)
    if kind == 0:
        return {"secret": None, "junk": rng.randbytes(rng.randrange(1, 200))}
    if kind == 1:
        return {"secret": None, "junk": MAGIC + rng.randbytes(rng.randrange(0, 80))}
    if kind == 2:
        return {"secret": None}
    if kind == 3:
        return {"secret": SECRET.encode(), "header": rng.randbytes(rng.randrange(1, 300))}
    if kind == 4:
        return {"secret": SECRET.encode(), "header": good, "header_mac": rng.randbytes(32)}
    if kind == 5:
        wrong = rng.choice([{"generation": rng.randrange(10**9)}, {"rank": 0},
                            {"world": rng.randrange(3, 99)}, {"files": {"../x": [4, 0]}},
                            {"files": {"__1_0.distcp": [rng.randrange(1 << 20, 1 << 40), 0]}}])
        return {"secret": SECRET.encode(), "header": _header(_stamp(12, files, **wrong),
                                                             endpoint.token)}
    if kind == 6:
        return {"secret": SECRET.encode(), "header": _header(_stamp(12, files), "f" * 32)}
    if kind == 7:  # the body cut anywhere, the MAC never sent
        return {"secret": SECRET.encode(), "header": good,
                "body": body[:rng.randrange(len(body) + 1)]}
    return {"secret": SECRET.encode(), "header": good, "body": body + rng.randbytes(MAC_BYTES)}


@pytest.mark.slow
def test_a_thousand_fuzzed_streams_are_all_refused_with_a_reason_leaving_no_file(receiver):
    endpoint, root = receiver.endpoint("127.0.0.1"), receiver.replica_dir
    before = _tree(root)
    rng = random.Random(20261203)
    for i in range(1000):
        args = _fuzzed(rng, endpoint)
        reply = _exchange(endpoint, **args)
        assert b"NO" in reply and b"OK" not in reply[-10:], (i, args, reply[-200:])
        counts = receiver.failure_counts()
        assert sum(counts.values()) == i + 1, (i, args, counts)
        assert set(counts) <= REASONS, counts
        assert _tree(root) == before, (i, args)
    assert {h["step"] for h in receiver.inventory()} == {11}
