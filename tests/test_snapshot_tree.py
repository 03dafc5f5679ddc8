"""The snapshot tree on tmpfs is ours alone (0700 directories, 0600 files, no symlinks
followed), and the job directories of processes that are gone are removed by the next agent."""
from __future__ import annotations

import logging
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time

import pytest

from tenax.checkpoint.memory.restore import assemble_version
from tenax.checkpoint.memory.snapshot_store import SnapshotDir, SnapshotStamp, crc32c_of
from tenax.checkpoint.memory.tmpfs_tree import (LOCK_NAME, SNAPSHOT_ENV, JobLock, file_name_of,
                                                job_dir, snapshot_root, sweep_stale)

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


ROOT_OF = """
from tenax.checkpoint.memory.tmpfs_tree import snapshot_root
print(snapshot_root())
"""
STRANGER = 54321  # a uid that is not ours


def _root_in_another_process() -> str:
    done = subprocess.run([sys.executable, "-c", ROOT_OF], capture_output=True, text=True,
                          timeout=60, check=True)
    return done.stdout.strip()


def _needs_root() -> None:
    if os.getuid() != 0:
        pytest.skip("giving a file another owner needs root")


def test_a_snapshot_dir_not_made_yet_is_made_not_swapped_for_a_private_one(tmp_path,
                                                                            monkeypatch):
    """A $TENAX_SNAPSHOT_DIR that does not exist yet is made (0700): each process used to
    take a private `mkdtemp` in the system temp dir instead, which no sweep ever removed."""
    missing = tmp_path / "not" / "made"
    monkeypatch.setenv(SNAPSHOT_ENV, str(missing))
    assert snapshot_root() == _expected(missing) and _mode(str(missing)) == 0o700


def test_a_too_open_root_of_ours_is_tightened_and_used_by_every_process(base, caplog):
    expected = _expected(base)
    os.mkdir(expected, 0o700)
    os.makedirs(os.path.join(expected, "older-job", "slot"))  # what an older version left
    os.chmod(expected, 0o755)
    with caplog.at_level(logging.WARNING, logger="tenax.checkpoint.memory.tmpfs_tree"):
        assert snapshot_root() == expected
    assert _mode(expected) == 0o700
    assert any("tightened to 700" in r.getMessage() for r in caplog.records)
    assert _root_in_another_process() == expected
    assert not [n for n in os.listdir(base) if n != os.path.basename(expected)]  # no fallback


@pytest.mark.parametrize("unsafe", ["symlink", "owner", "foreign-entry"])
def test_an_unsafe_root_is_never_used_and_every_process_shares_one_fallback(base, tmp_path,
                                                                            unsafe, caplog):
    expected, elsewhere = _expected(base), tmp_path / "elsewhere"
    elsewhere.mkdir()
    if unsafe == "symlink":
        os.symlink(elsewhere, expected)
        reason = "symbolic link"
    else:
        _needs_root()
        os.mkdir(expected, 0o700)
        if unsafe == "owner":
            os.chown(expected, STRANGER, -1)
            reason = f"owned by uid {STRANGER}"
        else:  # ours but open, and another user already put something in it
            os.mkdir(os.path.join(expected, "planted"))
            os.chown(os.path.join(expected, "planted"), STRANGER, -1)
            os.chmod(expected, 0o777)
            reason = f"planted in it is owned by uid {STRANGER}"
    with caplog.at_level(logging.WARNING, logger="tenax.checkpoint.memory.tmpfs_tree"):
        root = snapshot_root()
    assert root == f"{expected}-1" and _mode(root) == 0o700 and not os.path.islink(root)
    assert os.lstat(root).st_uid == os.getuid()
    assert snapshot_root() == root
    assert _root_in_another_process() == root  # the agents, the sweep and the controller agree
    said = [r.getMessage() for r in caplog.records if "not safe" in r.getMessage()]
    assert len(said) == 1 and reason in said[0] and root in said[0], said
    SnapshotDir(os.path.join(job_dir("j"), "local")).write(
        SnapshotStamp(1, 0, 1, 3, {"f": [1, crc32c_of([b"y"])]}, {}), {"f": b"y"})
    assert list(elsewhere.iterdir()) == []  # nothing went through the unsafe one
    if unsafe != "symlink":
        assert os.listdir(expected) == ([] if unsafe == "owner" else ["planted"])
        assert _mode(expected) == (0o700 if unsafe == "owner" else 0o777)  # left as it was


def test_an_unsafe_fallback_is_skipped_the_same_way(base, tmp_path):
    expected = _expected(base)
    os.symlink(tmp_path, expected)
    os.symlink(tmp_path, f"{expected}-1")
    assert snapshot_root() == f"{expected}-2" == _root_in_another_process()
    assert _mode(f"{expected}-2") == 0o700


