"""Durable job store of `tenax serve`: one sqlite file under `--state-dir`.

Why sqlite: the service must outlive itself. Every job's spec, state, cause, checkpoint URI and
event history is written here before anyone is told about it, so a service that is killed
(even with SIGKILL) and started again knows which jobs were running (and resumes them from
their newest committed checkpoint) and still answers for finished ones (WatchJob replays their
history). WAL journaling lets WatchJob readers run while controllers append, and
`synchronous=NORMAL` keeps an append cheap (no fsync per event; a power cut may lose the last
few events, never corrupt the file, and checkpoints are the source of truth for training).

One connection guarded by a lock: writes are serialized by sqlite anyway, and the volume (a few
events per second per job) does not need a pool.

History is append-only except for step events, which are thinned so a million-step job does
not keep a million rows: the newest `step_tail` step events of a job are kept whole, and older
ones only when `step % step_every == 0`. Every other event (state, placed, failure, recovered,
checkpoint, scaled, ...) is kept forever. `seq` numbers the events of a job and never repeats,
even across restarts (it continues from the largest stored one).
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tenax.orchestrator.errors import StoreError

logger = logging.getLogger(__name__)

DB_NAME = "tenax.db"
LOCK_NAME = "lock"
# Every file this store keeps in its state dir (jobs may not name them: StorageRoots)
STATE_FILES = (DB_NAME, f"{DB_NAME}-wal", f"{DB_NAME}-shm", LOCK_NAME)
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
STEP_EVERY, STEP_TAIL = 50, 200
CANCEL_REQUESTED = "cancel_requested"  # event kind of a persisted CancelJob
BUSY_TIMEOUT_S = 10.0
_JOB_COLS = ("job_id, name, spec_json, state, cause, checkpoint_uri, status_json, created_at, "
             "updated_at, owner")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    spec_json TEXT NOT NULL,
    state TEXT NOT NULL,
    cause TEXT NOT NULL DEFAULT '',
    checkpoint_uri TEXT NOT NULL,
    status_json TEXT NOT NULL DEFAULT '{}',
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    owner TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS events (
    job_id TEXT NOT NULL REFERENCES jobs(job_id),
    seq INTEGER NOT NULL,
    time REAL NOT NULL,
    kind TEXT NOT NULL,
    step INTEGER NOT NULL DEFAULT 0,
    json TEXT NOT NULL,
    PRIMARY KEY (job_id, seq)
);
"""


@dataclass(frozen=True)
class JobRecord:
    job_id: str
    name: str
    spec_json: str
    state: str
    cause: str
    checkpoint_uri: str
    status: dict[str, Any]
    created_at: float
    updated_at: float
    owner: str = ""  # the submitting token's name (--token-file)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL


@dataclass(frozen=True)
class EventRecord:
    job_id: str
    seq: int
    time: float
    kind: str
    step: int
    event: dict[str, Any]


