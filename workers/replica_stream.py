"""ReplicaReceiver: a snapshot's files from one agent straight into its peer's tmpfs buffer.

Why not Ray's object store (the replicas' first transport): every step each rank's
whole snapshot was put into the sender's object store, registered with the GCS, pulled by the
peer's raylet and copied out again — ~70 ms of CPU per step for two 18 MiB replicas on this
2-core host (agents, raylet, GCS), and on a real node with GBs of state per rank and eight
ranks, per-step objects competing with the job's own for a store sized to a fraction of RAM
(spilling to disk when it fills). Here the sender `sendfile()`s its tmpfs files into a TCP
connection and the peer receives them into the mapped pages of its reused replica buffer: no
object store, no GCS, one copy on each side.

Wire (nothing on it is unpickled): b"TNXR1", a 4-byte big-endian header length, the header
(JSON: the receiver's token and the snapshot's stamp); the receiver answers b"GO" once it has
a buffer for it (or b"NO" + a reason: a refusal must reach the sender before any body byte,
else the sender's unread bytes would reset the connection and lose the reason); then every
file of the stamp in name order, exactly its stamped size. The receiver checksums each file's
bytes as they arrive (crc32c, each stretch while it is still in the core's cache: a second pass
over 18 MiB read it back from memory, ~1-2 ms of the agent's CPU per replica), checks them
against the stamp and publishes only a whole, matching snapshot (snapshot_store's stamp-last
protocol), then answers b"OK" + the step (8 bytes), or b"NO" + a reason. Only a
holder of the token may send: the receiving agent hands it out over Ray (`Endpoint`); a
connection without it lands nothing.
"""
from __future__ import annotations

import hmac
import json
import logging
import secrets
import socket
import struct
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

from tenax.checkpoint import SnapshotError
from tenax.checkpoint.memory import SnapshotStamp, crc32c_of

logger = logging.getLogger(__name__)

MAGIC = b"TNXR1"
MAX_HEADER_BYTES = 1 << 20
IO_TIMEOUT_S = 30.0  # one stalled read or write: the sender is gone or the link is dead
MAX_REASON_BYTES = 4096
MAX_CONNECTIONS = 32  # at once; a peer sends one snapshot at a time, so more is not a peer
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


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from `sock`; ConnectionError if the sender stops short."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], len(view) - got)
        if n == 0:
            raise ConnectionError(f"the connection closed after {got} of {len(view)} bytes")
        got += n


def recv_checksummed(sock: socket.socket, view: memoryview) -> int:
    """`recv_exactly`, returning the crc32c of the bytes received, computed as they arrive."""
    got = done = crc = 0
    while got < len(view):
        n = sock.recv_into(view[got:], len(view) - got)
        if n == 0:
            raise ConnectionError(f"the connection closed after {got} of {len(view)} bytes")
        got += n
        if got - done >= CRC_STRETCH or got == len(view):
            crc, done = crc32c_of([view[done:got]], crc), got
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


@contextmanager
def _released(slots: threading.BoundedSemaphore) -> Iterator[None]:
    try:
        yield
    finally:
        slots.release()


class ReplicaReceiver:
    """Listens on the node's address; each connection is a thread that lands one snapshot."""

    def __init__(self, host: str, land: Land) -> None:
        self.land = land
        self.token = secrets.token_hex(16)
        self._server = socket.create_server((host, 0))
        self.endpoint = Endpoint(host, self._server.getsockname()[1], self.token)
        self._closed = threading.Event()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        threading.Thread(target=self._accept, daemon=True, name="tenax-replica-accept").start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:  # closed
                return
            if not self._slots.acquire(blocking=False):
                logger.warning("replica connection refused: %d already open", MAX_CONNECTIONS)
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="tenax-replica-recv").start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, _released(self._slots):
            conn.settimeout(IO_TIMEOUT_S)
            go = [b"GO"]  # sent before the first file's bytes are read

            def fill(_: str, view: memoryview) -> int:
                if go:
                    conn.sendall(go.pop())
                return recv_checksummed(conn, view)

            try:
                stamp = self._header(conn)
                step = self.land(stamp, fill)
                conn.sendall(b"OK" + struct.pack(">Q", step))
            except (OSError, SnapshotError, ValueError) as exc:
                reason = f"{type(exc).__name__}: {exc}"
                logger.warning("replica not taken: %s", reason)
                try:
                    conn.sendall(b"NO" + reason.encode()[:MAX_REASON_BYTES])
                    conn.shutdown(socket.SHUT_WR)
                    _drain(conn)
                except OSError:
                    pass

    def _header(self, conn: socket.socket) -> SnapshotStamp:
        head = bytearray(len(MAGIC) + 4)
        recv_exactly(conn, memoryview(head))
        if bytes(head[:len(MAGIC)]) != MAGIC:
            raise SnapshotError("not a Tenax replica stream (bad magic)")
        (size,) = struct.unpack(">I", head[len(MAGIC):])
        if size > MAX_HEADER_BYTES:
            raise SnapshotError(f"replica header of {size} bytes exceeds {MAX_HEADER_BYTES}")
        raw = bytearray(size)
        recv_exactly(conn, memoryview(raw))
        try:
            doc = json.loads(raw)
            token, stamp_json = str(doc["token"]), str(doc["stamp"])
        except (ValueError, KeyError, TypeError) as exc:
            raise SnapshotError(f"unreadable replica header: {exc}") from None
        if not hmac.compare_digest(token, self.token):
            raise SnapshotError("replica refused: wrong token")
        return SnapshotStamp.from_json(stamp_json)

    def close(self) -> None:
        self._closed.set()
        self._server.close()


def send_snapshot(endpoint: Endpoint, stamp: SnapshotStamp, paths: dict[str, str],
                  timeout_s: float = IO_TIMEOUT_S,
                  on_connect: Callable[[socket.socket], None] | None = None) -> int:
    """Stream one complete snapshot's files to `endpoint`; the step the peer now holds.
    SnapshotError when the peer refused it, OSError when the connection failed or was shut
    down from another thread (`on_connect` is given the socket for that)."""
    header = json.dumps({"token": endpoint.token, "stamp": stamp.to_json()}).encode()
    with socket.create_connection((endpoint.host, endpoint.port), timeout=timeout_s) as sock:
        if on_connect is not None:
            on_connect(sock)
        sock.sendall(MAGIC + struct.pack(">I", len(header)) + header)
        verdict = _verdict(sock)
        if verdict == b"GO":
            _send_files(sock, stamp, paths)
            verdict = _verdict(sock)
        if verdict == b"OK":
            step = bytearray(8)
            recv_exactly(sock, memoryview(step))
            return struct.unpack(">Q", step)[0]
        reason = sock.recv(MAX_REASON_BYTES).decode(errors="replace")
        raise SnapshotError(f"the peer refused the replica of rank {stamp.rank} step "
                            f"{stamp.step}: {reason or 'no reason given'}")


def _verdict(sock: socket.socket) -> bytes:
    verdict = bytearray(2)
    recv_exactly(sock, memoryview(verdict))
    return bytes(verdict)


def _send_files(sock: socket.socket, stamp: SnapshotStamp, paths: dict[str, str]) -> None:
    for name in sorted(stamp.files):
        size = stamp.files[name][0]
        if not size:  # sendfile's 0 would mean "to the end of the file"
            continue
        with open(paths[name], "rb") as f:
            sent = sock.sendfile(f, 0, size)
        if sent != size:
            raise SnapshotError(f"{paths[name]}: sent {sent} of {size} bytes")
