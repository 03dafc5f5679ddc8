"""Checkpoint versions, the commit marker, verification and retention.

Why: a save is written by many ranks and can die half-way, and storage can rot afterwards. So a
version is a directory `step-NNNNNNNN` (8 digits, pinned) that counts only once its
`manifest.json` exists, and the manifest is written LAST, atomically, after every file below it
has been sized and checksummed: the two-phase commit's second phase. Whoever loads a checkpoint
asks `latest_committed()`, which re-checks those checksums and falls back to an older version
(logging why) when the newest is damaged. Retention deletes the manifest of a version before its
files, so a crash during deletion leaves an uncommitted leftover, never a committed version with
files missing.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Collection, Mapping, NamedTuple

from tenax.checkpoint.errors import (CatalogError, CatalogUnreachableError, ManifestError,
                                     StorageError, StorageNotFoundError)
from tenax.checkpoint.format.manifest import CommitInfo, FileEntry, Manifest, VersionHealth
from tenax.checkpoint.format.retention_policy import retention_plan
from tenax.checkpoint.format.storage import DEFAULT_CHECKSUM, Storage, validate_relpath

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MAX_STEP = 99_999_999  # the pinned name has exactly 8 digits
_VERSION_RE = re.compile(r"^step-(\d{8})$")


def version_name(step: int) -> str:
    """`step-00000040` for step 40; the pinned directory name of a version."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise CatalogError(f"checkpoint step must be an int in [0, {MAX_STEP}], got {step!r}")
    return f"step-{step:08d}"


def parse_version_name(name: str) -> int | None:
    """The step of a version directory name, or None for anything else."""
    m = _VERSION_RE.match(name)
    return int(m.group(1)) if m else None


