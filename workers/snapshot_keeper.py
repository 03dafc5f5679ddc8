"""SnapshotKeeper: the agent's half of in-memory snapshots.

The rank's training process writes a snapshot every step into this agent's directory
(checkpoint/memory/snapshot.py); the agent, which outlives that process, keeps it, sends each
new one to its peer (the agent one node further along the ring) and holds the replica the peer
of the previous node sends here (workers/replica_stream.py: a direct TCP stream between the two
agents, not Ray's object store). The controller asks every live agent what it holds
(`inventory`), has the chosen pieces located where they lie (`locate`, to be linked by an
agent on the same node; the ranks check them as they load) or read (`read`, checksummed),
assembled on each new node
(`assemble`), and drops the job's snapshots when the job ends.

Replication never blocks training or the agent: one background thread sends the newest
snapshot; if several complete while a send is in flight only the newest is sent next. Only the
job's own agents may send a replica, and only the stamp this agent expects is taken
(`ReplicaTerms`, workers/replica_auth.py). While it keeps a job the agent holds the job
directory's lock, and at start it removes the directories of jobs that are gone
(checkpoint/memory/tmpfs_tree.py).
"""
from __future__ import annotations

import logging
import os
import shutil
import socket
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from tenax.checkpoint import SnapshotError, assemble_version
from tenax.checkpoint.memory import (BufferMaps, JobLock, SnapshotDir, SnapshotStamp,
                                     few_inodes, file_name_of, job_dir, makedirs_private,
                                     snapshot_base, sweep_stale)
from tenax.workers.replica_auth import Expectation, check_stamp, replica_cap
from tenax.workers.replica_stream import Endpoint, Fill, ReplicaReceiver, send_snapshot

logger = logging.getLogger(__name__)

REPLICA_TIMEOUT_S = 120.0
ENDPOINT_TIMEOUT_S = 30.0
KINDS = ("local", "replica")


@dataclass(frozen=True)
class ReplicaTerms:
    """The job's replica terms for one agent (from the controller at placement; crosses Ray;
    the secret never appears in a repr or a log)."""
    secret: str = field(default="", repr=False)  # the job's secret (replica_auth.py)
    world: int = 0
    ranks: tuple[int, ...] = ()  # the ranks whose replicas this agent holds (none: takes none)
    peer_addresses: tuple[str, ...] = ()  # the address(es) it comes from
    rank_bytes: int = 0  # the planned bytes of one rank's snapshot (caps a replica)
    max_step: int = 0  # the job's last step (train.steps): a replica of a later one is forged