BASE_LOG = "tenax.checkpoint.memory.snapshot_base"


def _base_warnings(caplog, chosen) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == BASE_LOG and f"directory {chosen} " in r.getMessage()]


@pytest.mark.parametrize("mode", [0o1777, 0o700, 0o755])
def test_a_base_only_we_can_swap_entries_in_is_used(tmp_path, monkeypatch, caplog, mode):
    """Sticky (as /dev/shm and /tmp are) or closed to others: used as it is, no warning."""
    chosen = tmp_path / "base"
    chosen.mkdir()
    os.chmod(chosen, mode)
    monkeypatch.setenv(SNAPSHOT_ENV, str(chosen))
    with caplog.at_level(logging.WARNING, logger=BASE_LOG):
        assert snapshot_root() == _expected(chosen) == _root_in_another_process()
    assert _base_warnings(caplog, chosen) == [] and _mode(str(chosen)) == mode


def _make_unsafe(tmp_path, unsafe: str) -> tuple[str, str]:
    """A base (as $TENAX_SNAPSHOT_DIR names it) another user could swap entries in, and what
    the warning must say."""
    chosen = tmp_path / "base"
    if unsafe in ("world", "group"):  # writable by others, no sticky bit
        chosen.mkdir()
        mode = 0o777 if unsafe == "world" else 0o770
        os.chmod(chosen, mode)
        return str(chosen), f"mode {mode:04o}: others may write to it and it has no sticky bit"
    if unsafe == "parent":  # ours and 0700, made now, but in an open directory
        os.chmod(tmp_path, 0o777)
        return str(chosen), f"{tmp_path} has mode 0777"
    if unsafe == "link":  # a link to an open directory
        (tmp_path / "open").mkdir()
        os.chmod(tmp_path / "open", 0o777)
        os.symlink(tmp_path / "open", chosen)
        return str(chosen), f"{tmp_path / 'open'} has mode 0777"
    chosen.mkdir()  # another user's: they may rename what is in it, sticky or not
    os.chown(chosen, STRANGER, -1)
    os.chmod(chosen, 0o1755)
    return str(chosen), f"owned by uid {STRANGER}"


@pytest.mark.parametrize("unsafe", ["world", "group", "parent", "link", "stranger"])
def test_a_base_others_may_swap_entries_in_is_never_used(tmp_path, monkeypatch, caplog, unsafe):
    """Without the sticky bit anyone who may write to the base may rename our checked tree
    away and put theirs in its place: the next safe default stands in, the same in every
    process, and one warning names the base, its mode and why. (As root the permission
    checks are bypassed, so this holds the mode logic, not another user's access.)"""
    if unsafe == "stranger":
        _needs_root()
    chosen, reason = _make_unsafe(tmp_path, unsafe)
    monkeypatch.setenv(SNAPSHOT_ENV, chosen)
    with caplog.at_level(logging.WARNING, logger=BASE_LOG):
        root = snapshot_root()
        assert snapshot_root() == root  # warned once per process
    real = os.path.realpath(chosen)
    assert not root.startswith((chosen + os.sep, real + os.sep)), root
    assert os.path.dirname(root) in ("/dev/shm", tempfile.gettempdir()), root
    assert os.path.basename(root).startswith(f"tenax-snapshots-{os.getuid()}")
    assert _root_in_another_process() == root
    said = _base_warnings(caplog, chosen)
    assert len(said) == 1 and reason in said[0] and os.path.dirname(root) in said[0], said
    assert f"(mode {_mode(chosen):04o})" in said[0], said
    assert os.listdir(chosen) == []  # nothing made in it
    if unsafe == "parent":  # a missing $TENAX_SNAPSHOT_DIR is still made, 0700
        assert _mode(chosen) == 0o700


def test_restore_files_are_ours_alone(base):
    """An assembled restore: 0700 directories, 0600 files (the manifest too), written or
    linked."""
    data = {"a.bin": b"a" * 64, "b.bin": b"b" * 32}
    commit = {"layout": {}, "model_hash": "m", "data_cursor": 0, "seed": 1, "lr_step": 3,
              "extra": {}}
    stamps = [SnapshotStamp(1, rank, 2, 3, {name: [len(data[name]), crc32c_of([data[name]])]},
                            commit) for rank, name in enumerate(sorted(data))]
    held = SnapshotDir(os.path.join(job_dir("j"), "slot", "local"))
    held.write(stamps[1], {"b.bin": data["b.bin"]})
    linked = os.path.join(held.series(1, 1), "s3")
    restore = os.path.join(job_dir("j"), "restore", "g1", "key")
    uri = assemble_version(restore, [(stamps[0], {"a.bin": data["a.bin"]}),
                                     (stamps[1], linked)])
    assert uri == f"file://{restore}"
    seen = set()
    for where, dirs, files in os.walk(os.path.join(job_dir("j"), "restore")):
        assert _mode(where) == 0o700, where
        for name in files:
            assert _mode(os.path.join(where, name)) == 0o600, (where, name)
            seen.add(name)
    assert {"a.bin", "b.bin", "manifest.json"} <= seen


