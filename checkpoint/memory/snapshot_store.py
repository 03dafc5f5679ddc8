"""SnapshotDir: one rank's in-memory snapshots (or a peer's replica of them) on host tmpfs.

Why files in tmpfs (`/dev/shm` by default, `TENAX_SNAPSHOT_DIR` to override): the training
process writes them and dies without taking them along, the rank's agent (a Ray actor that
outlives it) serves them, and they are plain memory — no disk is touched. Nothing outside
Tenax's agents reads them: a node whose agents are gone counts as having none, even where (as
in a one-machine test cluster) the files would still be there.

Layout and protocol (the in-memory twin of manifest-last):

    <dir>/g<generation>-r<rank>/s<step>.partial/   written here first
    <dir>/g<generation>-r<rank>/s<step>/<shard file>, .metadata (rank 0), stamp.json

A snapshot is complete iff its directory has lost the `.partial` suffix, which happens only
after every byte and then `stamp.json` (a `SnapshotStamp`, snapshot_stamp.py) were written. A
process killed mid-copy leaves a `.partial` directory that is never read (the next write reuses
it). Reads check every file's size and checksum against the stamp, so a torn or damaged
snapshot is refused, not loaded. The newest `keep` complete snapshots (by write order, not
step: a job that fell back to an older storage step writes lower steps later) stay; other
generations' leftovers go.

Buffers are reused, not reallocated: a new snapshot is written over the pages of an old one
(renamed to `.partial` first, so it turns invisible before a byte changes). Allocating fresh
tmpfs pages every step cost more than twice the copy itself.
"""
from __future__ import annotations

import logging
import mmap
import os
import shutil
from typing import Any, Callable, Iterable

import numpy as np  # at import, not at the first restore: importing it in an agent takes 0.2 s

from tenax.checkpoint.errors import SnapshotError
from tenax.checkpoint.format.split_crc import buffer_crc32c
from tenax.checkpoint.memory.buffer_maps import BufferMaps, reserve
# The stamp's names stay importable from here (where they were first defined)
from tenax.checkpoint.memory.snapshot_stamp import SnapshotStamp, crc32c_of
# The tree's names stay importable from here (where they were first defined)
from tenax.checkpoint.memory.tmpfs_tree import (SNAPSHOT_ENV, job_dir, makedirs_private,
                                                snapshot_root, write_private)
from tenax.checkpoint.save.writer import write_all

logger = logging.getLogger(__name__)

__all__ = ["SNAPSHOT_ENV", "SnapshotDir", "SnapshotStamp", "allocate", "crc32c_of", "job_dir",
           "overwrite", "snapshot_root"]

STAMP_NAME = "stamp.json"
SENT_NAME = "sent"
PARTIAL = ".partial"
MAX_STAMP_BYTES = 1 << 20


