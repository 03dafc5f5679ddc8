"""The snapshot tree on a node's tmpfs: where it is, that it is ours alone, and which jobs in
it are gone.

Where: under the base directory, `tenax-snapshots-<uid>`. The base (`snapshot_base`: see that
module) is `$TENAX_SNAPSHOT_DIR` (made 0700 when missing), else /dev/shm, else the temp dir,
the first of them that no other user can swap entries in: one that others may write to without
the sticky bit (0777, not 1777), or that another user (not root) owns, is never used, nor one
below such a directory; a warning names it, its mode and why. /dev/shm is writable by every
user, so the tree directory is checked before it is used: created 0700, it must be a real
directory (not a symlink: `os.lstat`), owned by this user and closed to everyone else. A
directory of this user that is only too open (0755, as older versions made it) is tightened to
0700 once every entry in it is found to be this user's. Any other unsafe one (another user made
it first, a link points elsewhere, it holds another user's entries) is never written through:
snapshots go to the first safe `tenax-snapshots-<uid>-<n>` (n = 1, 2, ...) next to it, with a
warning naming the reason. Every process of the user walks the same lists, so the agents, the
sweep and the controller's room estimate all agree on one directory; only when no base or no
slot is safe does a process take a private `mkdtemp` directory of its own. Every file in the
tree is created 0600 with O_NOFOLLOW and every directory 0700.

Which jobs are gone: every agent that keeps a job's snapshots on this node holds a shared
`flock` on `<job dir>/.lock` for as long as it lives (`JobLock`); the kernel drops it when
the process dies, however it dies. A killed `tenax run` leaves its job directory behind, and
the next agent that starts on the node (`sweep_stale`) removes every job directory whose lock
it can take exclusively: no live process keeps it. It looks in every tree of this user under
the base: the shared one, its fallbacks and the per-process `mkdtemp` directories of older
versions (removed too once empty). It removes a directory while holding that lock, and an
agent that adopts a directory checks after locking that its lock file is still the one on
disk, so a directory is never removed under a live agent.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import shutil
import stat
import tempfile
import threading
import time

# SNAPSHOT_ENV, makedirs_private and snapshot_base are imported from here by other modules too
from tenax.checkpoint.memory.snapshot_base import (SNAPSHOT_ENV, makedirs_private, safe_base,
                                                   snapshot_base)

logger = logging.getLogger(__name__)

LOCK_NAME = ".lock"
STALE_GRACE_S = 60.0  # a job directory without a lock file this old is a leftover
FALLBACK_SLOTS = 16  # shared fallbacks tried before a private last resort
MAX_NAME = 120  # a file name's length here (names must stay well below NAME_MAX)
_SLOT = re.compile(r"\d{1,6}")  # a shared fallback's suffix; mkdtemp's are 8 other characters
_Identity = tuple[int, int, int, int]
_rejected: dict[str, tuple[_Identity, str]] = {}  # path -> (its state, why it was refused)
_said: set[tuple[str, str]] = set()  # (expected root, root used) already logged
_private: dict[str, str] = {}  # expected root -> this process's last-resort directory
_state_lock = threading.Lock()


def tree_name() -> str:
    """The name of this user's snapshot tree under the base."""
    return f"tenax-snapshots-{os.getuid()}"


def _reason_of(st: os.stat_result) -> str:
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid != os.getuid():
        return f"it is owned by uid {st.st_uid}, not {os.getuid()}"
    if st.st_mode & 0o077:
        return f"its mode is {stat.S_IMODE(st.st_mode):o}, not 700"
    return ""


def unsafe_reason(path: str) -> str:
    """Why `path` may not hold snapshots ("" when it is a 0700 directory of this user)."""
    try:
        return _reason_of(os.lstat(path))
    except OSError as exc:
        return f"cannot stat it: {exc}"


def snapshot_root() -> str:
    """The checked root of this user's snapshot tree (created 0700 when missing) under the
    base (`safe_base`): the shared one, else the first safe shared fallback next to it;
    the same in every process."""
    base = safe_base()
    if base is None:
        return _private_root(os.path.join(tempfile.gettempdir(), tree_name()), None,
                             "no snapshot base directory is safe to use")
    root = os.path.join(base, tree_name())
    why = _claim(root)
    if not why:
        _say(root, root, "")
        return root
    for n in range(1, FALLBACK_SLOTS + 1):
        slot = f"{root}-{n}"
        if not _claim(slot):
            _say(root, slot, why)
            return slot
    return _private_root(root, base, f"snapshot directory {root} is not safe to use ({why}) "
                                     f"and neither is any of {root}-1..{FALLBACK_SLOTS}")


def _private_root(root: str, where: str | None, why: str) -> str:
    """The last resort: a private directory of this process under `where` (None: the temp
    dir), made once per expected `root`."""
    with _state_lock:
        if root not in _private:
            _private[root] = tempfile.mkdtemp(prefix=f"{tree_name()}-", dir=where)
            logger.error("%s; this process uses the private directory %s: other processes "
                         "(the sweep, the controller's room estimate) do not see it", why,
                         _private[root])
        return _private[root]


def _say(root: str, used: str, why: str) -> None:
    """Log once per process which directory stands in for `root`, and why."""
    with _state_lock:
        if (root, used) in _said:
            return
        _said.add((root, used))
    if used != root:
        logger.warning("snapshot directory %s is not safe to use (%s); every process of uid %d "
                       "uses the shared fallback %s instead", root, why, os.getuid(), used)


