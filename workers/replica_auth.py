"""Who may send a replica, and what a receiver takes: the job's secret and the expected stamp.

Why a secret and not only the receiver's token: the token is handed out over Ray to whoever
asks, and its holder could send any stamp — a generation of 10^9 made `prune` delete the real
replicas and won every recovery, its own checksums going into the manifest. The controller
makes one secret per job (`new_job_secret`) and gives it to the job's agents at placement
(never logged: the dataclasses that carry it leave it out of their repr). Both ends of a
connection prove they hold it without sending it: HMAC-SHA256 over both sides' fresh nonces
(mutual, so a sender never streams a snapshot to an impostor either, and nothing recorded can
be replayed on another connection). The key of the connection, derived the same way, MACs the
header and every body byte; crc32c stays for damage.

A receiver then takes only the stamp it expects (`Expectation`), before it touches a buffer:
the job, the current generation, a rank of the peer node that sends here, the job's world,
no step past the job's last (`train.steps`), at most MAX_FILES safely named files and at most
the planned bytes. What order the replicas were written in is the receiver's own clock, never
the stamp's `written_at` (snapshot_keeper.py): a stamp dated in the future would otherwise
stay the newest forever, and every real replica after it would rewrite the one before.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import secrets
import socket
from dataclasses import dataclass, field
from typing import Callable

from tenax.checkpoint import SnapshotError
from tenax.checkpoint.memory import SnapshotStamp

logger = logging.getLogger(__name__)

NONCE_BYTES = 32
MAC_BYTES = 32
MAX_FILES = 64  # a rank's snapshot holds its shard file and, on rank 0, the metadata
FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}|\.metadata")
Recv = Callable[[memoryview], None]


def new_job_secret() -> str:
    """A job's replica secret (hex), made by the controller once per job."""
    return secrets.token_hex(32)


def refusal(reason: str, text: str) -> SnapshotError:
    """A SnapshotError carrying the `reason` it is counted under (a metric label)."""
    exc = SnapshotError(text)
    exc.reason = reason  # type: ignore[attr-defined]
    return exc


def replica_cap(planned_bytes: int) -> int:
    """The most bytes a replica may declare: the planned rank state with slack for the cost
    model's first-order error and the metadata (0: unknown, no cap)."""
    return 2 * planned_bytes + (16 << 20) if planned_bytes > 0 else 0


@dataclass(frozen=True)
class Expectation:
    """What one receiving agent takes now (set at each configure)."""
    job_id: str
    generation: int
    ranks: frozenset[int]  # whose replicas this agent holds: the peer node's rank(s)
    world: int
    max_bytes: int  # the cap of one replica's declared bytes (0: none)
    secret: bytes = field(repr=False)
    addresses: frozenset[str] = frozenset()  # the peer node's addresses (empty: any)
    max_step: int = 0  # the job's last step (train.steps): none is beyond it (0: unknown)


def _proof(secret: bytes, label: bytes, client: bytes, server: bytes) -> bytes:
    return hmac.new(secret, b"tenax-replica " + label + client + server, hashlib.sha256).digest()


class Session:
    """The key of one authenticated connection: MACs its header and its body."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    def __repr__(self) -> str:
        return "Session(<key>)"

    @staticmethod
    def new_token() -> str:
        return secrets.token_hex(16)

    def header(self, token: str, job_id: str, stamp_json: str) -> bytes:
        """The header's bytes followed by their MAC."""
        return self.sign(json.dumps({"token": token, "job": job_id,
                                     "stamp": stamp_json}).encode())

    def sign(self, raw: bytes) -> bytes:
        """A header's bytes followed by their MAC."""
        return raw + hmac.new(self._key, b"header" + raw, hashlib.sha256).digest()

    def body_mac(self) -> "hmac.HMAC":
        return hmac.new(self._key, b"body", hashlib.sha256)

    @staticmethod
    def check_body(mac: "hmac.HMAC", trailer: bytes) -> None:
        if not hmac.compare_digest(mac.digest(), trailer):
            raise refusal("mac", "the replica's bytes do not match their MAC")

    def check_header(self, raw: bytes, mac: bytes) -> None:
        want = hmac.new(self._key, b"header" + raw, hashlib.sha256).digest()
        if not hmac.compare_digest(want, mac):
            raise refusal("mac", "the replica header does not match its MAC")


