"""The durable half of cancelling: an acknowledged cancel survives a server restart.

A real JobStore on disk and a real JobManager: the job is RUNNING in the store (as a server
killed mid-job leaves it), CancelJob's path persists the request, the "server" goes away before
any controller acts, and the next JobManager on the same state dir must cancel the job instead
of resuming it. No controller is ever started, so no Ray is needed.
"""
from __future__ import annotations

from pathlib import Path

from tenax.orchestrator.service.jobs import JobManager
from tenax.orchestrator.service.store import CANCEL_REQUESTED, JobStore


def running_job(store: JobStore, job_id: str) -> None:
    store.add_job(job_id, "j", "{}", f"file:///tmp/{job_id}")
    store.append_event(job_id, {"event": "state", "state": "RUNNING", "job": job_id})


def test_a_stored_cancel_request_is_honoured_after_a_restart(tmp_path: Path) -> None:
    store = JobStore(tmp_path, exclusive=True)
    running_job(store, "victim-1")
    JobManager(store).cancel("victim-1")  # the server dies before the controller acts
    store.close()

    store = JobStore(tmp_path, exclusive=True)
    try:
        assert JobManager(store).resume_unfinished() == []
        job = store.get_job("victim-1")
        assert job.state == "CANCELLED" and job.terminal
        kinds = [e.kind for e in store.events("victim-1")]
        assert kinds[-2:] == [CANCEL_REQUESTED, "state"]
        assert "not resumed" in store.events("victim-1")[-1].event["reason"]
    finally:
        store.close()


def test_a_job_without_a_cancel_request_is_not_cancelled(tmp_path: Path) -> None:
    store = JobStore(tmp_path, exclusive=True)
    try:
        running_job(store, "keeper-1")
        running_job(store, "victim-2")
        store.request_cancel("victim-2", "test")
        assert store.cancel_requested("victim-2") and not store.cancel_requested("keeper-1")
    finally:
        store.close()