def _abort(sock: socket.socket) -> None:
    """Make a send blocked on `sock` in another thread fail now."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed
        pass


class SnapshotKeeper:
    def __init__(self) -> None:
        self.slot = uuid.uuid4().hex[:12]
        self.job_id, self.rank, self.peer, self.generation = "", -1, None, -1
        self.root = ""  # the job's directory on this node ("": none, or none could be made)
        self.unprepared = ""  # why this job's directories could not be made here ("": made)
        self.unprepared_at = ""  # the directory that could not be made
        self._lock = threading.Lock()
        self._wanted: tuple[int, int, int] | None = None
        self._busy = False
        self.replicated, self.replica_errors = 0, 0
        self._receiver: ReplicaReceiver | None = None
        self._peer_endpoint: tuple[Any, Endpoint] | None = None  # (peer handle, its endpoint)
        self._landing: set[tuple[int, int]] = set()  # series a replica is arriving into
        self._epoch = 0  # bumped by drop_job: a replica arriving across it is not published
        self._stream: socket.socket | None = None  # the replica being sent, if any
        # The replica buffers' mappings, kept between replicas: mapping 18 MiB afresh for
        # each one cost ~3 ms of CPU (checkpoint/memory/buffer_maps.py). Two buffers per series, a
        # new generation's series beside the last one's.
        self._maps = BufferMaps(limit=4)
        self.terms = ReplicaTerms()
        self._job_lock = JobLock()
        # The directories that agents of jobs now gone left behind (a killed `tenax run`)
        # go when the next agent starts here, from every tree of this user (the shared one,
        # its fallbacks, older versions' per-process ones); off the actor's start-up path.
        threading.Thread(target=sweep_stale, daemon=True, name="tenax-snapshot-sweep").start()
        self._closed_failures: Counter[str] = Counter()  # of receivers closed by drop_job

    def configure(self, job_id: str, rank: int, peer: Any, generation: int,
                  replicas: ReplicaTerms | None = None) -> None:
        """A new training process: its job, rank, generation, and who holds its replica (an
        agent's handle, or the `Endpoint` it listens on); `replicas`: the job's secret and
        what this agent takes from its own peer (None: nothing is sent or taken).

        A send still in flight from the previous generation is aborted: its peer may be the
        node just lost (a frozen one holds the send to its timeout, and until it ends the new
        process's snapshots are skipped, paced to the replica), and the new process writes a
        newer snapshot to send within a step."""
        terms = replicas or ReplicaTerms()
        with self._lock:
            stale = self._stream if generation != self.generation else None
            self.job_id, self.rank, self.peer, self.generation = job_id, rank, peer, generation
            self.terms = terms
            receiver = self._receiver
        if receiver is not None:
            receiver.expect(self._expectation())
        if stale is not None:
            _abort(stale)
        self.unprepared = self._prepare(job_id) if job_id else ""

    def _prepare(self, job_id: str) -> str:
        """Make the job's directories and hold its lock; "" when done, else why not. A tmpfs
        without room (or inodes) must not stop the rank from starting: it starts with
        snapshots off, which its first snapshot tells every rank (checkpoint/memory/snapshot.py)
        and the job goes on from storage checkpoints."""
        try:
            root = job_dir(job_id)
            self._job_lock.hold(root)  # the job is live on this node while held
            self.root = root
            for where in (self.local_dir, self.replica_dir):  # the slot directory too: 0700
                makedirs_private(where)
        except OSError as exc:
            self.root = ""
            where = self.unprepared_at = str(exc.filename or snapshot_base())
            reason = (f"cannot make the snapshot directory {where} for rank {self.rank} on "
                      f"this node: {exc.strerror or exc}{few_inodes(where)}")
            logger.warning("job %s: %s; this rank starts with in-memory snapshots off",
                           job_id, reason)
            return reason
        return ""

    def snapshot_target(self) -> tuple[str | None, str]:
        """(where this rank's snapshots go, why none can be taken there: "" when they can).
        A rank whose directory could not be made still gets a path, of the tmpfs it could
        not use: it must take part in every snapshot's agreement, so that all ranks stop."""
        if not self.unprepared:
            return self.local_dir, ""
        return self.unprepared_at, self.unprepared

    def _expectation(self) -> Expectation | None:
        """What this agent's receiver takes now (None: nothing, no job or no secret)."""
        terms = self.terms
        if not self.job_id or not terms.secret or not terms.ranks:
            return None
        return Expectation(self.job_id, self.generation, frozenset(terms.ranks),
                           terms.world, replica_cap(terms.rank_bytes), terms.secret.encode(),
                           frozenset(terms.peer_addresses), terms.max_step)

    def failure_counts(self) -> dict[str, int]:
        """Replica failures by reason: every refusal of this agent's receiver, and `send`
        for each of its own replicas not sent (tenax_replica_failures_total)."""
        receiver = self._receiver
        counts = receiver.failure_counts() if receiver is not None else {}
        with self._lock:
            closed = dict(self._closed_failures)
        for reason, n in closed.items():
            counts[reason] = counts.get(reason, 0) + n
        if self.replica_errors:
            counts["send"] = counts.get("send", 0) + self.replica_errors
        return counts

    @property
    def job_root(self) -> str:
        return self.root

    @property
    def local_dir(self) -> str | None:
        return os.path.join(self.root, self.slot, "local") if self.root else None

    @property
    def replica_dir(self) -> str:
        if not self.root:
            raise SnapshotError(f"no snapshot directory here (job {self.job_id!r}): "
                                f"{self.unprepared or 'no job'}")
        return os.path.join(self.root, self.slot, "replica")

    def _dir(self, kind: str) -> SnapshotDir:
        if kind not in KINDS or not self.job_id or not self.root:
            raise SnapshotError(f"no {kind!r} snapshots here (job {self.job_id!r})"
                                + (f": {self.unprepared}" if self.unprepared else ""))
        if kind == "local":
            return SnapshotDir(self.local_dir, keep=2)  # written by the rank: double buffer
        # Double buffered too: the ranks of one node send their step N independently, so a node
        # lost mid-way leaves some ranks' replicas at N and others' at N-1; with one buffer N-1
        # was gone for the first ones and no step was complete (the recovery fell back to
        # storage in 2 of 4 frozen-node runs). Snapshots wait until every rank's N-1 was sent,
        # so with two buffers N-1 is always complete.
        return SnapshotDir(self.replica_dir, keep=2)

    # ---- replication -------------------------------------------------------------------------
    def replicate(self, generation: int, rank: int, step: int) -> None:
        """A snapshot completed here: send it (or a newer one) to the peer in the background."""
        with self._lock:
            if self.peer is None:
                return
            self._wanted = (generation, rank, step)
            if self._busy:
                return
            self._busy = True
        threading.Thread(target=self._send_loop, daemon=True, name="tenax-replicate").start()

    def _send_loop(self) -> None:
        while True:
            with self._lock:
                wanted, peer, self._wanted = self._wanted, self.peer, None
                if wanted is None or peer is None:
                    self._busy = False
                    return
            try:
                stamp, paths = self._dir("local").paths(*wanted)
                send_snapshot(self._endpoint_of(peer), stamp, paths, REPLICA_TIMEOUT_S,
                              on_connect=lambda sock, g=wanted[0]: self._track(sock, g),
                              secret=self.terms.secret.encode(), job_id=self.job_id)
                self.replicated += 1
            except Exception as exc:  # the peer may be gone; the local copy still serves
                self.replica_errors += 1
                self._peer_endpoint = None  # ask again: the peer may be a new agent by then
                logger.warning("replica of rank %d step %d not sent: %s", wanted[1], wanted[2],
                               f"{type(exc).__name__}: {str(exc)[:200]}")
            with self._lock:
                self._stream = None
            try:  # sent or given up: either way the rank may take its next snapshot
                self._dir("local").mark_sent(*wanted)
            except (OSError, SnapshotError) as exc:
                logger.warning("cannot record the replica of step %d: %s", wanted[2], exc)

    @property
    def sending(self) -> bool:
        """Whether a replica is on its way to the peer right now."""
        return self._stream is not None

    def _track(self, sock: socket.socket, generation: int) -> None:
        """The send's connection is open: abortable by `configure` from now on (at once if
        that already happened)."""
        with self._lock:
            current = generation == self.generation
            self._stream = sock if current else None
        if not current:
            _abort(sock)

    def _endpoint_of(self, peer: Any) -> Endpoint:
        import ray

        if isinstance(peer, Endpoint):
            return peer
        cached = self._peer_endpoint
        if cached is None or cached[0] is not peer:  # a restart may have named another peer
            cached = (peer, ray.get(peer.replica_endpoint.remote(), timeout=ENDPOINT_TIMEOUT_S))
            self._peer_endpoint = cached
        return cached[1]

    def endpoint(self, host: str) -> Endpoint:
        """Where peers stream replicas to this agent (listening from the first call on)."""
        with self._lock:
            if self._receiver is None:
                self._receiver = ReplicaReceiver(host, self.land_replica, self._expectation())
            return self._receiver.endpoint

    def land_replica(self, stamp: SnapshotStamp, fill: Fill) -> int:
        """Receive a peer's snapshot into a replica buffer and publish it once whole. Only the
        bookkeeping holds the lock, not the transfer: the job's end (drop_job) never waits
        for a slow link, and a replica arriving across it is not published. The replica is
        dated by this agent's clock, not the sender's: the buffers are kept and rewritten by
        write order, and a stamp dated in the future would outlive every real replica."""
        stamp = replace(stamp, written_at=time.time())
        series = (stamp.generation, stamp.rank)
        with self._lock:
            if not self.job_id:
                raise SnapshotError("this agent holds no job (not started, or ended)")
            expected = self._expectation()
            if expected is None:
                raise SnapshotError(f"this agent takes no replica (job {self.job_id!r})")
            check_stamp(stamp, expected)  # before a buffer is touched: nothing changes here
            if series in self._landing:  # a retry while the last send still arrives
                raise SnapshotError(f"a replica of rank {stamp.rank} is already arriving")
            replicas, epoch = self._dir("replica"), self._epoch
            partial = replicas.begin(stamp.generation, stamp.rank, stamp.step)
            self._landing.add(series)
        try:
            replicas.receive(partial, stamp, fill, self._maps)
            with self._lock:
                if self._epoch != epoch:
                    raise SnapshotError("the job ended while its replica arrived")
                replicas.publish(partial, stamp)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)  # a failed receipt leaves no file
            self._maps.forget_deleted()
            raise
        finally:
            with self._lock:
                self._landing.discard(series)
        return stamp.step

    # ---- what the controller asks ----------------------------------------------------------
    def inventory(self) -> list[dict[str, Any]]:
        """Every complete snapshot held here (stamps only; reads verify checksums)."""
        if not self.job_id or not self.root:
            return []
        out = []
        for kind in KINDS:
            for stamp in self._dir(kind).complete():
                out.append({"kind": kind, "generation": stamp.generation, "rank": stamp.rank,
                            "world": stamp.world, "step": stamp.step, "bytes": stamp.nbytes})
        return out

    def locate(self, generation: int, rank: int, step: int) -> dict[str, str]:
        """Where this node keeps its own complete snapshot of `step` (sizes checked), for an
        agent on this node to link instead of copying. Only `local` snapshots: their writer
        (this rank's training process of that generation) is gone by now and a generation is
        never written again, so their pages cannot change under a link; a replica can (a
        peer's late send rewrites its buffer in place). Its checksums are not read here: the
        ranks check them while they load it (every rank falls back to storage when one share
        is damaged), so its bytes are read once on the restore's path, not twice."""
        import ray

        local = self._dir("local")
        stamp, _ = local.paths(generation, rank, step)
        path = os.path.join(local.series(generation, rank), f"s{step}")
        return {"stamp": stamp.to_json(), "path": path,
                "node": ray.get_runtime_context().get_node_id()}

    def read(self, kind: str, generation: int, rank: int, step: int) -> tuple[str, dict[str, Any]]:
        """A piece for a restore: checksums verified, files as mapped arrays (see mapped)."""
        stamp, files = self._dir(kind).mapped(generation, rank, step)
        return stamp.to_json(), files

    def assemble(self, job_id: str, generation: int, key: str, pieces: list[Any]) -> str:
        """Put the pieces together as one committed version under this node's restore dir; its
        URI. A piece is (stamp JSON, files) to write, or `locate`'s answer for a snapshot on
        this node, linked. Restores of other snapshot generations are dropped first: their
        ranks are gone, and each would pin a whole state in host memory until the job ends.
        (`job_id` given: a newly placed agent has not been told its job yet.)"""
        if not self.job_id:  # not told its job yet: the restore is the job's all the same
            self._job_lock.hold(job_dir(job_id))
        base = os.path.join(job_dir(job_id), "restore")
        for name in os.listdir(base) if os.path.isdir(base) else []:
            if name != f"g{generation}":
                shutil.rmtree(os.path.join(base, name), ignore_errors=True)
        parsed = [self._piece(p) for p in pieces]
        return assemble_version(os.path.join(base, f"g{generation}", file_name_of(key)), parsed)

    @staticmethod
    def _piece(piece: Any) -> tuple[SnapshotStamp, Any]:
        if not isinstance(piece, dict):
            stamp, files = piece
            return SnapshotStamp.from_json(stamp), files
        import ray

        if piece.get("node") != ray.get_runtime_context().get_node_id():
            raise SnapshotError(f"snapshot {piece.get('path')} is on node "
                                f"{str(piece.get('node'))[:12]}, not this one: cannot link it")
        stamp = SnapshotStamp.from_json(piece["stamp"])
        held = SnapshotDir.read_stamp(piece["path"])
        if held != stamp:  # replaced since it was verified: never link other bytes
            raise SnapshotError(f"snapshot {piece['path']} changed since it was verified")
        return stamp, piece["path"]

    def drop_job(self) -> None:
        """The job ended: remove everything it kept on this node (every slot's directory) and
        refuse replicas from now on (a peer's late send must not recreate it)."""
        with self._lock:
            job, root = self.job_id, self.root
            self.job_id, self.peer, self._wanted, self.root = "", None, None, ""
            self._epoch += 1
            receiver, self._receiver = self._receiver, None
        if receiver is not None:
            receiver.close()
            counts = receiver.failure_counts()
            with self._lock:
                self._closed_failures.update(counts)
        if job and root:
            shutil.rmtree(root, ignore_errors=True)
        self._job_lock.release()
        self._maps.close()  # a replica landing right now keeps its view until it is done
