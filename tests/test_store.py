"""The job store of `tenax serve`: WAL sqlite, history, thinning, resume list, one owner."""
from __future__ import annotations

import sqlite3
import threading

import pytest

from tenax.orchestrator.errors import StoreError
from tenax.orchestrator.service.store import JobStore


def _spec(name: str = "job") -> str:
    return '{"name": "%s", "train": {"steps": 10}}' % name


@pytest.fixture
def store(tmp_path):
    s = JobStore(tmp_path)
    yield s
    s.close()


def test_store_uses_wal_and_other_connections_can_read(store, tmp_path):
    assert store.journal_mode.lower() == "wal"
    store.add_job("a-1", "a", _spec("a"), "file:///ckpt/a")
    reader = sqlite3.connect(tmp_path / "tenax.db", timeout=5)
    try:
        assert reader.execute("PRAGMA journal_mode").fetchone()[0].lower() == "wal"
        assert reader.execute("SELECT job_id, state FROM jobs").fetchall() == [("a-1", "PENDING")]
    finally:
        reader.close()


def test_state_events_move_the_job_and_failed_records_its_cause(store):
    store.add_job("a-1", "a", _spec(), "file:///ckpt/a")
    e1 = store.append_event("a-1", {"event": "state", "state": "RUNNING", "reason": "started"})
    e2 = store.append_event("a-1", {"event": "step", "step": 3, "loss": 4.5},
                            status={"step": 3, "loss": 4.5})
    e3 = store.append_event("a-1", {"event": "state", "state": "FAILED", "reason": "rank 1 died"})
    assert (e1.seq, e2.seq, e3.seq) == (1, 2, 3)
    job = store.get_job("a-1")
    assert job.state == "FAILED" and job.terminal and job.cause == "rank 1 died"
    assert job.status == {"step": 3, "loss": 4.5}
    history = store.events("a-1")
    assert [(e.kind, e.step) for e in history] == [("state", 0), ("step", 3), ("state", 0)]
    assert history[1].event == {"event": "step", "step": 3, "loss": 4.5}
    assert [e.seq for e in store.events("a-1", after_seq=1)] == [2, 3]
    assert [e.seq for e in store.events("a-1", after_seq=0, limit=2)] == [1, 2]
    assert store.get_job("nope") is None and store.events("nope") == []


def test_history_and_seq_survive_a_reopen_and_unfinished_jobs_are_listed(tmp_path):
    s = JobStore(tmp_path)
    for name, state in (("a", "RUNNING"), ("b", "SUCCEEDED"), ("c", "RESCALING"),
                        ("d", "CANCELLED"), ("e", "PENDING")):
        s.add_job(f"{name}-1", name, _spec(name), f"file:///ckpt/{name}")
        s.append_event(f"{name}-1", {"event": "state", "state": state, "reason": "x"})
    s.close()
    s = JobStore(tmp_path)
    try:
        assert [j.job_id for j in s.unfinished()] == ["a-1", "c-1", "e-1"]  # oldest first
        assert [j.job_id for j in s.list_jobs(("SUCCEEDED", "CANCELLED"))] == ["d-1", "b-1"]
        assert len(s.list_jobs(limit=2)) == 2 and len(s.list_jobs()) == 5
        assert s.last_seq("a-1") == 1
        assert s.append_event("a-1", {"event": "resumed"}).seq == 2  # continues, never repeats
        assert [e.kind for e in s.events("b-1")] == ["state"]
    finally:
        s.close()


def test_step_events_are_thinned_but_everything_else_is_kept(tmp_path):
    s = JobStore(tmp_path, step_every=5, step_tail=10)
    try:
        s.add_job("a-1", "a", _spec(), "file:///ckpt/a")
        for step in range(1, 101):
            s.append_event("a-1", {"event": "step", "step": step, "loss": 1.0 / step})
            if step % 20 == 0:
                s.append_event("a-1", {"event": "checkpoint", "step": step})
        events = s.events("a-1", limit=10_000)
        steps = [e.step for e in events if e.kind == "step"]
        assert [e.step for e in events if e.kind == "checkpoint"] == [20, 40, 60, 80, 100]
        assert steps[-10:] == list(range(91, 101))  # the tail is whole
        assert all(step % 5 == 0 for step in steps[:-10]) and 5 in steps and 3 not in steps
        seqs = [e.seq for e in events]
        assert seqs == sorted(seqs) and seqs[-1] == 105  # thinning never renumbers
    finally:
        s.close()


def test_concurrent_appends_get_unique_dense_seqs(store):
    store.add_job("a-1", "a", _spec(), "file:///ckpt/a")

    def append(n: int) -> None:
        for i in range(100):
            store.append_event("a-1", {"event": "chaos", "n": n, "i": i})

    threads = [threading.Thread(target=append, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert [e.seq for e in store.events("a-1", limit=1000)] == list(range(1, 401))


def test_one_server_owns_a_state_dir(tmp_path):
    first = JobStore(tmp_path, exclusive=True)
    try:
        with pytest.raises(StoreError, match="in use by another tenax serve"):
            JobStore(tmp_path, exclusive=True)
    finally:
        first.close()
    JobStore(tmp_path, exclusive=True).close()  # released on close (and by the kernel on death)


def test_unusable_state_dir_and_duplicate_ids_are_store_errors(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StoreError, match="cannot open the job store"):
        JobStore(blocker / "state")
    s = JobStore(tmp_path / "ok")
    try:
        s.add_job("a-1", "a", _spec(), "file:///ckpt/a")
        with pytest.raises(StoreError, match="UNIQUE"):
            s.add_job("a-1", "a", _spec(), "file:///ckpt/a")
        assert len(s.list_jobs()) == 1  # the failed insert was rolled back
    finally:
        s.close()
