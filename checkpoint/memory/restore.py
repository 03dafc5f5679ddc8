"""Assemble in-memory snapshot pieces into an ordinary checkpoint version, then load it as one.

Why assemble instead of a second reader: a snapshot's pieces are byte for byte the files a
storage save of that step would have written (checkpoint/memory/snapshot.py), so writing every
rank's pieces of one step side by side under a node-local tmpfs root and committing a manifest there
gives a version that `CheckpointManager.load(source_uri=...)` verifies and reshards exactly as
it does storage: the new layout may differ from the one the snapshot was taken in.
"""
from __future__ import annotations

import logging
import os
import shutil
from typing import Any

from tenax.checkpoint.errors import SnapshotError
from tenax.checkpoint.format.catalog import MANIFEST_NAME, Catalog, version_name
from tenax.checkpoint.format.manifest import CommitInfo, FileEntry
from tenax.checkpoint.format.storage import Storage
from tenax.checkpoint.memory.snapshot_store import SnapshotStamp
from tenax.checkpoint.memory.tmpfs_tree import makedirs_private, write_private

logger = logging.getLogger(__name__)


Piece = tuple[SnapshotStamp, "dict[str, Any] | str"]


def assemble_version(root: str, pieces: list[Piece], timeout_s: float = 60.0) -> str:
    """Put every rank's files of one step under `root` and commit it; returns its URI.

    `pieces` must hold exactly one snapshot per rank of one (generation, step, world). A
    piece's files are either their bytes (written here) or the directory of a complete
    snapshot on this filesystem (hard-linked: no byte is copied). The caller vouches for the
    pieces' checksums (the agents verified each against its stamp), so the commit records the
    stamps' checksums instead of re-reading every byte; the load verifies them as usual."""
    if not pieces:
        raise SnapshotError("no snapshot pieces to assemble")
    first = pieces[0][0]
    ranks = sorted(stamp.rank for stamp, _ in pieces)
    if ranks != list(range(first.world)):
        raise SnapshotError(f"snapshot pieces cover ranks {ranks}, need 0..{first.world - 1}")
    for stamp, _ in pieces:
        if (stamp.generation, stamp.step, stamp.world) != (first.generation, first.step,
                                                           first.world):
            raise SnapshotError(f"snapshot pieces mix steps/generations: rank {stamp.rank} has "
                                f"step {stamp.step} gen {stamp.generation}, rank {first.rank} "
                                f"step {first.step} gen {first.generation}")
    shutil.rmtree(root, ignore_errors=True)
    version = os.path.join(root, version_name(first.step))
    makedirs_private(version)  # like the snapshots: 0700 directories, 0600 files
    known: dict[str, FileEntry] = {}
    for stamp, files in pieces:
        for name, (size, crc) in stamp.files.items():
            if name in known:
                raise SnapshotError(f"two ranks' snapshots both hold {name}")
            _place(os.path.join(version, name), files, name)
            known[name] = FileEntry(size, f"crc32c:{crc & 0xFFFFFFFF:08x}")
    uri = f"file://{root}"
    commit = _commit_fields(pieces)
    info = CommitInfo(
        step=first.step, layout=commit["layout"], world_size=first.world,
        model_hash=commit["model_hash"], data_cursor=int(commit["data_cursor"]),
        seed=int(commit["seed"]), lr_step=int(commit["lr_step"]),
        extra={**commit["extra"], "source": "memory"}, expected_files=tuple(known),
        allow_empty_files=True)
    Catalog(Storage(uri, timeout_s=timeout_s), checksum="crc32c").commit(info, known=known)
    _close(os.path.join(version, MANIFEST_NAME))  # storage writes it with the umask's mode
    linked = sum(1 for _, files in pieces if isinstance(files, str))
    logger.info("assembled snapshot step %d of %d ranks (%d bytes; %d piece(s) linked, %d "
                "written) under %s", first.step, first.world,
                sum(s.nbytes for s, _ in pieces), linked, len(pieces) - linked, root)
    return uri


def _place(target: str, files: "dict[str, Any] | str", name: str) -> None:
    if not name or os.path.basename(name) != name or name in (".", "..", MANIFEST_NAME):
        raise SnapshotError(f"snapshot file name {name!r} is not a plain file name")
    if isinstance(files, str):  # a complete snapshot on this filesystem: share its pages
        os.link(os.path.join(files, name), target)
        return
    write_private(target, files[name])


def _close(path: str) -> None:
    """chmod 0600 the file at `path`, never through a symlink."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def _commit_fields(pieces: list[Piece]) -> dict[str, Any]:
    """Rank 0's manifest fields; every rank's must agree on the data cursor and model."""
    by_rank = {stamp.rank: stamp.commit for stamp, _ in pieces}
    ref = by_rank[0]
    for rank, commit in by_rank.items():
        for key in ("model_hash", "data_cursor", "lr_step"):
            if commit.get(key) != ref.get(key):
                raise SnapshotError(f"snapshot of rank {rank} has {key}={commit.get(key)!r}, "
                                    f"rank 0 has {ref.get(key)!r}")
    return ref
