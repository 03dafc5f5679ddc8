"""ReplicaReceiver: a snapshot's files from one agent straight into its peer's tmpfs buffer.

Why not Ray's object store (the replicas' first transport): every step each rank's
whole snapshot was put into the sender's object store, registered with the GCS, pulled by the
peer's raylet and copied out again — ~70 ms of CPU per step for two 18 MiB replicas on this
2-core host (agents, raylet, GCS), and on a real node with GBs of state per rank and eight
ranks, per-step objects competing with the job's own for a store sized to a fraction of RAM
(spilling to disk when it fills). Here the sender `sendfile()`s its tmpfs files into a TCP
connection and the peer receives them into the mapped pages of its reused replica buffer: no
object store, no GCS, one copy on each side.

Who may send (workers/replica_auth.py): only an agent of the same job. The controller gives
every agent of a job one secret at placement; on connect both sides prove they hold it
(HMAC-SHA256 over both sides' nonces, so nothing recorded can be replayed), and a MAC with a
key of this connection covers the header and every body byte (crc32c still finds damage).
The receiver takes only the stamp it expects (`Expectation`: the job, its current
generation, the rank of the peer node that sends here, the job's world, at most the planned
bytes), allocates the buffer before the first body byte, and a failed receipt leaves no file.

Held shut by slow or idle connections it is not: a connection must finish its handshake and
header within HEADER_TIMEOUT_S and then keep MIN_RATE; only the job's node addresses are
accepted; an address holds at most MAX_PENDING_PER_ADDRESS connections that have not proved
the secret yet (a newer one closes its oldest). Every refusal is counted by reason
(`failures`, exported as `tenax_replica_failures_total`).

Wire (nothing on it is unpickled): b"TNXR2" + the sender's nonce; the receiver's nonce and
proof; the sender's proof; a 4-byte big-endian header length, the header (JSON: the
receiver's token, the job and the stamp) and its MAC; the receiver answers b"GO" once it has
a buffer for it (or b"NO" + a reason: a refusal must reach the sender before any body byte);
then every file of the stamp in name order, exactly its stamped size, and the body's MAC.
The receiver answers b"OK" + the step (8 bytes), or b"NO" + a reason.
"""
from __future__ import annotations

import errno
import hmac
import logging
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from tenax.checkpoint import SnapshotError
from tenax.checkpoint.memory import SnapshotStamp, crc32c_of
from tenax.workers.replica_auth import (MAC_BYTES, NONCE_BYTES, Expectation, Session,
                                        client_handshake, parse_header, refusal, server_handshake)

logger = logging.getLogger(__name__)

MAGIC = b"TNXR2"
MAX_HEADER_BYTES = 1 << 20
IO_TIMEOUT_S = 30.0  # one stalled read or write: the sender is gone or the link is dead
HEADER_TIMEOUT_S = 5.0  # from accept to the whole header: a peer sends it in milliseconds
MIN_RATE = 1 << 20  # bytes/s a body must keep up after BODY_GRACE_S
BODY_GRACE_S = 5.0
MAX_REASON_BYTES = 4096
MAX_CONNECTIONS = 32  # at once; a peer sends one snapshot at a time, so more is not a peer
# Connections of one address that have not proved the secret yet; on loopback every agent is
# 127.0.0.1, and a peer opens one at a time: a few are plenty, and finitely many keep
# a trickling address from holding the port (its newest connection closes its oldest).
MAX_PENDING_PER_ADDRESS = 8
DRAIN_BYTES = 1 << 20  # after a refusal, at most this much of the rest of a stream is read
DRAIN_TIMEOUT_S = 2.0
# Arrived bytes are checksummed once this many have gathered: well inside a core's cache, and
# large enough that the per-call cost of the checksum does not count.
CRC_STRETCH = 256 << 10

# land(stamp, fill) receives one snapshot: fill(name, view) fills one file's bytes and returns
# their crc32c
Fill = Callable[[str, memoryview], int]
Land = Callable[[SnapshotStamp, Fill], int]


@dataclass(frozen=True)
class Endpoint:
    """Where an agent takes replicas, and the token a sender must show (crosses Ray)."""
    host: str
    port: int
    token: str


def _recv_into(sock: socket.socket, view: memoryview, deadline: float | None) -> int:
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the peer sends too slowly (deadline passed)")
        sock.settimeout(min(left, IO_TIMEOUT_S))
    return sock.recv_into(view, len(view))