def server_handshake(conn: socket.socket, secret: bytes, client_nonce: bytes,
                     recv: Recv) -> Session:
    """The receiver's half: prove the secret to the sender, check the sender's proof."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    conn.sendall(b"HI" + nonce + _proof(secret, b"server", client_nonce, nonce))
    proof = bytearray(MAC_BYTES)
    recv(memoryview(proof))
    if not hmac.compare_digest(bytes(proof), _proof(secret, b"client", client_nonce, nonce)):
        raise refusal("handshake", "the sender did not prove the job's secret")
    return Session(_proof(secret, b"session", client_nonce, nonce))


def client_handshake(sock: socket.socket, secret: bytes, magic: bytes,
                     recv: Recv) -> Session | None:
    """The sender's half; None when the receiver refused at once (its reason follows)."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(magic + nonce)
    tag = bytearray(2)
    recv(memoryview(tag))
    if bytes(tag) != b"HI":
        return None
    rest = bytearray(NONCE_BYTES + MAC_BYTES)
    recv(memoryview(rest))
    theirs, proof = bytes(rest[:NONCE_BYTES]), bytes(rest[NONCE_BYTES:])
    if not hmac.compare_digest(proof, _proof(secret, b"server", nonce, theirs)):
        raise SnapshotError("the replica peer did not prove the job's secret: not this job's "
                            "agent; nothing sent")
    sock.sendall(_proof(secret, b"client", nonce, theirs))
    return Session(_proof(secret, b"session", nonce, theirs))


def _text(value: object) -> bytes:
    return str(value).encode("utf-8", errors="replace")


def parse_header(session: Session, raw: bytes, mac: bytes, token: str,
                 expected: Expectation) -> SnapshotStamp:
    """The stamp of an authenticated header, if it is one this receiver expects."""
    session.check_header(raw, mac)
    try:
        doc = json.loads(raw)
        their_token, job, stamp_json = doc["token"], doc["job"], str(doc["stamp"])
    except (ValueError, KeyError, TypeError) as exc:
        raise refusal("header", f"unreadable replica header: {type(exc).__name__}") from None
    if not hmac.compare_digest(_text(their_token), _text(token)):
        raise refusal("token", "replica refused: wrong token")
    if job != expected.job_id:
        raise refusal("stamp", f"replica of job {str(job)[:80]!r}, this agent holds "
                      f"{expected.job_id!r}")
    try:
        stamp = SnapshotStamp.from_json(stamp_json)
    except SnapshotError as exc:
        raise refusal("header", str(exc)) from None
    check_stamp(stamp, expected)
    return stamp


def check_stamp(stamp: SnapshotStamp, expected: Expectation) -> None:
    """Refuse (reason `stamp` or `size`) a stamp this receiver does not expect."""
    wrong = []
    if stamp.generation != expected.generation:
        wrong.append(f"generation {stamp.generation} (current: {expected.generation})")
    if stamp.rank not in expected.ranks:
        wrong.append(f"rank {stamp.rank} (the peer node's: {sorted(expected.ranks)})")
    if stamp.world != expected.world:
        wrong.append(f"world {stamp.world} (the job's: {expected.world})")
    if expected.max_step and stamp.step > expected.max_step:
        wrong.append(f"step {stamp.step} (the job ends at step {expected.max_step})")
    if not stamp.files or len(stamp.files) > MAX_FILES:
        wrong.append(f"{len(stamp.files)} files (1 to {MAX_FILES})")
    bad = [name for name in stamp.files if not FILE_NAME.fullmatch(name)]
    if bad:
        wrong.append(f"file name {bad[0][:80]!r}")
    if any(size < 0 for size, _ in stamp.files.values()):
        wrong.append("a negative size")
    if wrong:
        raise refusal("stamp", "replica stamp not expected here: " + "; ".join(wrong))
    if expected.max_bytes and stamp.nbytes > expected.max_bytes:
        raise refusal("size", f"replica of {stamp.nbytes} bytes exceeds the planned "
                      f"{expected.max_bytes}")
