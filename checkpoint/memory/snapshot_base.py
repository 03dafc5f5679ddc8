"""The base directory of the snapshot trees (`tmpfs_tree`): one every process of this user
picks alike, and one where no other user can swap our tree between its check and its use.

The candidates, in order: `$TENAX_SNAPSHOT_DIR` (made, 0700, when it does not exist yet: else
every process would fall back to a private tree no sweep or estimate ever sees), /dev/shm (when
it is a writable directory), the temp dir. A candidate is used only when it is a directory and
it and every directory above it (along the path as given and along the one its links resolve
to) belong to this user or root, and each of them that others may write to has the sticky bit.
Without that bit, whoever may write to a directory may rename or unlink the entries in it they
do not own: another user could move our checked tree (or the base itself) away and put their
own, or a link, in its place between our check and our use. /dev/shm and /tmp (root's, 1777)
pass. An unsafe candidate is never used: one warning per process names it, its mode in octal
and why, and the next candidate is tried. The choice depends on the file system alone, never on
the process, so the agents, the sweep and the controller's room estimate agree on it; when no
candidate is safe (`safe_base` is None), `snapshot_root` falls back to its per-process last
resort in the temp dir.
"""
from __future__ import annotations

import logging
import os
import stat
import tempfile
import threading

logger = logging.getLogger(__name__)

SNAPSHOT_ENV = "TENAX_SNAPSHOT_DIR"
SHM = "/dev/shm"
_OPEN = stat.S_IWGRP | stat.S_IWOTH  # others may add, rename and unlink entries
_warned: set[tuple[str, str]] = set()  # (candidate, why) already logged by this process
_warned_lock = threading.Lock()


def snapshot_base() -> str:
    """The directory this user's snapshot trees are under: the first safe candidate, else the
    temp dir (where `snapshot_root`'s last resort makes its private directory)."""
    return safe_base() or tempfile.gettempdir()


def safe_base() -> str | None:
    """The first safe candidate base directory (see the module docstring); None when none is."""
    candidates = []
    chosen = os.environ.get(SNAPSHOT_ENV)
    if chosen:
        if not os.path.lexists(chosen):
            makedirs_private(chosen)
        candidates.append(chosen)
    if os.path.isdir(SHM) and os.access(SHM, os.W_OK):
        candidates.append(SHM)
    candidates.append(tempfile.gettempdir())
    refused = []
    for base in candidates:
        why = unsafe_base_reason(base)
        if not why:
            _warn(refused, base)
            return base
        refused.append((base, why))
    _warn(refused, None)
    return None


def unsafe_base_reason(path: str) -> str:
    """Why `path` may not hold snapshot trees ("" when it may): it is not a directory, or it or
    a directory above it is another user's, or others may write to it without a sticky bit."""
    given = os.path.abspath(path)
    real = os.path.realpath(given)
    try:
        if not stat.S_ISDIR(os.stat(real).st_mode):
            return "it is not a directory"
    except OSError as exc:
        return f"cannot stat it: {exc}"
    for where in dict.fromkeys(_upwards(given) + _upwards(real)):
        why = _swappable(where)
        if why:
            return why
    return ""


def _upwards(path: str) -> list[str]:
    """`path` and every directory above it, up to /."""
    chain = [path]
    while os.path.dirname(chain[-1]) != chain[-1]:
        chain.append(os.path.dirname(chain[-1]))
    return chain


def _swappable(where: str) -> str:
    """Why another user may swap `where` or the entries in it ("" when none may)."""
    try:
        st = os.lstat(where)
    except OSError as exc:
        return f"cannot stat {where}: {exc}"
    if st.st_uid not in (0, os.getuid()):
        what = "it" if stat.S_ISLNK(st.st_mode) else "the entries in it"
        return f"{where} is owned by uid {st.st_uid} (not {os.getuid()} or root), who may " \
               f"replace {what}"
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISDIR(st.st_mode) and mode & _OPEN and not mode & stat.S_ISVTX:
        return (f"{where} has mode {mode:04o}: others may write to it and it has no sticky "
                f"bit, so another user may rename our tree away and put theirs in its place")
    return ""


def _mode_of(path: str) -> str:
    try:
        return f"{stat.S_IMODE(os.lstat(path).st_mode):04o}"
    except OSError:
        return "unknown"


def _warn(refused: list[tuple[str, str]], used: str | None) -> None:
    """One warning per process for each refused candidate, naming what stands in for it."""
    instead = used or "a private directory per process (not seen by the others)"
    for base, why in refused:
        with _warned_lock:
            if (base, why) in _warned:
                continue
            _warned.add((base, why))
        logger.warning("snapshot base directory %s (mode %s) is not safe to use: %s; every "
                       "process of uid %d uses %s instead", base, _mode_of(base), why,
                       os.getuid(), instead)


def makedirs_private(path: str) -> None:
    """`os.makedirs(path, exist_ok=True)` whose every directory made is 0700 (os.makedirs
    gives the parents it makes the default mode, 0755)."""
    parent = os.path.dirname(path)
    if parent and parent != path and not os.path.isdir(parent):
        makedirs_private(parent)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        if not os.path.isdir(path):
            raise


def few_inodes(path: str) -> str:
    """", N inodes" when the filesystem of `path` (or of its nearest existing parent) counts
    inodes and has few left (a tmpfs mounted with nr_inodes fails a mkdir with ENOSPC while
    bytes are free); "" otherwise."""
    probe = os.path.abspath(path)
    while True:
        try:
            st = os.statvfs(probe)
            break
        except OSError:
            if os.path.dirname(probe) == probe:
                return ""
            probe = os.path.dirname(probe)
    return f", {st.f_favail} inodes" if st.f_files and st.f_favail < 1024 else ""
