"""The replica port cannot be held shut: slow or idle connections, other addresses and odd
tokens are refused with a reason (counted as tenax_replica_failures_total), and a real
replica send gets through meanwhile."""
from __future__ import annotations

import json
import socket
import struct
import time

import pytest

from tenax.checkpoint.memory.snapshot_store import (SNAPSHOT_ENV, SnapshotDir, SnapshotStamp,
                                                    crc32c_of)
from tenax.workers import replica_stream
from tenax.workers.replica_auth import MAC_BYTES, client_handshake
from tenax.workers.replica_stream import MAGIC, recv_exactly, send_snapshot
from tenax.workers.snapshot_keeper import ReplicaTerms, SnapshotKeeper

pytestmark = pytest.mark.timeout(120)

JOB, SECRET, RANK, GEN, WORLD = "port-job", "p" * 64, 1, 2, 2
COMMIT = {"layout": {"dp": 2}, "model_hash": "h", "data_cursor": 8, "seed": 0, "lr_step": 3,
          "extra": {"format": "tenax-raw-2"}}


def _wait(condition, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s:.0f} s")
        time.sleep(0.01)


@pytest.fixture
def pair(tmp_path, monkeypatch):
    """A receiving agent that takes rank 1's replica from 127.0.0.1, and a sender."""
    monkeypatch.setenv(SNAPSHOT_ENV, str(tmp_path / "shm"))
    keeper = SnapshotKeeper()
    keeper.configure(JOB, 0, None, GEN, ReplicaTerms(SECRET, WORLD, (RANK,), ("127.0.0.1",)))
    local = SnapshotDir(str(tmp_path / "sender"))

    def send(step: int) -> int:
        files = {"__1_0.distcp": bytes(range(256)) * 64, ".metadata": b"m"}
        stamp = SnapshotStamp(GEN, RANK, WORLD, step,
                              {n: [len(d), crc32c_of([d])] for n, d in files.items()}, COMMIT)
        local.write(stamp, files)
        _, paths = local.paths(GEN, RANK, step)
        return send_snapshot(keeper.endpoint("127.0.0.1"), stamp, paths, 10.0,
                             secret=SECRET.encode(), job_id=JOB)

    yield keeper, send
    keeper.drop_job()


def _reply(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(4096):
        out += chunk
    return out


def test_trickling_connections_do_not_stop_a_real_replica(pair):
    """32 connections that each sent one byte and wait (as if trickling a byte every 10 s)
    would have held every accept slot for IO_TIMEOUT_S; an address's unauthenticated
    connections are capped and its newest closes its oldest, so the real send gets in."""
    receiver, send = pair
    endpoint = receiver.endpoint("127.0.0.1")
    tricklers = []
    for _ in range(replica_stream.MAX_CONNECTIONS):
        sock = socket.create_connection((endpoint.host, endpoint.port), timeout=10)
        sock.sendall(MAGIC[:1])
        tricklers.append(sock)
    _wait(lambda: receiver.failure_counts().get("evicted", 0)
          >= replica_stream.MAX_CONNECTIONS - replica_stream.MAX_PENDING_PER_ADDRESS,
          "the oldest tricklers closed")
    assert send(11) == 11  # while the newest tricklers still wait
    assert {h["step"] for h in receiver.inventory()} == {11}
    for sock in tricklers:
        sock.close()


def test_a_connection_that_does_not_finish_its_header_in_time_is_closed(pair, monkeypatch):
    monkeypatch.setattr(replica_stream, "HEADER_TIMEOUT_S", 0.5)
    receiver, _ = pair
    endpoint = receiver.endpoint("127.0.0.1")
    with socket.create_connection((endpoint.host, endpoint.port), timeout=30) as sock:
        sock.sendall(MAGIC[:2])  # and nothing more
        reply = _reply(sock)  # the receiver ends it; no fixed wait here
    assert reply.startswith(b"NOtimeout")
    assert receiver.failure_counts() == {"timeout": 1}


def test_a_body_slower_than_the_minimum_rate_is_cut(pair, monkeypatch):
    monkeypatch.setattr(replica_stream, "BODY_GRACE_S", 0.3)
    monkeypatch.setattr(replica_stream, "MIN_RATE", 1 << 30)
    receiver, _ = pair
    endpoint = receiver.endpoint("127.0.0.1")
    stamp = SnapshotStamp(GEN, RANK, WORLD, 12, {"__1_0.distcp": [4096, 0]}, COMMIT)
    with socket.create_connection((endpoint.host, endpoint.port), timeout=30) as sock:
        session = client_handshake(sock, SECRET.encode(), MAGIC, lambda v: recv_exactly(sock, v))
        header = session.header(endpoint.token, JOB, stamp.to_json())
        sock.sendall(struct.pack(">I", len(header) - MAC_BYTES) + header + b"x")  # one byte
        reply = _reply(sock)
    assert reply.startswith(b"GONOtimeout"), reply[:100]
    assert receiver.inventory() == [] and receiver.failure_counts() == {"timeout": 1}


def test_only_the_peer_nodes_address_is_accepted(pair):
    receiver, send = pair
    endpoint = receiver.endpoint("0.0.0.0")  # listening on every loopback address
    with socket.create_connection((endpoint.host, endpoint.port), timeout=10,
                                  source_address=("127.0.0.2", 0)) as sock:
        assert _reply(sock) == b""  # closed without a word
    assert receiver.failure_counts() == {"address": 1}
    receiver.drop_job()


def test_a_non_ascii_token_is_refused_with_a_reason_not_a_traceback(pair):
    receiver, _ = pair
    endpoint = receiver.endpoint("127.0.0.1")
    for token in ("ţōķēñ", "\ud800", 7):
        doc = json.dumps({"token": token, "job": JOB, "stamp": "{}"}).encode()
        with socket.create_connection((endpoint.host, endpoint.port), timeout=10) as sock:
            session = client_handshake(sock, SECRET.encode(), MAGIC,
                                       lambda v: recv_exactly(sock, v))
            signed = session.sign(doc)
            sock.sendall(struct.pack(">I", len(doc)) + signed)
            assert _reply(sock).startswith(b"NOtoken: SnapshotError: replica refused: wrong")
    assert receiver.failure_counts() == {"token": 3}


def test_replica_failures_are_exported_by_reason_and_never_go_down():
    from tenax.orchestrator.job.metrics import MetricsServer
    from tests.test_metrics import Clock, handle, scrape, start_job, values

    server, clock = MetricsServer(0, host="127.0.0.1"), Clock()
    try:
        ranks = [handle(0, "n0", clock.now), handle(1, "n1", clock.now)]
        controller, _, _ = start_job(server, "job-r", clock, ranks)
        ranks[0].status["replica_failures"] = {"stamp": 2, "timeout": 1}
        ranks[1].status["replica_failures"] = {"stamp": 1}
        for observe in controller.observers:
            observe(controller, [])
        _, samples = scrape(server)
        assert values(samples, "tenax_replica_failures_total", reason="stamp") == [3.0]
        assert values(samples, "tenax_replica_failures_total", reason="timeout") == [1.0]
        ranks[0].status["replica_failures"] = {}  # its agent was replaced: counts from 0
        for observe in controller.observers:
            observe(controller, [])
        _, samples = scrape(server)
        assert values(samples, "tenax_replica_failures_total", reason="stamp") == [3.0]
    finally:
        server.close()
