"""The snapshot tree on tmpfs is ours alone (0700 directories, 0600 files, no symlinks
followed), and the job directories of processes that are gone are removed by the next agent."""
from __future__ import annotations

import logging
import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from tenax.checkpoint.memory.snapshot_store import SnapshotDir, SnapshotStamp, crc32c_of
from tenax.checkpoint.memory.tmpfs_tree import (LOCK_NAME, SNAPSHOT_ENV, JobLock, job_dir,
                                                snapshot_root, sweep_stale)

pytestmark = pytest.mark.timeout(120)

HOLD = """
import sys
from tenax.checkpoint.memory.tmpfs_tree import JobLock
lock = JobLock()
lock.hold(sys.argv[1])
print("held", flush=True)
sys.stdin.read()
"""


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def base(tmp_path, monkeypatch):
    monkeypatch.setenv(SNAPSHOT_ENV, str(tmp_path))
    return tmp_path


def _expected(base) -> str:
    return os.path.join(str(base), f"tenax-snapshots-{os.getuid()}")


def test_the_root_is_made_ours_alone_and_every_file_is_0600(base):
    root = snapshot_root()
    assert root == _expected(base) and _mode(root) == 0o700
    store = SnapshotDir(os.path.join(job_dir("j"), "slot", "local"))
    data = {"shard": b"x" * 100}
    store.write(SnapshotStamp(1, 0, 1, 3, {"shard": [100, crc32c_of([data["shard"]])]},
                              {"layout": {}}), data)
    store.mark_sent(1, 0, 3)
    for where, dirs, files in os.walk(root):
        for name in files:
            assert _mode(os.path.join(where, name)) == 0o600, (where, name)
        for name in dirs:
            if where.startswith(store.root):
                assert _mode(os.path.join(where, name)) == 0o700, (where, name)


@pytest.mark.parametrize("unsafe", ["symlink", "mode", "owner"])
def test_an_unsafe_root_is_never_used_and_a_private_one_is_said(base, tmp_path, unsafe, caplog):
    expected, elsewhere = _expected(base), tmp_path / "elsewhere"
    elsewhere.mkdir()
    if unsafe == "symlink":
        os.symlink(elsewhere, expected)
    else:
        os.mkdir(expected, 0o700)
        if unsafe == "mode":
            os.chmod(expected, 0o777)
        elif os.getuid() == 0:
            os.chown(expected, 54321, -1)
        else:
            pytest.skip("changing a directory's owner needs root")
    with caplog.at_level(logging.WARNING, logger="tenax.checkpoint.memory.tmpfs_tree"):
        root = snapshot_root()
    assert root != expected and _mode(root) == 0o700 and not os.path.islink(root)
    assert os.lstat(root).st_uid == os.getuid()
    assert snapshot_root() == root  # one private directory per process
    assert any("not safe" in r.getMessage() for r in caplog.records)
    SnapshotDir(os.path.join(job_dir("j"), "local")).write(
        SnapshotStamp(1, 0, 1, 3, {"f": [1, crc32c_of([b"y"])]}, {}), {"f": b"y"})
    assert list(elsewhere.iterdir()) == []  # nothing went through the unsafe one
    if unsafe != "symlink":
        assert os.listdir(expected) == []


def _holder(path: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, path], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_job_directory_is_removed_once_its_last_holder_is_gone(base):
    live, dead = job_dir("live-job"), job_dir("killed-job")
    keeper_of_live, killed = _holder(live), _holder(dead)
    for path in (live, dead):
        with open(os.path.join(path, "buffer"), "wb") as f:
            f.write(b"x" * 4096)
    try:
        assert sweep_stale(snapshot_root()) == []  # both held
        killed.send_signal(signal.SIGKILL)  # as a killed `tenax run` leaves it
        killed.wait(timeout=30)
        assert sweep_stale(snapshot_root()) == [dead]
        assert os.path.exists(os.path.join(live, "buffer")) and not os.path.exists(dead)
    finally:
        keeper_of_live.stdin.close()
        keeper_of_live.wait(timeout=30)
    assert sweep_stale(snapshot_root()) == [live]


def test_the_next_agent_to_start_removes_what_a_killed_job_left(base):
    from tenax.workers.snapshot_keeper import SnapshotKeeper

    dead = job_dir("killed-run")
    killed = _holder(dead)
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=30)
    keeper = SnapshotKeeper()
    keeper.configure("running-job", 0, None, 1)
    deadline = time.monotonic() + 30
    while os.path.exists(dead):
        assert time.monotonic() < deadline, "the leftover was not removed"
        time.sleep(0.02)
    assert os.path.exists(keeper.local_dir)  # its own job is held, never swept
    assert sweep_stale(snapshot_root()) == []
    keeper.drop_job()


def test_a_directory_swept_while_a_holder_waits_is_made_again_for_it(base):
    """The holder locks after the sweep removed the directory: it makes it anew, never keeps
    a lock on a file no longer on disk."""
    path = job_dir("raced")
    first = JobLock()
    first.hold(path)
    first.release()
    assert sweep_stale(snapshot_root()) == [path]
    second = JobLock()
    second.hold(path)
    assert os.path.exists(os.path.join(path, LOCK_NAME))
    assert sweep_stale(snapshot_root()) == []
    second.release()
