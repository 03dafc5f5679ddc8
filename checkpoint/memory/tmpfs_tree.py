"""The snapshot tree on a node's tmpfs: where it is, that it is ours alone, and which jobs in
it are gone.

Where: `$TENAX_SNAPSHOT_DIR`, else /dev/shm, else the temp dir, under
`tenax-snapshots-<uid>`. /dev/shm is writable by every user, so the directory is checked
before it is used: created 0700, it must be a real directory (not a symlink: `os.lstat`),
owned by this user and closed to everyone else. If it is not (another user made it first, or a
link points elsewhere), snapshots go to a private directory made for this process next to it
(`mkdtemp`: 0700, a fresh name), with a warning; nothing is written through the unsafe one.
Every file in the tree is created 0600 and opened with O_NOFOLLOW.

Which jobs are gone: every agent that keeps a job's snapshots on this node holds a shared
`flock` on `<job dir>/.lock` for as long as it lives (`JobLock`); the kernel drops it when
the process dies, however it dies. A killed `tenax run` leaves its job directory behind, and
the next agent that starts on the node (`sweep_stale`) removes every job directory whose lock
it can take exclusively: no live process keeps it. It removes the directory while holding
that lock, and an agent that adopts a directory checks after locking that its lock file is
still the one on disk, so a directory is never removed under a live agent.
"""
from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import stat
import tempfile
import threading
import time

logger = logging.getLogger(__name__)

SNAPSHOT_ENV = "TENAX_SNAPSHOT_DIR"
LOCK_NAME = ".lock"
STALE_GRACE_S = 60.0  # a job directory without a lock file this old is a leftover
_private: dict[str, str] = {}  # unsafe expected root -> this process's private fallback
_private_lock = threading.Lock()


def _base() -> str:
    base = os.environ.get(SNAPSHOT_ENV)
    if not base:
        shm = "/dev/shm"
        base = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()
    return base


def unsafe_reason(path: str) -> str:
    """Why `path` may not hold snapshots ("" when it is a 0700 directory of this user)."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"cannot stat it: {exc}"
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid != os.getuid():
        return f"it is owned by uid {st.st_uid}, not {os.getuid()}"
    if st.st_mode & 0o077:
        return f"its mode is {stat.S_IMODE(st.st_mode):o}, not 700"
    return ""


def snapshot_root() -> str:
    """The checked root of this user's snapshot tree (created 0700 when missing)."""
    base = _base()
    root = os.path.join(base, f"tenax-snapshots-{os.getuid()}")
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        logger.debug("cannot create %s: %s", root, exc)
    why = unsafe_reason(root)
    if not why:
        return root
    with _private_lock:
        if root not in _private:
            _private[root] = tempfile.mkdtemp(prefix=f"tenax-snapshots-{os.getuid()}-",
                                              dir=base if os.path.isdir(base) else None)
            logger.warning("snapshot directory %s is not safe to use (%s); using the private "
                           "directory %s instead", root, why, _private[root])
        return _private[root]


def file_name_of(name: str) -> str:
    """`name` made a safe file name (a job id, a restore key)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:120].lstrip(".") or "job"


def job_dir(job_id: str) -> str:
    """The directory of one job's snapshots on this node."""
    return os.path.join(snapshot_root(), file_name_of(job_id))


def write_private(path: str, data: bytes) -> None:
    """Create or replace the contents of `path`: 0600, never through a symlink."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def used_bytes(path: str) -> int:
    """Bytes of memory the files under `path` hold (each inode once: restores hard-link)."""
    seen, total = set(), 0
    for base, _, names in os.walk(path):
        for name in names:
            try:
                st = os.lstat(os.path.join(base, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def free_space(path: str) -> tuple[str, int]:
    """(the existing directory measured, its filesystem's bytes free to this user) for `path`
    or its nearest existing parent; ("", -1) when none can be measured."""
    probe = os.path.abspath(path)
    while True:
        try:
            st = os.statvfs(probe)
            return probe, st.f_bavail * st.f_frsize
        except OSError:
            parent = os.path.dirname(probe)
            if parent == probe:
                return "", -1
            probe = parent


class JobLock:
    """This process's shared lock on one job directory: the job is live while it is held."""

    def __init__(self) -> None:
        self.path = ""
        self._fd: int | None = None

    def hold(self, path: str) -> None:
        """Hold `path`'s lock (creating the directory), releasing any other one held."""
        if path == self.path and self._fd is not None:
            return
        self.release()
        for _ in range(20):  # another try only when a sweep removed it meanwhile
            os.makedirs(path, mode=0o700, exist_ok=True)
            lock = os.path.join(path, LOCK_NAME)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a sweep removes this directory
            try:
                on_disk = os.stat(lock, follow_symlinks=False)
                ours = os.fstat(fd)
                if (on_disk.st_dev, on_disk.st_ino) == (ours.st_dev, ours.st_ino):
                    self.path, self._fd = path, fd
                    return
            except FileNotFoundError:
                pass
            os.close(fd)
        raise OSError(f"cannot lock the snapshot directory {path}")

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self.path, self._fd = "", None


def sweep_stale(root: str) -> list[str]:
    """Remove every job directory under `root` no live process holds; the paths removed."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    removed = []
    for name in names:
        path = os.path.join(root, name)
        if _remove_if_stale(path):
            removed.append(path)
    if removed:
        logger.info("removed %d snapshot director%s of jobs that are gone: %s", len(removed),
                    "y" if len(removed) == 1 else "ies", ", ".join(removed)[:500])
    return removed


def _remove_if_stale(path: str) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        return False
    try:
        fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:  # a leftover from before locks, or one being made right now
        if time.time() - st.st_mtime < STALE_GRACE_S:
            return False
        shutil.rmtree(path, ignore_errors=True)
        return True
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a live agent holds it
        shutil.rmtree(path, ignore_errors=True)  # under the lock: nobody adopts it half-gone
        return True
    finally:
        os.close(fd)
