"""Replicas streamed agent to agent: whole and checksummed, or not published at all."""
from __future__ import annotations

import os
import socket
import struct
import time

import pytest

from tenax.checkpoint.errors import SnapshotError
from tenax.checkpoint.memory.snapshot_store import (SNAPSHOT_ENV, SnapshotDir, SnapshotStamp,
                                                    crc32c_of)
from tenax.workers.replica_auth import MAC_BYTES, client_handshake
from tenax.workers.replica_stream import (CRC_STRETCH, MAGIC, Endpoint, recv_checksummed,
                                          recv_exactly, send_snapshot)
from tenax.workers.snapshot_keeper import ReplicaTerms, SnapshotKeeper

pytestmark = pytest.mark.timeout(120)

COMMIT = {"layout": {"dp": 2}, "model_hash": "h", "data_cursor": 8, "seed": 0, "lr_step": 3,
          "extra": {"format": "tenax-raw-2"}}
RANK, GEN = 1, 4
SECRET = "s" * 64
TERMS = ReplicaTerms(SECRET, 2, (RANK,), ("127.0.0.1",))


def _files(step: int) -> dict[str, bytes]:
    """A shard that is not a whole number of pages, metadata, and an empty file."""
    shard = bytes((step * 7 + i) % 251 for i in range(3 * 4096 + 123))
    return {"__1_0.distcp": shard, ".metadata": f"meta {step}".encode(), "empty": b""}


def _stamp(step: int, files: dict[str, bytes]) -> SnapshotStamp:
    sums = {n: [len(d), crc32c_of([d])] for n, d in files.items()}
    return SnapshotStamp(GEN, RANK, 2, step, sums, COMMIT)


@pytest.fixture
def pair(tmp_path, monkeypatch):
    """A sender's local snapshot directory and a receiving agent's keeper with its endpoint."""
    monkeypatch.setenv(SNAPSHOT_ENV, str(tmp_path / "shm"))
    receiver = SnapshotKeeper()
    receiver.configure("stream-job", 0, None, GEN, TERMS)
    local = SnapshotDir(str(tmp_path / "sender"))

    def send(step: int, files: dict[str, bytes] | None = None,
             stamp: SnapshotStamp | None = None, endpoint: Endpoint | None = None) -> int:
        files = files or _files(step)
        stamp = stamp or _stamp(step, files)
        local.write(stamp, files)
        _, paths = local.paths(GEN, RANK, step)
        return send_snapshot(endpoint or receiver.endpoint("127.0.0.1"), stamp, paths, 10.0,
                             secret=SECRET.encode(), job_id="stream-job")

    yield receiver, send
    receiver.drop_job()


def _wait(condition, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s:.0f} s")
        time.sleep(0.02)


def _held(keeper: SnapshotKeeper) -> set[int]:
    return {h["step"] for h in keeper.inventory() if h["kind"] == "replica"}


def test_streamed_replicas_arrive_whole_and_rewrite_the_oldest_buffer(pair):
    receiver, send = pair
    for step in (11, 12, 13):  # the third is written over the first one's pages
        assert send(step) == step
    assert _held(receiver) == {12, 13}
    for step in (12, 13):
        stamp_json, files = receiver.read("replica", GEN, RANK, step)  # checksums verified
        assert SnapshotStamp.from_json(stamp_json).commit == COMMIT
        assert {n: bytes(v) for n, v in files.items()} == _files(step)