def _claim(path: str) -> str:
    """Make `path` this user's 0700 directory if that is safe; why not ("" when it is)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        logger.debug("cannot create %s: %s", path, exc)
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"cannot stat it: {exc}"
    why = _reason_of(st)
    if why and stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
        return _tighten(path, st)  # ours, only too open (an older version made it 0755)
    return why


def _tighten(path: str, st: os.stat_result) -> str:
    """chmod 0700 a too-open directory of ours when all it holds is ours; why not ("": done).
    Checked again once closed: an entry made meanwhile puts its mode back, so every process
    keeps refusing it rather than one using it."""
    key: _Identity = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_mode)
    with _state_lock:
        known = _rejected.get(path)
    if known is not None and known[0] == key:
        return known[1]
    mode = stat.S_IMODE(st.st_mode)
    why = _foreign_entry(path)
    if not why:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:  # replaced by a link or removed meanwhile
            return f"cannot open it: {exc}"
        try:
            now = os.fstat(fd)
            if (now.st_dev, now.st_ino, now.st_uid) != (st.st_dev, st.st_ino, os.getuid()):
                return "it was replaced while being checked"
            os.fchmod(fd, 0o700)
            why = _foreign_entry(path)
            if why:
                os.fchmod(fd, mode)
        except OSError as exc:  # a read-only mount, say: still open, so not ours alone
            return f"its mode is {mode:o} and cannot be changed: {exc}"
        finally:
            os.close(fd)
    if why:
        why = f"its mode is {mode:o} and {why}"
        with _state_lock:
            _rejected[path] = (key, why)
        return why
    logger.warning("snapshot directory %s had mode %o (made by an older version?); every "
                   "entry in it is uid %d's: tightened to 700", path, mode, os.getuid())
    return ""


def _foreign_entry(path: str) -> str:
    """The first entry under `path` (links not followed) another user owns; "" when none."""
    uid = os.getuid()
    for where, dirs, files in os.walk(path):
        for name in dirs + files:
            full = os.path.join(where, name)
            try:
                owner = os.lstat(full).st_uid
            except FileNotFoundError:
                continue
            if owner != uid:
                return f"{full} in it is owned by uid {owner}"
    return ""


def file_name_of(name: str) -> str:
    """`name` made a safe file name (a job id, a restore key): unchanged when it already is
    one, else its safe characters and a digest of the whole name, so that two names never
    share a file however long they are or whatever they escape."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name).lstrip(".")
    if safe == name and len(name) <= MAX_NAME and name:
        return name
    digest = hashlib.sha1(name.encode("utf-8", "surrogatepass"),
                          usedforsecurity=False).hexdigest()[:12]
    return f"{safe[:MAX_NAME - 13] or 'job'}-{digest}"


def job_dir(job_id: str) -> str:
    """The directory of one job's snapshots on this node."""
    return os.path.join(snapshot_root(), file_name_of(job_id))


def write_private(path: str, data: bytes) -> None:
    """Create or replace the contents of `path`: 0600, never through a symlink."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        view = memoryview(data)
        if view.ndim != 1 or view.itemsize != 1:  # a typed buffer: offsets below are bytes
            view = view.cast("B")
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
            makedirs_private(path)
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


def snapshot_trees(base: str | None = None) -> list[str]:
    """Every snapshot tree of this user under `base` (None: the one in use, if any is safe):
    the shared one, its fallbacks and older versions' per-process directories; real
    directories of ours."""
    base = safe_base() if base is None else base
    if base is None:  # no safe one: never sweep where another user may swap entries
        return []
    name = tree_name()
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []
    trees = []
    for entry in names:
        if entry != name and not entry.startswith(f"{name}-"):
            continue
        path = os.path.join(base, entry)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
            trees.append(path)
    return trees


def sweep_stale(root: str | None = None) -> list[str]:
    """Remove every job directory no live process holds under `root`, or (None) under every
    tree of this user (`snapshot_trees`), and older versions' per-process trees left empty
    for STALE_GRACE_S; the paths removed."""
    removed = []
    for tree in [root] if root is not None else snapshot_trees():
        suffix = os.path.basename(tree)[len(tree_name()) + 1:]
        leftover = root is None and bool(suffix) and not _SLOT.fullmatch(suffix)
        idle = leftover and _untouched_for_grace(tree)  # before its own removals touch it
        removed += _sweep_tree(tree)
        if idle and _rmdir(tree):
            removed.append(tree)
    if removed:
        logger.info("removed %d snapshot director%s of jobs that are gone: %s", len(removed),
                    "y" if len(removed) == 1 else "ies", ", ".join(removed)[:500])
    return removed


def _sweep_tree(root: str) -> list[str]:
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return [path for path in (os.path.join(root, name) for name in names)
            if _remove_if_stale(path)]


def _untouched_for_grace(path: str) -> bool:
    try:
        return time.time() - os.lstat(path).st_mtime >= STALE_GRACE_S
    except OSError:
        return False


def _rmdir(path: str) -> bool:
    """Remove an older version's per-process tree if it is empty. One whose process still
    lives but holds no job yet is made again by that process's next `os.makedirs`."""
    try:
        os.rmdir(path)
    except OSError:  # not empty (a live job), or gone already
        return False
    return True


def _remove_if_stale(path: str) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
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
