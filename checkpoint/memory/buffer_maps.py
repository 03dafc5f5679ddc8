"""BufferMaps: the shared mappings of reused tmpfs snapshot buffers, kept from one snapshot to
the next.

Why: a snapshot buffer is the same file (the same inode, renamed between `s<step>` and
`.partial`, snapshot_store.py) step after step, yet mapping it afresh for every snapshot and
unmapping it afterwards cost ~3 ms of CPU per 18 MiB here (populating and tearing down the
page tables of 4,600 pages) — as much as the copy itself. Writing through `os.write` instead
pays a page lookup per 4 KiB in the kernel (5.5-6 ms vs 3-4 ms for a copy into a mapping). So
the writer (a rank's copying thread, an agent receiving a replica) maps each buffer once and
keeps the mapping while the file lives.

What keeps this from pinning memory: a mapping keeps its file's pages even after the file is
deleted, so a mapping whose file has no name left (a pruned buffer, a dropped job) is closed
whenever another buffer is mapped (a buffer is deleted only when the writer moves on to new
ones: a new generation's series, a step written again), at most `limit` mappings are kept
(least recently used go first), and the owner calls `close()` when its job ends.

Every buffer is allocated before it is mapped (`reserve`): a tmpfs file cut to its size with
`ftruncate` alone is sparse, and a write through a mapping into a page the filesystem cannot
back (tmpfs full, or over its size limit) is SIGBUS, which kills the process. Allocated first,
a full tmpfs is a clean ENOSPC (`OSError`) that the caller can turn into "snapshots off".
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# Fault every page in when mapping, instead of one fault per 4 KiB page as it is first touched.
# Linux only; elsewhere the pages fault in as they are touched.
POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def reserve(fd: int, size: int, path: str) -> None:
    """Make `fd`'s file exactly `size` bytes with every page allocated now: OSError (ENOSPC
    when the filesystem is full) instead of a SIGBUS at the first write into a hole. On
    failure the file is cut to nothing, so a refused buffer holds no pages."""
    try:
        os.ftruncate(fd, size)
        if size:
            os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        if exc.errno == errno.ENOSPC:
            raise OSError(errno.ENOSPC, f"no space for {size} bytes", path) from None
        raise


@dataclass
class _Mapped:
    fd: int  # kept open: fstat tells whether the file still has a name
    size: int
    map: mmap.mmap


class BufferMaps:
    """Writable shared mappings of buffer files, by inode; thread-safe."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit: {limit} must be >= 1")
        self.limit = limit
        self._maps: OrderedDict[tuple[int, int], _Mapped] = OrderedDict()
        self._lock = threading.Lock()

    def mapping(self, path: str, size: int) -> mmap.mmap:
        """A writable shared mapping of `path`'s first `size` bytes (the file is created or
        cut to exactly `size`; size > 0). Bytes written through it are the file's bytes."""
        if size <= 0:
            raise ValueError(f"size: {size} must be > 0 to map {path}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            raise
        key = (st.st_dev, st.st_ino)
        with self._lock:
            held = self._maps.get(key)
            if held is not None and held.size == size and st.st_size == size:
                os.close(fd)
                self._maps.move_to_end(key)
                return held.map
            if held is not None:
                self._release(self._maps.pop(key))
        try:
            if st.st_size != size:  # a buffer of the right size was allocated when it was sized
                reserve(fd, size, path)
            mapped = _Mapped(fd, size, mmap.mmap(fd, size, flags=mmap.MAP_SHARED | POPULATE))
        except OSError:
            os.close(fd)
            raise
        with self._lock:
            if key in self._maps:  # mapped by another thread meanwhile: keep the newer one
                self._release(self._maps.pop(key))
            self._maps[key] = mapped
            self._evict()
        return mapped.map

    def _evict(self) -> None:
        """Close mappings of deleted files, then the least recently used beyond `limit`."""
        for key, held in list(self._maps.items()):
            try:
                gone = os.fstat(held.fd).st_nlink == 0
            except OSError:
                gone = True
            if gone:
                self._release(self._maps.pop(key))
        while len(self._maps) > self.limit:
            self._release(self._maps.popitem(last=False)[1])

    @staticmethod
    def _release(held: _Mapped) -> None:
        try:
            held.map.close()
        except BufferError:  # a writer still holds a view: the mapping goes with its last view
            pass
        try:
            os.close(held.fd)
        except OSError:
            pass

    def forget_deleted(self) -> None:
        """Close now the mappings of buffers deleted since (their pages are freed)."""
        with self._lock:
            self._evict()

    def __len__(self) -> int:
        return len(self._maps)

    def close(self) -> None:
        """Unmap everything (the pages of deleted files are freed now)."""
        with self._lock:
            while self._maps:
                self._release(self._maps.popitem()[1])