def spec_hash(model_spec: Mapping[str, Any]) -> str:
    """Stable sha256 hex of a model spec: canonical JSON (sorted keys, no spaces, no NaN).

    Why canonical JSON: the hash must match across processes, Python versions and key orders,
    so a checkpoint is never loaded into a different model by accident.
    """
    try:
        text = json.dumps(model_spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                          allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise CatalogError(f"model spec is not JSON-serialisable: {exc}") from exc
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class VersionInfo(NamedTuple):
    step: int
    committed: bool
    size: int  # bytes on storage, manifest included


@dataclass(frozen=True)
class Deletion:
    step: int
    committed: bool
    reason: str


def share_of(files: Mapping[str, FileEntry], rank: int, world: int) -> set[str]:
    """The files `rank` of `world` re-reads to verify a version: greedy by size, largest first,
    to the least-loaded rank, so every rank reads about 1/world of the bytes (deterministic)."""
    loads = [(0, r) for r in range(world)]
    mine: set[str] = set()
    for rel, entry in sorted(files.items(), key=lambda kv: (-kv[1].size, kv[0])):
        load, owner = min(loads)
        loads[owner] = (load + entry.size, owner)
        if owner == rank:
            mine.add(rel)
    return mine


class Catalog:
    """Versions of one job's checkpoints on a `Storage` root.

    Only one process (the save coordinator) calls begin/commit/apply_retention for a root;
    any number may read.
    """

    def __init__(self, storage: Storage, *, checksum: str = DEFAULT_CHECKSUM,
                 workers: int = 4, read_attempts: int = 4, backoff_s: float = 0.25) -> None:
        self.storage = storage
        self.checksum = checksum
        self.workers = workers
        self.read_attempts = max(1, read_attempts)  # reads of a version before "unreachable"
        self.backoff_s = backoff_s

    def _manifest_rel(self, step: int) -> str:
        return f"{version_name(step)}/{MANIFEST_NAME}"

    # ---- writing -------------------------------------------------------------------------
    def begin(self, step: int, *, replace_committed: bool = False) -> str:
        """Create an empty version dir for `step` and return its URI.

        An uncommitted leftover of the same step is wiped. A committed one is only replaced with
        `replace_committed` (a run resumed from an older version re-saving the same step); its
        manifest goes first so a crash mid-wipe never leaves a committed, partial version.
        """
        name = version_name(step)
        if self.storage.exists(self._manifest_rel(step)):
            if not replace_committed:
                raise CatalogError(f"step {step} is already committed at "
                                   f"{self.storage.url(name)}; pass replace_committed=True")
            logger.warning("replacing committed checkpoint %s", self.storage.url(name))
            self.storage.delete(self._manifest_rel(step))
        if self.storage.delete_tree(name):
            logger.warning("wiped uncommitted leftover %s before a new save",
                           self.storage.url(name))
        self.storage.makedirs(name)
        return self.storage.url(name)

    def commit(self, info: CommitInfo, *, known: Mapping[str, FileEntry] | None = None,
               before_publish: Callable[[], None] | None = None) -> Manifest:
        """Checksum every file of version `info.step`, then write manifest.json last; return it.

        Refuses when the version dir is missing or has no files, a file of
        `info.expected_files` is missing, a file is empty (unless `info.allow_empty_files`), or
        the step is already committed. `known`: entries already checksummed by whoever wrote
        those bytes (an assembled in-memory snapshot, whose pieces were verified against their
        stamps); their files are only sized, not re-read. `before_publish` runs right before
        the manifest is written and may raise to abort the commit.
        """
        t0 = time.monotonic()
        step = info.step
        name = version_name(step)
        files = self._files_to_commit(step, info.expected_files, info.allow_empty_files)
        known = {rel: e for rel, e in (known or {}).items() if rel in files}
        sums = self.storage.checksum_many([f"{name}/{r}" for r in files if r not in known],
                                          self.checksum, self.workers)
        entries: dict[str, FileEntry] = {}
        for rel in files:
            res = (known[rel].size, known[rel].checksum) if rel in known else sums[f"{name}/{rel}"]
            if isinstance(res, StorageError):
                raise CatalogError(f"cannot commit step {step}: {res}")
            if res[0] != files[rel]:
                raise CatalogError(f"cannot commit step {step}: {self.storage.url(name)}/{rel} "
                                   f"changed size while being checksummed")
            entries[rel] = FileEntry(*res)
        created = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
        manifest = Manifest(
            step=step, layout=dict(info.layout), world_size=info.world_size,
            model_hash=info.model_hash, data_cursor=info.data_cursor, seed=info.seed,
            lr_step=info.lr_step, files=entries, blocked_s=float(info.blocked_s),
            extra=dict(info.extra), created_at=created)
        manifest.total_s = time.monotonic() - (t0 if info.started_at is None else info.started_at)
        if before_publish is not None:
            before_publish()
        self.storage.write_bytes(self._manifest_rel(step), manifest.to_json().encode())
        took = max(time.monotonic() - t0, 1e-9)
        logger.info("committed %s: %d files, %d bytes, commit took %.3fs (%.0f MB/s)",
                    self.storage.url(name), len(entries), manifest.total_bytes, took,
                    manifest.total_bytes / took / 1e6)
        return manifest

    def _files_to_commit(self, step: int, expected: Collection[str] | None,
                         allow_empty: bool) -> dict[str, int]:
        name = version_name(step)
        url = self.storage.url(name)
        if self.storage.exists(self._manifest_rel(step)):
            raise CatalogError(f"step {step} is already committed at {url}")
        files = self.storage.list_files(name)
        if not files:
            what = "has no files" if self.storage.isdir(name) else "does not exist"
            raise CatalogError(f"cannot commit step {step}: {url} {what} (call begin() and "
                               f"write the shards first)")
        missing = sorted(validate_relpath(r) for r in (expected or ()) if r not in files)
        if missing:
            raise CatalogError(f"cannot commit step {step}: missing files under {url}: {missing}")
        empty = sorted(r for r, size in files.items() if size == 0)
        if empty and not allow_empty:
            raise CatalogError(f"cannot commit step {step}: empty files under {url}: {empty}")
        return files

    # ---- reading -------------------------------------------------------------------------
    def versions(self) -> list[VersionInfo]:
        """Every version dir under the root, by step: committed or not, and its size."""
        out = []
        for name in self.storage.list_dirs():
            step = parse_version_name(name)
            if step is None:
                continue  # foreign directories are not ours to judge or delete
            files = self.storage.list_files(name)
            out.append(VersionInfo(step, MANIFEST_NAME in files, sum(files.values())))
        return sorted(out)

    def committed_steps(self) -> list[int]:
        return [v.step for v in self.versions() if v.committed]

    def manifest(self, step: int) -> Manifest:
        """The manifest of committed `step`; CatalogError if not committed or unreadable
        (CatalogUnreachableError when storage failed, ManifestError when it is malformed)."""
        url = self.storage.url(self._manifest_rel(step))
        try:
            raw = self.storage.read_bytes(self._manifest_rel(step))
        except StorageNotFoundError as exc:
            raise CatalogError(f"step {step} is not committed: {url} does not exist") from exc
        except StorageError as exc:
            raise CatalogUnreachableError(f"cannot read {url}: {exc}") from exc
        try:
            manifest = Manifest.from_json(raw)
        except ManifestError as exc:  # say which file: the bare parse error does not know
            raise ManifestError(f"{url}: {exc}") from exc
        if manifest.step != step:
            raise ManifestError(f"{url} claims step {manifest.step}, not {step}")
        return manifest

    def verify(self, step: int) -> list[str]:
        """Problems of committed `step`, re-reading every file; [] means intact."""
        return self.check(step).problems

    def check(self, step: int, share: tuple[int, int] | None = None) -> VersionHealth:
        """Re-read every file of committed `step`, telling damage from unreachable storage.

        `share=(rank, world)` re-reads only that rank's share of the bytes (`share_of`), so
        the ranks of a job verify a version together instead of waiting on one reader."""
        try:
            manifest = self.manifest(step)
        except CatalogUnreachableError as exc:
            return VersionHealth(unreachable=(str(exc),))
        except CatalogError as exc:
            return VersionHealth(damaged=(str(exc),))
        name = version_name(step)
        try:
            listed = self.storage.list_files(name)
        except StorageError as exc:
            return VersionHealth(unreachable=(f"cannot list {self.storage.url(name)}: {exc}",))
        damaged, unreachable, to_check = [], [], {}
        mine = share_of(manifest.files, *share) if share else set(manifest.files)
        for rel, entry in sorted(manifest.files.items()):
            if rel not in mine:
                continue
            url = self.storage.url(f"{name}/{rel}")
            if rel not in listed:
                damaged.append(f"missing file {url}")
            elif listed[rel] != entry.size:
                damaged.append(f"size mismatch {url}: {listed[rel]} bytes, "
                               f"manifest says {entry.size}")
            else:
                to_check[f"{name}/{rel}"] = entry
        by_algorithm: dict[str, list[str]] = {}
        for abs_rel, entry in to_check.items():
            by_algorithm.setdefault(entry.checksum.partition(":")[0], []).append(abs_rel)
        results = {}
        for algorithm, rels in by_algorithm.items():
            results.update(self.storage.checksum_many(rels, algorithm, self.workers))
        for abs_rel, entry in to_check.items():
            res, url = results[abs_rel], self.storage.url(abs_rel)
            if isinstance(res, StorageNotFoundError):
                damaged.append(f"missing file {url}")
            elif isinstance(res, StorageError):
                unreachable.append(f"unreadable file {url}: {res}")
            elif res != (entry.size, entry.checksum):
                damaged.append(f"checksum mismatch {url}: {res[1]} ({res[0]} bytes), "
                               f"manifest says {entry.checksum} ({entry.size} bytes)")
        return VersionHealth(tuple(damaged), tuple(unreachable))

    def check_patiently(self, step: int,
                        share: tuple[int, int] | None = None) -> VersionHealth:
        """`check`, retried with backoff while storage is unreachable (transient errors)."""
        delay = self.backoff_s
        for attempt in range(1, self.read_attempts + 1):
            health = self.check(step, share)
            if not health.unreachable or health.damaged or attempt == self.read_attempts:
                return health
            logger.warning("checkpoint step %d unreachable (attempt %d of %d, retrying in "
                           "%.2fs): %s", step, attempt, self.read_attempts, delay,
                           "; ".join(health.unreachable))
            time.sleep(delay)  # backoff between storage retries, not a test wait
            delay *= 2
        return health

    def latest_committed(self, verify: bool = True) -> Manifest | None:
        """Newest committed version whose manifest reads (and files verify); None if none.

        Only damage (bad bytes, missing files, a malformed manifest) skips a version. A version
        that stays unreachable after retries raises CatalogUnreachableError: falling back past
        it would resume older work and let the next save replace a version that may be fine.
        """
        for step in reversed(self.committed_steps()):
            health = self.check_patiently(step) if verify else VersionHealth()
            if health.unreachable and not health.damaged:
                raise CatalogUnreachableError(
                    f"checkpoint step {step} at {self.storage.url(version_name(step))} stayed "
                    f"unreadable after {self.read_attempts} attempts: "
                    f"{'; '.join(health.unreachable)}; not falling back to an older version")
            if health.damaged:
                logger.warning("skipping damaged checkpoint step %d at %s: %s", step,
                               self.storage.url(version_name(step)), "; ".join(health.damaged))
                continue
            try:
                return self.manifest(step)
            except CatalogUnreachableError:
                raise
            except CatalogError as exc:
                logger.warning("skipping checkpoint step %d: %s", step, exc)
        return None

    # ---- deleting ------------------------------------------------------------------------
    def delete(self, step: int) -> bool:
        """Delete a version: manifest first (uncommit), then its files. False if absent."""
        self.storage.delete(self._manifest_rel(step))
        return self.storage.delete_tree(version_name(step))

    def delete_uncommitted(self, step: int) -> bool:
        """Delete the version dir of `step` only if it has no manifest; False if none or
        committed (a failed save must never take a committed version with it)."""
        if self.storage.exists(self._manifest_rel(step)):
            return False
        return self.storage.delete_tree(version_name(step))

    def apply_retention(self, keep_last: int, keep_every: int = 0, *, head: int,
                        in_progress: Collection[int] = (),
                        protect: Collection[int] = ()) -> list[Deletion]:
        """Delete what `retention_plan` says; return what was deleted, logging each reason.

        `head` (required): the step just committed, the head of this run's lineage. Without
        it `keep_last` would count by step number, and a job that resumed below a rotten
        newest version would have each new commit deleted right after it is made
        (retention_policy.py).
        `in_progress`: steps being written now (their uncommitted dirs are spared).
        `protect`: steps never to delete, e.g. the one the job resumed from — the newest
        committed version may be damaged, and retention does not re-read checksums.
        A failed deletion is logged and retried at the next call, never raised: retention runs
        after saves, and a failed save chore must not stop training.
        """
        versions = self.versions()
        committed = {v.step for v in versions if v.committed}
        plan = retention_plan(committed, {v.step for v in versions if not v.committed},
                              keep_last, keep_every, in_progress, protect, head)
        done = []
        for step, reason in sorted(plan.items()):
            url = self.storage.url(version_name(step))
            try:
                self.delete(step)
            except StorageError as exc:
                logger.error("retention could not delete %s (%s): %s", url, reason, exc)
                continue
            logger.info("retention deleted %s: %s", url, reason)
            done.append(Deletion(step, step in committed, reason))
        return done