def recv_exactly(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill `view` from `sock` (by `deadline`, monotonic); ConnectionError if it stops short."""
    got = 0
    while got < len(view):
        n = _recv_into(sock, view[got:], deadline)
        if n == 0:
            raise ConnectionError(f"the connection closed after {got} of {len(view)} bytes")
        got += n


def recv_checksummed(sock: socket.socket, view: memoryview, mac: "hmac.HMAC | None" = None,
                     deadline: float | None = None) -> int:
    """`recv_exactly`, returning the crc32c of the bytes received, computed as they arrive
    (and fed to `mac`, each stretch while it is still in cache)."""
    got = done = crc = 0
    while got < len(view):
        n = _recv_into(sock, view[got:], deadline)
        if n == 0:
            raise ConnectionError(f"the connection closed after {got} of {len(view)} bytes")
        got += n
        if got - done >= CRC_STRETCH or got == len(view):
            crc = crc32c_of([view[done:got]], crc)
            if mac is not None:
                mac.update(view[done:got])
            done = got
    return crc


def _drain(sock: socket.socket, limit: int = DRAIN_BYTES,
           timeout_s: float = DRAIN_TIMEOUT_S) -> None:
    """Read and drop what the peer still sends until it closes its side, within `limit` bytes
    and `timeout_s`. Why: closing a socket with unread bytes in it resets the connection, and
    the reset can reach the peer before the refusal it was sent, which then reads a dead
    socket instead of the reason (12 of 4000 refusals of a short junk stream on loopback)."""
    deadline = time.monotonic() + timeout_s
    while limit > 0 and (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        chunk = sock.recv(min(limit, 1 << 16))
        if not chunk:
            return
        limit -= len(chunk)


def _reason_of(exc: BaseException, evicted: bool) -> str:
    if evicted:
        return "evicted"
    if getattr(exc, "reason", None):
        return str(getattr(exc, "reason"))
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return "timeout"
    if isinstance(exc, OSError):
        return "no_space" if exc.errno == errno.ENOSPC else "connection"
    return "refused" if isinstance(exc, SnapshotError) else "error"


class ReplicaReceiver:
    """Listens on the node's address; each connection is a thread that lands one snapshot."""

    def __init__(self, host: str, land: Land, expectation: Expectation | None = None) -> None:
        self.land = land
        self.expectation = expectation  # None: nothing is taken (no job yet)
        self.failures: Counter[str] = Counter()
        self._server = socket.create_server((host, 0))
        self.endpoint = Endpoint(host, self._server.getsockname()[1], Session.new_token())
        self.token = self.endpoint.token
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._open = 0
        self._pending: dict[socket.socket, str] = {}  # not yet authenticated, oldest first
        self._evicted: set[socket.socket] = set()
        threading.Thread(target=self._accept, daemon=True, name="tenax-replica-accept").start()

    def expect(self, expectation: Expectation | None) -> None:
        self.expectation = expectation

    def failure_counts(self) -> dict[str, int]:
        """Refusals so far, by reason (a copy: the serving threads add to it)."""
        with self._lock:
            return dict(self.failures)

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def _count(self, reason: str) -> None:
        with self._lock:
            self.failures[reason] += 1

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, addr = self._server.accept()
            except OSError:  # closed
                return
            if not self._admit(conn, str(addr[0])):
                conn.close()
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # see send_snapshot
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="tenax-replica-recv").start()

    def _admit(self, conn: socket.socket, address: str) -> bool:
        expected = self.expectation
        if expected is not None and expected.addresses and address not in expected.addresses:
            logger.warning("replica connection from %s refused: not a node of the job", address)
            self._count("address")
            return False
        with self._lock:
            mine = [c for c, a in self._pending.items() if a == address]
            if len(mine) >= MAX_PENDING_PER_ADDRESS:  # its oldest goes: it cannot hold the port
                self._evict(mine[0])
            elif self._open >= MAX_CONNECTIONS:
                self.failures["busy"] += 1
                logger.warning("replica connection refused: %d already open", MAX_CONNECTIONS)
                return False
            self._open += 1
            self._pending[conn] = address
        return True

    def _evict(self, victim: socket.socket) -> None:
        """Under the lock: end a connection that has not authenticated (its thread counts it)."""
        del self._pending[victim]
        self._evicted.add(victim)
        try:
            victim.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                self._serve_one(conn)
        finally:
            with self._lock:
                self._open -= 1
                self._pending.pop(conn, None)
                self._evicted.discard(conn)

    def _serve_one(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + HEADER_TIMEOUT_S
        try:
            session, stamp = self._authenticated_header(conn, deadline)
            with self._lock:
                if self._pending.pop(conn, None) is None:
                    raise refusal("evicted", "the connection was closed for a newer one")
            conn.settimeout(IO_TIMEOUT_S)
            step = self.land(stamp, _Body(conn, session, stamp))
            conn.sendall(b"OK" + struct.pack(">Q", step))
        except Exception as exc:  # every refusal is counted and answered, never a traceback
            with self._lock:
                reason = _reason_of(exc, conn in self._evicted)
            self._refuse(conn, reason, f"{type(exc).__name__}: {exc}")

    def _refuse(self, conn: socket.socket, reason: str, text: str) -> None:
        self._count(reason)
        logger.warning("replica not taken (%s): %s", reason, text[:500])
        try:
            conn.settimeout(DRAIN_TIMEOUT_S)
            conn.sendall(b"NO" + f"{reason}: {text}".encode()[:MAX_REASON_BYTES])
            conn.shutdown(socket.SHUT_WR)
            _drain(conn)
        except OSError:
            pass

    def _authenticated_header(self, conn: socket.socket,
                              deadline: float) -> tuple[Session, SnapshotStamp]:
        head = bytearray(len(MAGIC) + NONCE_BYTES)
        recv_exactly(conn, memoryview(head), deadline)
        if bytes(head[:len(MAGIC)]) != MAGIC:
            raise refusal("handshake", "not a Tenax replica stream (bad magic)")
        expected = self.expectation
        if expected is None:
            raise refusal("not_ready", "this agent takes no replica now (no job)")
        session = server_handshake(conn, expected.secret, bytes(head[len(MAGIC):]),
                                   lambda view: recv_exactly(conn, view, deadline))
        size_bytes = bytearray(4)
        recv_exactly(conn, memoryview(size_bytes), deadline)
        (size,) = struct.unpack(">I", size_bytes)
        if size > MAX_HEADER_BYTES:
            raise refusal("header", f"replica header of {size} bytes exceeds "
                          f"{MAX_HEADER_BYTES}")
        raw = bytearray(size + MAC_BYTES)
        recv_exactly(conn, memoryview(raw), deadline)
        return session, parse_header(session, bytes(raw[:size]), bytes(raw[size:]),
                                     self.token, expected)

    def close(self) -> None:
        self._closed.set()
        self._server.close()


class _Body:
    """`fill` for one stream: GO before the first file's bytes, each file checksummed and
    MACed as it arrives, each within its deadline (MIN_RATE), the body's MAC after the last."""

    def __init__(self, conn: socket.socket, session: Session, stamp: SnapshotStamp) -> None:
        self.conn, self.session, self.left = conn, session, len(stamp.files)
        self.mac = session.body_mac()
        self.go = True

    def __call__(self, _: str, view: memoryview) -> int:
        if self.go:
            self.conn.sendall(b"GO")
            self.go = False
        deadline = time.monotonic() + BODY_GRACE_S + len(view) / MIN_RATE
        crc = recv_checksummed(self.conn, view, self.mac, deadline)
        self.left -= 1
        if self.left == 0:  # the last file: its bytes are published only under a valid MAC
            trailer = bytearray(MAC_BYTES)
            recv_exactly(self.conn, memoryview(trailer), time.monotonic() + BODY_GRACE_S)
            self.session.check_body(self.mac, bytes(trailer))
        return crc


def send_snapshot(endpoint: Endpoint, stamp: SnapshotStamp, paths: dict[str, str],
                  timeout_s: float = IO_TIMEOUT_S,
                  on_connect: Callable[[socket.socket], None] | None = None, *,
                  secret: bytes, job_id: str) -> int:
    """Stream one complete snapshot's files to `endpoint`; the step the peer now holds.
    SnapshotError when the peer refused it (or did not prove the job's `secret`), OSError
    when the connection failed or was shut down from another thread (`on_connect` is given
    the socket for that)."""
    with socket.create_connection((endpoint.host, endpoint.port), timeout=timeout_s) as sock:
        # The handshake and the MAC trailer are small writes right after others: with Nagle
        # each waited for the receiver's delayed ACK (~40 ms), so a 70 KB replica took longer
        # than a step and every other snapshot was skipped.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if on_connect is not None:
            on_connect(sock)
        session = client_handshake(sock, secret, MAGIC,
                                   lambda view: recv_exactly(sock, view))
        if session is None:  # refused before the proof (e.g. no job there yet)
            return _refused(sock, stamp)
        header = session.header(endpoint.token, job_id, stamp.to_json())
        sock.sendall(struct.pack(">I", len(header) - MAC_BYTES) + header)
        verdict = _verdict(sock)
        if verdict == b"GO":
            mac = session.body_mac()
            _send_files(sock, stamp, paths, mac)
            sock.sendall(mac.digest())
            verdict = _verdict(sock)
        if verdict == b"OK":
            step = bytearray(8)
            recv_exactly(sock, memoryview(step))
            return struct.unpack(">Q", step)[0]
        return _refused(sock, stamp)


def _refused(sock: socket.socket, stamp: SnapshotStamp) -> int:
    reason = sock.recv(MAX_REASON_BYTES).decode(errors="replace")
    raise SnapshotError(f"the peer refused the replica of rank {stamp.rank} step "
                        f"{stamp.step}: {reason or 'no reason given'}")


def _verdict(sock: socket.socket) -> bytes:
    verdict = bytearray(2)
    recv_exactly(sock, memoryview(verdict))
    return bytes(verdict)


def _send_files(sock: socket.socket, stamp: SnapshotStamp, paths: dict[str, str],
                mac: "hmac.HMAC") -> None:
    """sendfile each file (zero copy); the MAC reads the same pages through a mapping."""
    import mmap

    for name in sorted(stamp.files):
        size = stamp.files[name][0]
        if not size:  # sendfile's 0 would mean "to the end of the file"
            continue
        with open(paths[name], "rb") as f:
            with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as pages:
                view = memoryview(pages)
                try:
                    for start in range(0, size, CRC_STRETCH):
                        mac.update(view[start:start + CRC_STRETCH])
                finally:
                    view.release()
            sent = sock.sendfile(f, 0, size)
        if sent != size:
            raise SnapshotError(f"{paths[name]}: sent {sent} of {size} bytes")