def test_both_ends_send_small_writes_at_once(pair, monkeypatch):
    """The handshake and the MAC trailer are small writes after others: under Nagle each one
    waited for a delayed ACK (~40 ms), longer than a step, and every other snapshot was
    skipped. Both ends turn it off."""
    from tenax.workers.replica_stream import ReplicaReceiver

    receiver, _ = pair
    seen: dict[str, int] = {}
    serve = ReplicaReceiver._serve

    def serve_noting(self, conn):
        seen["receiver"] = conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        return serve(self, conn)

    monkeypatch.setattr(ReplicaReceiver, "_serve", serve_noting)
    files = _files(21)
    stamp = _stamp(21, files)
    local = SnapshotDir(str(receiver.job_root) + "-sender")
    local.write(stamp, files)
    _, paths = local.paths(GEN, RANK, 21)
    on_connect = lambda sock: seen.update(  # noqa: E731
        sender=sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
    assert send_snapshot(receiver.endpoint("127.0.0.1"), stamp, paths, 10.0, on_connect,
                         secret=SECRET.encode(), job_id="stream-job") == 21
    assert seen["sender"] and seen["receiver"], seen


def _mapped_under(root: str) -> list[str]:
    """This process's mappings of files under `root` (/proc/self/maps: Linux)."""
    with open("/proc/self/maps") as f:
        return [line for line in f if root in line]


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux only")
def test_replica_buffers_stay_mapped_between_replicas_and_are_unmapped_when_the_job_ends(pair):
    receiver, send = pair
    for step in (11, 12, 13, 14):
        send(step)
    # two buffers of one file each with bytes (the empty file is never mapped)
    mapped = _mapped_under(receiver.replica_dir)
    assert len(mapped) == 4 and not any("(deleted)" in line for line in mapped), mapped
    assert {n: bytes(v) for n, v in receiver.read("replica", GEN, RANK, 14)[1].items()} == \
        _files(14)
    root = receiver.job_root
    receiver.drop_job()  # the files go: no mapping may keep their pages
    assert _mapped_under(root) == []


def test_a_sender_without_the_token_lands_nothing(pair):
    receiver, send = pair
    real = receiver.endpoint("127.0.0.1")
    with pytest.raises(SnapshotError, match="wrong token"):
        send(11, endpoint=Endpoint(real.host, real.port, "0" * 32))
    assert _held(receiver) == set()


def test_bytes_damaged_in_transit_are_refused_and_the_last_replica_stays(pair):
    receiver, send = pair
    send(11)
    files = _files(12)
    stamp = _stamp(12, {**files, "__1_0.distcp": b"\0" + files["__1_0.distcp"][1:]})
    with pytest.raises(SnapshotError, match="damaged"):
        send(12, files, stamp)
    assert _held(receiver) == {11}
    assert send(12) == 12  # the refused buffer serves again
    assert _held(receiver) == {11, 12}


@pytest.mark.parametrize("pieces", [[1], [7, 4096, 100_000], [CRC_STRETCH - 1, 2, 300_001],
                                    [3 * CRC_STRETCH + 5]], ids=["byte", "small", "odd", "whole"])
def test_bytes_are_checksummed_as_they_arrive_whatever_the_pieces(pieces):
    """However the sender cuts the stream, the running checksum is the whole file's."""
    import threading

    data = bytes((i * 31 + 7) % 251 for i in range(sum(pieces)))
    view = memoryview(bytearray(len(data)))
    ours, theirs = socket.socketpair()

    def send() -> None:
        offset = 0
        for size in pieces:
            theirs.sendall(data[offset:offset + size])
            offset += size

    sender = threading.Thread(target=send)
    sender.start()
    with ours, theirs:
        assert recv_checksummed(ours, view) == crc32c_of([data])
        sender.join()
    assert bytes(view) == data


def test_a_large_file_damaged_past_its_first_stretch_is_refused(pair):
    """The checksum taken while bytes arrive covers every stretch, the last one included."""
    receiver, send = pair
    big = bytes((i * 13) % 253 for i in range(2 * CRC_STRETCH + 777))
    files = {**_files(11), "__1_0.distcp": big}
    assert send(11, files) == 11
    for where in (CRC_STRETCH + 5, len(big) - 1):  # a later stretch; the very last byte
        damaged = big[:where] + bytes([big[where] ^ 1]) + big[where + 1:]
        with pytest.raises(SnapshotError, match="damaged"):
            send(12, {**files, "__1_0.distcp": damaged}, _stamp(12, files))
        assert _held(receiver) == {11}
    stamp_json, held = receiver.read("replica", GEN, RANK, 11)
    assert bytes(held["__1_0.distcp"]) == big


def test_a_sender_that_dies_mid_stream_leaves_nothing_visible(pair):
    receiver, send = pair
    send(11)
    endpoint, files = receiver.endpoint("127.0.0.1"), _files(12)
    with socket.create_connection((endpoint.host, endpoint.port), timeout=10) as sock:
        session = client_handshake(sock, SECRET.encode(), MAGIC,
                                   lambda view: recv_exactly(sock, view))
        header = session.header(endpoint.token, "stream-job", _stamp(12, files).to_json())
        sock.sendall(struct.pack(">I", len(header) - MAC_BYTES) + header)
        assert sock.recv(2) == b"GO"
        sock.sendall(files[".metadata"] + files["__1_0.distcp"][:5000])  # then it dies
        sock.shutdown(socket.SHUT_WR)
        assert sock.recv(2) == b"NO"  # the receiver saw the stream end short
    assert _held(receiver) == {11}
    assert send(12) == 12


def test_garbage_on_the_port_is_refused(pair):
    receiver, _ = pair
    endpoint = receiver.endpoint("127.0.0.1")
    for junk in (b"GET / HTTP/1.1\r\n\r\n", MAGIC + struct.pack(">I", 1 << 30)):
        with socket.create_connection((endpoint.host, endpoint.port), timeout=10) as sock:
            sock.sendall(junk)
            sock.shutdown(socket.SHUT_WR)
            assert sock.recv(2) == b"NO"
    assert _held(receiver) == set()


def test_a_refusal_ends_the_stream_cleanly_while_the_sender_still_has_bytes_in_flight(pair):
    """The receiver refuses after the first 8 bytes; closing with the rest unread would reset
    the connection, and a reset can overtake the refusal (12 of 4000 tries lost it). It ends
    its side after the reason and drops the rest until the sender closes: the sender reads the
    reason, then a clean end of stream, never a reset."""
    receiver, _ = pair
    endpoint = receiver.endpoint("127.0.0.1")
    with socket.create_connection((endpoint.host, endpoint.port), timeout=10) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 100_000)  # and keeps its side open
        reply = b""
        while chunk := sock.recv(4096):  # a reset raises ConnectionResetError here
            reply += chunk
        sock.shutdown(socket.SHUT_WR)  # the receiver is still reading: no reset came (ENOTCONN)
    assert reply.startswith(b"NO") and b"bad magic" in reply
    assert _held(receiver) == set()