class JobStore:
    """Thread-safe access to the state dir's sqlite database."""

    def __init__(self, state_dir: str | Path, step_every: int = STEP_EVERY,
                 step_tail: int = STEP_TAIL, exclusive: bool = False) -> None:
        self.path = Path(state_dir) / DB_NAME
        self.step_every, self.step_tail = max(1, step_every), max(1, step_tail)
        self._lock = threading.Lock()
        self._next_seq: dict[str, int] = {}
        self._steps_since_prune: dict[str, int] = {}
        self._owner: Any = None
        self.closed = False  # set by close: the scheduler's loop ends with its store
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if exclusive:
                self._owner = _own_state_dir(self.path.parent)
            self._db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, check_same_thread=False,
                                       isolation_level=None)  # explicit transactions below
            mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            _add_owner_column(self._db)
        except (OSError, sqlite3.Error) as err:
            if self._owner is not None:
                self._owner.close()
            raise StoreError(f"cannot open the job store {self.path}: {err}") from None
        if str(mode).lower() != "wal":
            raise StoreError(f"{self.path}: sqlite refused WAL journaling (got {mode!r})")

    @property
    def journal_mode(self) -> str:
        with self._lock:
            return str(self._db.execute("PRAGMA journal_mode").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._db.close()
            if self._owner is not None:
                self._owner.close()  # releases the flock
                self._owner = None

    # ---- jobs ------------------------------------------------------------------------------
    def add_job(self, job_id: str, name: str, spec_json: str, checkpoint_uri: str,
                state: str = "PENDING", owner: str = "") -> JobRecord:
        now = time.time()
        with self._lock, self._write():
            self._db.execute(
                "INSERT INTO jobs (job_id, name, spec_json, state, checkpoint_uri, created_at, "
                "updated_at, owner) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (job_id, name, spec_json, state, checkpoint_uri, now, now, owner))
            self._next_seq[job_id] = 1
        return self.get_job(job_id)

    def get_job(self, job_id: str) -> JobRecord | None:
        with self._lock:
            row = self._db.execute(f"SELECT {_JOB_COLS} FROM jobs WHERE job_id = ?",
                                   (job_id,)).fetchone()
        return _job(row) if row else None

    def list_jobs(self, states: tuple[str, ...] = (), limit: int = 0,
                  after: tuple[float, str] | None = None) -> list[JobRecord]:
        """Newest first (created_at DESC, then job_id); `after`: the (created_at, job_id) of
        the last job of the previous page."""
        sql, where, args = f"SELECT {_JOB_COLS} FROM jobs", [], []
        if states:
            where.append(f"state IN ({', '.join('?' for _ in states)})")
            args += list(states)
        if after is not None:
            where.append("(created_at < ? OR (created_at = ? AND job_id > ?))")
            args += [after[0], after[0], after[1]]
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY created_at DESC, job_id"
        if limit > 0:
            sql += " LIMIT ?"
            args.append(limit)
        with self._lock:
            rows = self._db.execute(sql, args).fetchall()
        return [_job(r) for r in rows]

    def prune_finished(self, keep: int) -> list[str]:
        """Forget finished jobs (record and events) beyond the `keep` most recently updated;
        returns their ids, oldest first. Unfinished jobs are never touched."""
        marks = ", ".join("?" for _ in TERMINAL)
        with self._lock, self._write():
            rows = self._db.execute(
                f"SELECT job_id FROM jobs WHERE state IN ({marks}) "
                f"ORDER BY updated_at DESC, job_id LIMIT -1 OFFSET ?",
                (*TERMINAL, max(0, keep))).fetchall()
            gone = [r[0] for r in rows][::-1]
            for job_id in gone:
                self._db.execute("DELETE FROM events WHERE job_id = ?", (job_id,))
                self._db.execute("DELETE FROM jobs WHERE job_id = ?", (job_id,))
                self._next_seq.pop(job_id, None)
                self._steps_since_prune.pop(job_id, None)
        return gone

    def unfinished(self) -> list[JobRecord]:
        """Jobs a restarted service must resume, oldest first (they were submitted first)."""
        jobs = [j for j in self.list_jobs() if not j.terminal]
        return sorted(jobs, key=lambda j: (j.created_at, j.job_id))

    def set_state(self, job_id: str, state: str, cause: str | None = None,
                  status: dict[str, Any] | None = None) -> None:
        with self._lock, self._write():
            self._set_state(job_id, state, cause, status)

    def _set_state(self, job_id: str, state: str, cause: str | None,
                   status: dict[str, Any] | None) -> None:
        sets, args = ["state = ?", "updated_at = ?"], [state, time.time()]
        if cause is not None:
            sets.append("cause = ?")
            args.append(cause)
        if status is not None:
            sets.append("status_json = ?")
            args.append(json.dumps(status, default=str))
        self._db.execute(f"UPDATE jobs SET {', '.join(sets)} WHERE job_id = ?", args + [job_id])

    def save_status(self, job_id: str, status: dict[str, Any]) -> None:
        with self._lock, self._write():
            self._db.execute("UPDATE jobs SET status_json = ?, updated_at = ? WHERE job_id = ?",
                             (json.dumps(status, default=str), time.time(), job_id))

    # ---- durable requests ------------------------------------------------------------------
    def request_cancel(self, job_id: str, reason: str) -> EventRecord:
        """Record a cancel request in the job's history before anyone acts on it.

        Why an event: it is durable and atomic like every other event, WatchJob shows it, and a
        service killed before the controller acted finds it (`cancel_requested`) on restart
        and cancels the job instead of resuming it."""
        return self.append_event(job_id, {"event": CANCEL_REQUESTED, "job": job_id,
                                          "reason": reason, "time": time.time()})

    def cancel_requested(self, job_id: str) -> bool:
        with self._lock:
            row = self._db.execute("SELECT 1 FROM events WHERE job_id = ? AND kind = ? LIMIT 1",
                                   (job_id, CANCEL_REQUESTED)).fetchone()
        return row is not None

    # ---- events ----------------------------------------------------------------------------
    def append_event(self, job_id: str, event: dict[str, Any],
                     status: dict[str, Any] | None = None) -> EventRecord:
        """Append one event (and, for `state` events, move the job's state) atomically."""
        kind, now = str(event.get("event", "")), time.time()
        when = event.get("time")  # where it happened (a rank's step): keep it, never restamp
        now = float(when) if isinstance(when, (int, float)) and not isinstance(when, bool) else now
        step = event.get("step")
        step = int(step) if isinstance(step, (int, float)) and not isinstance(step, bool) else 0
        text = json.dumps(event, default=str)
        with self._lock, self._write():
            seq = self._seq(job_id)
            self._db.execute("INSERT INTO events (job_id, seq, time, kind, step, json) "
                             "VALUES (?, ?, ?, ?, ?, ?)", (job_id, seq, now, kind, step, text))
            if kind == "state" and event.get("state"):
                cause = str(event.get("reason", "")) if event["state"] == "FAILED" else None
                self._set_state(job_id, str(event["state"]), cause, status)
            elif status is not None:
                self._db.execute("UPDATE jobs SET status_json = ?, updated_at = ? WHERE job_id = ?",
                                 (json.dumps(status, default=str), now, job_id))
            if kind == "step":
                self._maybe_prune(job_id)
        return EventRecord(job_id, seq, now, kind, step, json.loads(text))

    def events(self, job_id: str, after_seq: int = 0, limit: int = 1000) -> list[EventRecord]:
        with self._lock:
            rows = self._db.execute(
                "SELECT job_id, seq, time, kind, step, json FROM events WHERE job_id = ? AND "
                "seq > ? ORDER BY seq LIMIT ?", (job_id, after_seq, max(1, limit))).fetchall()
        return [EventRecord(r[0], r[1], r[2], r[3], r[4], json.loads(r[5])) for r in rows]

    def last_seq(self, job_id: str) -> int:
        with self._lock:
            return self._peek_seq(job_id) - 1

    def _peek_seq(self, job_id: str) -> int:
        """The next seq of a job, without taking it; call with the lock held."""
        if job_id not in self._next_seq:
            row = self._db.execute("SELECT MAX(seq) FROM events WHERE job_id = ?",
                                   (job_id,)).fetchone()
            self._next_seq[job_id] = (row[0] or 0) + 1
        return self._next_seq[job_id]

    def _seq(self, job_id: str) -> int:
        """Take the next seq of a job; call with the lock held (inside the write)."""
        seq = self._peek_seq(job_id)
        self._next_seq[job_id] = seq + 1
        return seq

    def _maybe_prune(self, job_id: str) -> None:
        """Thin old step events; runs once per `step_tail` step events (lock and txn held)."""
        count = self._steps_since_prune.get(job_id, 0) + 1
        self._steps_since_prune[job_id] = count
        if count < self.step_tail:
            return
        self._steps_since_prune[job_id] = 0
        self._db.execute(
            "DELETE FROM events WHERE job_id = ? AND kind = 'step' AND step % ? != 0 AND seq < "
            "(SELECT seq FROM events WHERE job_id = ? AND kind = 'step' ORDER BY seq DESC "
            "LIMIT 1 OFFSET ?)", (job_id, self.step_every, job_id, self.step_tail - 1))

    def _write(self) -> "_Txn":
        return _Txn(self._db, self.path)


class _Txn:
    """BEGIN IMMEDIATE ... COMMIT, rolled back on error; sqlite errors become StoreError."""

    def __init__(self, db: sqlite3.Connection, path: Path) -> None:
        self.db, self.path = db, path

    def __enter__(self) -> None:
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as err:
            raise StoreError(f"job store {self.path}: cannot begin a write: {err}") from None

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if exc_type is None:
            try:
                self.db.execute("COMMIT")
                return False
            except sqlite3.Error as err:
                self._rollback()
                raise StoreError(f"job store {self.path}: commit failed: {err}") from None
        self._rollback()
        if isinstance(exc, sqlite3.Error):
            raise StoreError(f"job store {self.path}: {exc}") from None
        return False

    def _rollback(self) -> None:
        try:
            self.db.execute("ROLLBACK")
        except sqlite3.Error as err:  # nothing to roll back (sqlite already did): keep the cause
            logger.debug("rollback: %s", err)


def _own_state_dir(state_dir: Path) -> Any:
    """Hold an exclusive flock on `<state_dir>/lock` for the life of the process.

    Two servers on one state dir would each resume the same jobs. The kernel drops the lock
    when the holder dies, even by SIGKILL, so a restart never finds a stale lock.
    """
    handle = open(state_dir / LOCK_NAME, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "?"
        handle.close()
        raise StoreError(f"state dir {state_dir} is in use by another tenax serve "
                         f"(pid {holder})") from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def _add_owner_column(db: sqlite3.Connection) -> None:
    """A store written before jobs had owners gets the column (its jobs: owner '')."""
    columns = {row[1] for row in db.execute("PRAGMA table_info(jobs)")}
    if "owner" not in columns:
        db.execute("ALTER TABLE jobs ADD COLUMN owner TEXT NOT NULL DEFAULT ''")


def _job(row: tuple[Any, ...]) -> JobRecord:
    job_id, name, spec_json, state, cause, uri, status_json, created, updated, owner = row
    try:
        status = json.loads(status_json or "{}")
    except ValueError:
        status = {}
    return JobRecord(job_id, name, spec_json, state, cause, uri, status, created, updated,
                     owner)
