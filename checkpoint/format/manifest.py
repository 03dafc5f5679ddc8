"""The manifest (a version's commit marker), what a commit records in it, and version health.

Why a module of its own: the manifest is the one document read back from storage that drives
every resume, so its parsing is strict (types, bounds, confined file names) and lives apart
from the catalog's I/O.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Collection, Mapping

from tenax.checkpoint.errors import ManifestError, StorageError
from tenax.checkpoint.format.storage import validate_relpath

FORMAT_VERSION = 1
# DCP's global plan, written by rank 0 beside the shard files. Named here, not in shards.py,
# so that a rank's agent can handle versions and snapshots without importing torch (~3 s of
# CPU per agent at every placement).
METADATA_NAME = ".metadata"
ECHO_CHARS = 60  # manifests come from storage: quote at most this much of a bad value


def echo(value: object) -> str:
    """A short repr of a value read from storage, so errors never relay a file's content."""
    text = repr(value)
    return text if len(text) <= ECHO_CHARS else f"{text[:ECHO_CHARS]}... ({len(text)} chars)"


@dataclass(frozen=True)
class VersionHealth:
    """What re-reading one committed version found: damage (bytes wrong) vs unreachable."""

    damaged: tuple[str, ...] = ()
    unreachable: tuple[str, ...] = ()

    @property
    def problems(self) -> list[str]:
        return [*self.damaged, *self.unreachable]


@dataclass(frozen=True)
class FileEntry:
    size: int
    checksum: str  # '<algorithm>:<hex>', e.g. 'crc32c:1a2b3c4d'


@dataclass(frozen=True)
class CommitInfo:
    """What `Catalog.commit` records in a version's manifest, and the files it must find there.

    `started_at` is `time.monotonic()` when the save began: the manifest's total_s runs from
    there to the manifest write (None: the commit's own time). Every file of `expected_files`
    must exist; an empty file is refused unless `allow_empty_files` (a rank of an in-memory
    snapshot may hold no bytes).
    """

    step: int
    layout: Mapping[str, Any]
    world_size: int
    model_hash: str
    data_cursor: int
    seed: int
    lr_step: int
    blocked_s: float = 0.0
    started_at: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    expected_files: Collection[str] = ()
    allow_empty_files: bool = False


def _need_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ManifestError(f"manifest field {name} must be an int >= {minimum}, got "
                            f"{echo(value)}")


@dataclass
class Manifest:
    """The commit marker of one version; everything a resume needs besides the tensors."""

    step: int
    layout: dict[str, Any]
    world_size: int
    model_hash: str
    data_cursor: int  # global samples consumed
    seed: int
    lr_step: int  # scheduler position
    files: dict[str, FileEntry]
    blocked_s: float = 0.0
    total_s: float = 0.0
    created_at: str = ""
    format_version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, minimum in (("step", 0), ("world_size", 1), ("data_cursor", 0),
                              ("lr_step", 0), ("format_version", 1)):
            _need_int(name, getattr(self, name), minimum)
        _need_int("seed", self.seed, -(1 << 63))
        if self.format_version > FORMAT_VERSION:
            raise ManifestError(f"manifest format_version {self.format_version} is newer than "
                                f"this Tenax understands ({FORMAT_VERSION})")
        if not isinstance(self.layout, dict) or not isinstance(self.extra, dict):
            raise ManifestError("manifest fields layout and extra must be JSON objects")
        if not isinstance(self.model_hash, str):
            raise ManifestError(f"manifest model_hash must be a str, got {echo(self.model_hash)}")
        for rel in self.files:
            try:  # entries come from storage and drive reads: confine them to the root
                validate_relpath(rel)
            except StorageError as exc:
                raise ManifestError(f"manifest file entry rejected: {str(exc)[:200]}") from exc

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True, allow_nan=False)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Manifest":
        try:
            raw = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ManifestError(f"manifest is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ManifestError(f"manifest must be a JSON object, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        missing = sorted(n for n in known - raw.keys()
                         if n not in ("blocked_s", "total_s", "created_at", "extra"))
        if missing:
            raise ManifestError(f"manifest lacks fields {missing}")
        # unknown keys are ignored so a newer writer of the same format_version stays readable
        args = {k: v for k, v in raw.items() if k in known}
        try:
            args["files"] = {rel: FileEntry(int(e["size"]), str(e["checksum"]))
                             for rel, e in dict(args["files"]).items()}
            return cls(**args)
        except (TypeError, ValueError, KeyError) as exc:  # ManifestError passes through
            raise ManifestError(f"manifest is malformed: {type(exc).__name__}: {exc}") from exc

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.files.values())
