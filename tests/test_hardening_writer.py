"""A writer given up on never commits; a failed save leaves no partial dir.

`GatedFileSystem` is a real local filesystem registered as `gatedfile://` whose reads of one
chosen file wait until the test opens the gate: the commit's checksum pass of a late writer is
held there (as a slow disk would hold it) while the manager gives up on it and starts the next
save.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import fsspec
import pytest
from fsspec.implementations.local import LocalFileSystem

from tenax.checkpoint.format.catalog import Catalog
from tenax.checkpoint.format.storage import Storage
from tenax.checkpoint.manager import CheckpointManager
from tests.ckpt_jobs import DictState, ckpt_config


class GatedFileSystem(LocalFileSystem):
    protocol = "gatedfile"
    hold: str = ""  # reads of a path containing this wait for `gate`
    reached, gate = threading.Event(), threading.Event()

    def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        if "r" in mode and self.hold and self.hold in str(path):
            GatedFileSystem.reached.set()
            GatedFileSystem.gate.wait(120)
        return super()._open(path, mode, *args, **kwargs)


fsspec.register_implementation("gatedfile", GatedFileSystem, clobber=True)


def test_a_writer_given_up_on_never_commits_later(tmp_path: Path) -> None:
    uri = f"gatedfile://{tmp_path}/ckpt"
    GatedFileSystem.hold = "step-00000001/__0_0.distcp"
    GatedFileSystem.reached.clear()
    GatedFileSystem.gate.clear()
    state = DictState()
    config = ckpt_config(uri, ["checkpoint.keep_last=5"])
    mgr = CheckpointManager(config, state, 0, 1, timeout_s=2, writer="thread")
    try:
        state.train()
        mgr.save(1)
        assert GatedFileSystem.reached.wait(60), "the commit never reached its checksum pass"
        state.train()
        mgr.save(2)  # gives up on step 1 (its deadline passed), then saves step 2
        GatedFileSystem.gate.set()  # the late writer of step 1 wakes up
        mgr.close()
        events = mgr.drain_events()
    finally:
        GatedFileSystem.gate.set()
        GatedFileSystem.hold = ""
        mgr.close()
    assert 1 in [e["step"] for e in events if e["event"] == "checkpoint_failed"], events
    # wait for step 1's writer thread: it is a daemon; its outcome is on storage
    catalog = Catalog(Storage(uri))
    for thread in threading.enumerate():
        if thread.name == "ckpt-writer-1":
            thread.join(60)
    assert 1 not in catalog.committed_steps()  # step 2 may commit or time out under load


def test_a_failed_save_removes_its_partial_directory(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    uri = f"file://{tmp_path}/ckpt"
    state = DictState()
    with CheckpointManager(ckpt_config(uri), state, 0, 1, timeout_s=30, writer="sync") as mgr:
        state.train()
        mgr.save(1)
        monkeypatch.setenv("TENAX_CKPT_FAULT", "fail")  # ENOSPC, as a full disk fails
        state.train()
        mgr.save(2)
        events = mgr.drain_events()
    assert [e["step"] for e in events if e["event"] == "checkpoint_failed"] == [2]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-00000001"]
    assert Catalog(Storage(uri)).committed_steps() == [1]