def test_a_replica_arriving_as_the_job_ends_is_not_published(tmp_path, monkeypatch):
    monkeypatch.setenv(SNAPSHOT_ENV, str(tmp_path))
    keeper = SnapshotKeeper()
    keeper.configure("ending", 0, None, GEN, TERMS)
    files = _files(11)

    def fill(name: str, view: memoryview) -> int:
        view[:] = files[name]
        if name == last:  # the controller ends the job while the bytes arrive
            keeper.drop_job()
        return crc32c_of([view])

    for last in (".metadata", "empty"):  # a file still to come / all arrived, not published
        keeper.configure("ending", 0, None, GEN, TERMS)
        with pytest.raises(SnapshotError, match="ended|No such file"):
            keeper.land_replica(_stamp(11, files), fill)
        assert not os.path.exists(keeper.job_root) and keeper.inventory() == []


def test_connections_beyond_the_cap_are_closed_and_a_sender_gets_through_after(pair, monkeypatch):
    from tenax.workers import replica_stream

    monkeypatch.setattr(replica_stream, "MAX_CONNECTIONS", 2)
    receiver, send = pair
    endpoint = receiver.endpoint("127.0.0.1")
    idle = [socket.create_connection((endpoint.host, endpoint.port), timeout=10) for _ in range(2)]
    with socket.create_connection((endpoint.host, endpoint.port), timeout=10) as extra:
        assert extra.recv(2) == b""  # closed without a word
    for sock in idle:
        sock.close()  # their threads end (a short stream) and give their slots back
    _wait(lambda: _sent(send, 11), "slot given back")  # once the receiver saw them close


def _sent(send, step: int) -> bool:
    try:
        return send(step) == step
    except OSError:
        return False


def test_a_send_to_a_stalled_peer_is_aborted_when_the_rank_restarts(tmp_path, monkeypatch):
    """A frozen peer never reads: the send would hold for REPLICA_TIMEOUT_S and the new
    process's snapshots would be skipped meanwhile. A restart (new generation) ends it."""
    monkeypatch.setenv(SNAPSHOT_ENV, str(tmp_path))
    stalled = socket.create_server(("127.0.0.1", 0))  # accepts (backlog), never reads
    sender = SnapshotKeeper()
    sender.configure("stall", 0, Endpoint("127.0.0.1", stalled.getsockname()[1], "t"), 1)
    files = {"shard": bytes(48 << 20)}  # more than both sockets' buffers hold
    local = SnapshotDir(sender.local_dir)
    local.write(SnapshotStamp(1, 0, 2, 5, {"shard": [48 << 20, crc32c_of(files.values())]},
                              COMMIT), files)
    sender.replicate(1, 0, 5)
    _wait(lambda: sender.sending, "the send to block")
    sender.configure("stall", 0, None, 2)  # the rank restarted; its old peer is gone
    _wait(lambda: local.sent_step(1, 0) == 5, "the aborted send to be given up")
    assert sender.replica_errors == 1 and sender.replicated == 0
    stalled.close()
    sender.drop_job()