@pytest.mark.parametrize("name", ["../escape", "sub/x", "manifest.json", ".."])
def test_a_restore_writes_only_plain_names_inside_its_version(base, name):
    from tenax.checkpoint.errors import SnapshotError

    stamp = SnapshotStamp(1, 0, 1, 3, {name: [1, crc32c_of([b"z"])]},
                          {"layout": {}, "model_hash": "m", "data_cursor": 0, "seed": 1,
                           "lr_step": 3, "extra": {}})
    restore = os.path.join(job_dir("j"), "restore", "g1", "key")
    with pytest.raises(SnapshotError, match="not a plain file name"):
        assemble_version(restore, [(stamp, {name: b"z"})])
    assert not os.path.exists(os.path.join(restore, "escape"))
    assert not os.path.exists(os.path.join(job_dir("j"), "restore", "g1", "escape"))


def test_file_names_are_kept_when_safe_and_never_shared_when_changed():
    import hashlib

    for name in ("tiny-llama", "job_1.a-B", "x" * 120):
        assert file_name_of(name) == name  # the directories of running jobs keep their names
    long_a, long_b = "j" * 150 + "a", "j" * 150 + "b"
    for name in (long_a, long_b, "a/b", "../up", "", "."):
        got = file_name_of(name)
        assert len(got) <= 120 and not got.startswith(".") and "/" not in got, got
        assert got.endswith("-" + hashlib.sha1(name.encode()).hexdigest()[:12]), got
    assert file_name_of(long_a) != file_name_of(long_b)
    assert file_name_of("a/b") != file_name_of("a_b")


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


@pytest.mark.parametrize("where", ["shared", "fallback", "older-private"])
def test_the_next_agent_to_start_removes_what_a_killed_job_left(base, tmp_path, where):
    from tenax.workers.snapshot_keeper import SnapshotKeeper

    if where == "fallback":  # the shared root is unsafe: every process uses the same fallback
        os.symlink(tmp_path, _expected(base))
    dead = job_dir("killed-run")
    if where == "older-private":  # an older version's per-process `mkdtemp` tree
        dead = os.path.join(f"{_expected(base)}-k3x9q_2z", "killed-run")
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
    for where, _, _ in os.walk(keeper.job_root):  # slot, local and replica: ours alone
        assert _mode(where) == 0o700, where
    assert sweep_stale(snapshot_root()) == []
    keeper.drop_job()


def _age(path: str) -> None:
    then = time.time() - 3600
    os.utime(path, (then, then))


def test_the_sweep_covers_every_tree_of_ours_and_never_a_live_job(base, tmp_path):
    """The shared fallback and older versions' per-process trees are swept too: their dead
    jobs go, and a per-process tree goes once it is empty and idle; live jobs, the shared
    trees themselves and another user's tree stay."""
    expected = _expected(base)
    os.symlink(tmp_path / "elsewhere", expected)  # unsafe: the fallback is in use
    fallback = snapshot_root()
    assert fallback == f"{expected}-1"
    old_busy, old_dead, old_empty, fresh_empty, theirs = (
        f"{expected}-{s}" for s in ("abcd1234", "ijkl9012", "efgh5678", "mnop3456", "qrst7890"))
    dead = [os.path.join(fallback, "killed"), os.path.join(old_busy, "killed"),
            os.path.join(old_dead, "killed")]
    live = os.path.join(old_busy, "live")
    keeper_of_live = _holder(live)
    for path in dead:
        killed = _holder(path)
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
    for path in (old_empty, fresh_empty):
        os.mkdir(path, 0o700)
    stranger_job = os.path.join(theirs, "lockless")
    if os.getuid() == 0:
        os.makedirs(stranger_job)
        _age(stranger_job)  # a lockless leftover of ours this old would go
        os.chown(theirs, STRANGER, -1)
    for path in (old_busy, old_dead, old_empty):
        _age(path)
    try:
        removed = sweep_stale()
        assert sorted(removed) == sorted(dead + [old_dead, old_empty])
        assert os.path.exists(os.path.join(live, LOCK_NAME))
        assert os.path.isdir(fallback) and os.path.isdir(fresh_empty)
        assert os.path.isdir(old_busy)  # it still holds a live job
        if os.getuid() == 0:
            assert os.path.isdir(stranger_job)
    finally:
        keeper_of_live.stdin.close()
        keeper_of_live.wait(timeout=30)
    assert sweep_stale() == [live]  # touched just now: the tree waits for the grace


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