def overwrite(path: str, views: Iterable[memoryview],
              each: Callable[[memoryview], None] | None = None) -> int:
    """Write the views one after another into `path` over its existing pages (no truncation
    first: a reused tmpfs buffer keeps its pages), then cut it to the bytes written. `each`
    sees every view before it is written (a running checksum)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    written = 0
    try:
        for view in views:
            if each is not None:
                each(view)
            written += write_all(fd, view)
        os.ftruncate(fd, written)
    finally:
        os.close(fd)
    return written


def _safe_name(name: str) -> str:
    if not name or "/" in name or name.startswith("..") or name in (STAMP_NAME, "."):
        raise SnapshotError(f"snapshot file name {name!r} is not a plain file name")
    return name


class SnapshotDir:
    """The snapshots of one (generation, rank) series under `root`, newest `keep` kept."""

    def __init__(self, root: str, keep: int = 2) -> None:
        """`keep` buffers per series. Once `keep` are held a new snapshot rewrites the oldest
        one's pages in place (rewriting tmpfs pages costs a fraction of allocating fresh
        ones). With keep 2 the newest stays complete while the other is rewritten; a replica
        (keep 2 as well, workers/snapshot_keeper.py) is rewritten only once its successor's
        bytes are all on this node."""
        if keep < 1:
            raise ValueError(f"keep: {keep} must be >= 1")
        self.root, self.keep = root, keep

    def series(self, generation: int, rank: int) -> str:
        return os.path.join(self.root, f"g{generation}-r{rank}")

    # ---- write ---------------------------------------------------------------------------
    def begin(self, generation: int, rank: int, step: int) -> str:
        """The `.partial` directory to write this step into: a reused buffer when `keep` are
        held (see __init__), else a fresh one; other leftovers of a killed writer go."""
        series = self.series(generation, rank)
        makedirs_private(series)  # its parents too: os.makedirs would make them 0755
        path = os.path.join(series, f"s{step}{PARTIAL}")
        reuse = self._reusable(series, generation, rank)
        if reuse is None:
            shutil.rmtree(path, ignore_errors=True)
            os.makedirs(path, mode=0o700)
        elif reuse != path:
            shutil.rmtree(path, ignore_errors=True)
            os.rename(reuse, path)  # atomic: a complete buffer turns invisible before rewriting
        for name in os.listdir(series):
            if name.endswith(PARTIAL) and name != os.path.basename(path):
                shutil.rmtree(os.path.join(series, name), ignore_errors=True)
        try:
            os.unlink(os.path.join(path, STAMP_NAME))
        except FileNotFoundError:
            pass
        return path

    def _reusable(self, series: str, generation: int, rank: int) -> str | None:
        partials = sorted(n for n in os.listdir(series) if n.endswith(PARTIAL))
        if partials:  # what a killed writer left: its pages serve again
            return os.path.join(series, partials[0])
        mine = [s for s in self.complete() if (s.generation, s.rank) == (generation, rank)]
        return self._path(mine[-1]) if len(mine) >= self.keep else None

    def publish(self, partial: str, stamp: SnapshotStamp) -> None:
        """Stamp last, then the rename that makes the snapshot complete; then prune."""
        for name in set(os.listdir(partial)) - set(stamp.files):  # a reused buffer's extras
            os.unlink(os.path.join(partial, name))
        write_private(os.path.join(partial, STAMP_NAME), stamp.to_json().encode())
        final = partial[:-len(PARTIAL)]
        if os.path.exists(final):  # the same step written again (e.g. after a restore)
            shutil.rmtree(final, ignore_errors=True)
        os.rename(partial, final)
        self.prune(stamp.generation)

    def write(self, stamp: SnapshotStamp, files: dict[str, Any]) -> None:
        """Write a whole snapshot held in memory (each file bytes or a flat buffer such as a
        numpy array). A peer's replica arrives through `receive` instead, straight off the
        wire."""
        partial = self.begin(stamp.generation, stamp.rank, stamp.step)
        for name, data in files.items():
            overwrite(os.path.join(partial, _safe_name(name)), [memoryview(data).cast("B")])
        self.publish(partial, stamp)

    def receive(self, partial: str, stamp: SnapshotStamp,
                fill: Callable[[str, memoryview], int], maps: BufferMaps) -> None:
        """Fill a `.partial` directory (from `begin`) with bytes that arrive from elsewhere:
        `fill(name, view)` fills each file's mapped pages, in name order (a reused buffer of
        the same size keeps its pages and, through the receiver's `maps`, its mapping), and
        returns the crc32c of what it wrote (computed as the bytes arrive: a second pass would
        read them back from memory); each must match the stamp's. The caller publishes.
        Every file is allocated before the first byte is asked for: a tmpfs without room is
        an OSError (ENOSPC) now, not a SIGBUS mid-way (buffer_maps.reserve)."""
        for name in sorted(stamp.files):
            allocate(os.path.join(partial, _safe_name(name)), stamp.files[name][0])
        for name in sorted(stamp.files):
            size, crc = stamp.files[name]
            path = os.path.join(partial, _safe_name(name))
            try:
                got = _fill(maps, path, size, name, fill)
            except (TimeoutError, ConnectionError):  # the link's fault: its caller says so
                raise
            except OSError as exc:  # e.g. the job ended and its directory went
                raise SnapshotError(f"replica of rank {stamp.rank} step {stamp.step}: {name}: "
                                    f"{exc}") from None
            if got != crc:
                raise SnapshotError(f"replica of rank {stamp.rank} step {stamp.step}: {name} "
                                    f"arrived damaged (checksum mismatch)")

    def prune(self, generation: int) -> None:
        """Keep each series' newest `keep` complete snapshots (by write time); drop the
        series of generations before g-1 (a recovery may still need g-1's newest step)."""
        kept: dict[tuple[int, int], int] = {}
        for stamp in self.complete():
            key = (stamp.generation, stamp.rank)
            kept[key] = kept.get(key, 0) + 1
            if kept[key] > self.keep:
                shutil.rmtree(self._path(stamp), ignore_errors=True)
        for name in self._series_names():
            gen = int(name[1:].split("-")[0])
            if gen < generation - 1:
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    def mark_sent(self, generation: int, rank: int, step: int) -> None:
        """The agent's word that `step` of this series reached the peer (or never will)."""
        path = os.path.join(self.series(generation, rank), SENT_NAME)
        tmp = f"{path}.{os.getpid()}.tmp"
        write_private(tmp, str(int(step)).encode())
        os.replace(tmp, path)

    def sent_step(self, generation: int, rank: int) -> int | None:
        try:
            with open(os.path.join(self.series(generation, rank), SENT_NAME)) as f:
                return int(f.read(32))
        except (OSError, ValueError):
            return None

    def drop(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    # ---- read ----------------------------------------------------------------------------
    def _series_names(self) -> list[str]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            head, _, tail = name.partition("-r")
            if head.startswith("g") and head[1:].isdigit() and tail.isdigit():
                out.append(name)
        return out

    def _path(self, stamp: SnapshotStamp) -> str:
        return os.path.join(self.series(stamp.generation, stamp.rank), f"s{stamp.step}")

    def complete(self) -> list[SnapshotStamp]:
        """Every complete snapshot here, newest written first (stamps only; no checksums)."""
        stamps = []
        for series in self._series_names():
            base = os.path.join(self.root, series)
            for name in os.listdir(base) if os.path.isdir(base) else []:
                if name.endswith(PARTIAL):
                    continue
                stamp = self.read_stamp(os.path.join(base, name))
                if stamp is not None:
                    stamps.append(stamp)
        return sorted(stamps, key=lambda s: s.written_at, reverse=True)

    @staticmethod
    def read_stamp(path: str) -> SnapshotStamp | None:
        try:
            with open(os.path.join(path, STAMP_NAME), "rb") as f:
                return SnapshotStamp.from_json(f.read(MAX_STAMP_BYTES))
        except (OSError, SnapshotError) as exc:
            logger.warning("ignoring snapshot %s: %s", path, exc)
            return None

    def _stamped(self, generation: int, rank: int, step: int) -> tuple[SnapshotStamp, str]:
        path = os.path.join(self.series(generation, rank), f"s{step}")
        stamp = self.read_stamp(path)
        if stamp is None:
            raise SnapshotError(f"no complete snapshot of rank {rank} step {step} "
                                f"(generation {generation}) under {self.root}")
        return stamp, path

    def mapped(self, generation: int, rank: int, step: int) -> tuple[SnapshotStamp, dict[str, Any]]:
        """The stamp and read-only numpy views of the files, mapped, not copied (what a
        restore's piece is sent through Ray from: it copies each view once into its object
        store, where bytes would be read, then pickled), each checked against the stamp's size
        and crc32c."""
        stamp, path = self._stamped(generation, rank, step)
        views: dict[str, Any] = {}
        for name, (size, _) in stamp.files.items():
            try:
                with open(os.path.join(path, _safe_name(name)), "rb") as f:
                    if os.fstat(f.fileno()).st_size != size:
                        raise SnapshotError(f"snapshot {path}: {name} is not {size} bytes")
                    views[name] = np.frombuffer(
                        mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED,
                                  prot=mmap.PROT_READ), dtype=np.uint8) \
                        if size else np.zeros(0, dtype=np.uint8)
            except OSError as exc:
                raise SnapshotError(f"snapshot {path}: {name}: {exc}") from None
            # the pages fault in on the checksum's threads, in parallel, not here in turn
            if buffer_crc32c(views[name]) != stamp.files[name][1]:
                raise SnapshotError(f"snapshot {path}: {name} is torn or damaged "
                                    f"(checksum mismatch)")
        return stamp, views

    def paths(self, generation: int, rank: int, step: int) -> tuple[SnapshotStamp, dict[str, str]]:
        """The stamp and the path of every file of a complete snapshot, sizes checked (what a
        replica is streamed from; the receiver checks the checksums)."""
        stamp, path = self._stamped(generation, rank, step)
        out = {}
        for name, (size, _) in stamp.files.items():
            out[name] = os.path.join(path, _safe_name(name))
            try:
                actual = os.stat(out[name]).st_size
            except OSError as exc:
                raise SnapshotError(f"snapshot {path}: {name}: {exc}") from None
            if actual != size:
                raise SnapshotError(f"snapshot {path}: {name} is not {size} bytes")
        return stamp, out

    def read(self, generation: int, rank: int, step: int) -> tuple[SnapshotStamp, dict[str, bytes]]:
        """The snapshot's stamp and files, each checked against the stamp's size and crc32c."""
        stamp, path = self._stamped(generation, rank, step)
        files = {}
        for name, (size, crc) in stamp.files.items():
            try:
                with open(os.path.join(path, _safe_name(name)), "rb") as f:
                    data = f.read()
            except OSError as exc:
                raise SnapshotError(f"snapshot {path}: {name}: {exc}") from None
            if len(data) != size or crc32c_of([data]) != crc:
                raise SnapshotError(f"snapshot {path}: {name} is torn or damaged "
                                    f"({len(data)} of {size} bytes, checksum mismatch)")
            files[name] = data
        return stamp, files


def allocate(path: str, size: int) -> None:
    """`path` made exactly `size` bytes, every page allocated (kept if it already is)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        if os.fstat(fd).st_size != size:
            reserve(fd, size, path)
    finally:
        os.close(fd)


def _fill(maps: BufferMaps, path: str, size: int, name: str,
          fill: Callable[[str, memoryview], int]) -> int:
    """`fill` the file's `size` bytes through its kept shared mapping; their crc32c (`fill`'s)."""
    if not size:
        crc = fill(name, memoryview(bytearray()))
        overwrite(path, [])
        return crc
    view = memoryview(maps.mapping(path, size))
    try:
        return fill(name, view)
    finally:
        view.release()
