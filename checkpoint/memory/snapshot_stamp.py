"""SnapshotStamp: what a complete in-memory snapshot is, and crc32c_of, its checksum.

A snapshot's `stamp.json` is written last and read first (snapshot_store.py: the `.partial`
protocol): every file's size and crc32c, the generation, rank, world size, step and what a
manifest needs. It is separate from the store because it is a record, not a place: the store
(SnapshotDir) writes and finds snapshots on tmpfs, while the stamp is what travels — a peer's
replica arrives as a stamp plus bytes, a restore assembles a version from stamps — so its
strict decoding (JSON, never pickle; every number range-checked) lives apart from the files.
"""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from tenax.checkpoint.errors import SnapshotError
from tenax.checkpoint.format.storage import checksum_algorithms

logger = logging.getLogger(__name__)

__all__ = ["SnapshotStamp", "crc32c_of"]


def crc32c_of(chunks: Iterable[memoryview | bytes], value: int = 0) -> int:
    import crc32c

    for chunk in chunks:
        value = crc32c.crc32c(chunk, value)
    return value


@dataclass(frozen=True)
class SnapshotStamp:
    """What a complete snapshot is: written last, read first (JSON, never pickle)."""
    generation: int
    rank: int
    world: int
    step: int
    files: dict[str, list[int]]  # name -> [bytes, crc32c]
    commit: dict[str, Any]  # layout, model_hash, data_cursor, seed, lr_step, extra
    written_at: float = field(default_factory=time.time)

    @property
    def nbytes(self) -> int:
        return sum(size for size, _ in self.files.values())

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> "SnapshotStamp":
        """The stamp in `text`; SnapshotError for anything else, including numbers that do not
        fit (1e400 is inf), nesting too deep for the parser and file entries that are not
        exactly [bytes, crc32c]."""
        try:
            doc = json.loads(text)
            stamp = cls(generation=_count(doc["generation"]), rank=_count(doc["rank"]),
                        world=_count(doc["world"]), step=_count(doc["step"]),
                        files={str(k): _file_entry(v) for k, v in doc["files"].items()},
                        commit=dict(doc["commit"]), written_at=float(doc["written_at"]))
        except (ValueError, KeyError, TypeError, IndexError, AttributeError, OverflowError,
                RecursionError) as exc:
            raise SnapshotError(f"unreadable snapshot stamp: {type(exc).__name__}: "
                                f"{str(exc)[:200]}") from None
        if not 0 <= stamp.rank < stamp.world or not math.isfinite(stamp.written_at):
            raise SnapshotError(f"snapshot stamp out of range: rank {stamp.rank} of "
                                f"{stamp.world}, written_at {stamp.written_at}")
        return stamp


def _count(value: Any) -> int:
    """A non-negative integer that fits int64 (JSON's bools and floats are refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise ValueError(f"expected an integer in [0, 2^63), got {str(value)[:40]}")
    return value


def _file_entry(value: Any) -> list[int]:
    if not isinstance(value, list) or len(value) != 2:
        raise ValueError(f"a file entry is [bytes, crc32c], got {str(value)[:40]}")
    return [_count(value[0]), _count(value[1])]


if "crc32c" not in checksum_algorithms():  # pragma: no cover - crc32c is a dependency
    logger.warning("crc32c is not installed: in-memory snapshots cannot be checksummed")
