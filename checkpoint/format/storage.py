"""The fsspec seam: every byte of a checkpoint goes through `Storage`.

Why one class: checkpoints live on local disk, shared filesystems or object stores (s3://, gs://,
memory:// in tests) and the rest of Tenax must not care which. `Storage` is bound to one job's
checkpoint root URI and only ever touches paths below it, so a bad relative name or a hostile
manifest entry (`..`, `/abs`, `C:\\x`, `a//b`) can never read or delete anything outside the root:
such names raise `StorageError` before any I/O happens.

Guarantees it adds on top of fsspec:
- every error is a `StorageError` (picklable, it crosses Ray actor boundaries) naming the URI;
- `write_bytes` is atomic on file:// (temp file + fsync + rename, then the directory is fsynced,
  because the manifest written this way is the commit marker) and a single put on object stores,
  which is atomic there;
- async filesystems (s3fs, gcsfs, ...) get a deadline on every call through fsspec's `timeout`;
  data calls get `timeout_s` plus time for the bytes at a minimum throughput, so a large shard
  is not cut off while a hung connection still is. Sync filesystems (file://, memory://) offer no
  timeout hook; see the caveat on `Storage`.
- listing caches are dropped before listing, because other ranks write shards concurrently and a
  stale listing would make a commit miss files.
"""
from __future__ import annotations

import inspect
import logging
import os
import re
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any, Callable, Iterable

import fsspec
from fsspec.implementations.local import LocalFileSystem

from tenax.checkpoint.errors import StorageError, StorageNotFoundError, StorageTimeoutError
from tenax.checkpoint.format.split_crc import file_crc32c

try:  # hardware CRC32C is ~2x zlib.crc32 here; optional so a bare install still works
    import crc32c as _crc32c
except ImportError:  # pragma: no cover - depends on the environment
    _crc32c = None

logger = logging.getLogger(__name__)

READ_CHUNK_BYTES = 8 << 20
MIN_BYTES_PER_S = 4 << 20  # slowest throughput a data call may have before it counts as hung
_TMP_MARKER = ".tmp-"
_BAD_CHARS = re.compile(r"[\\:\x00-\x1f\x7f]")

_CHECKSUMS: dict[str, Callable[[bytes, int], int]] = {"crc32": zlib.crc32}
if _crc32c is not None:
    _CHECKSUMS["crc32c"] = _crc32c.crc32c
DEFAULT_CHECKSUM = "crc32c" if _crc32c is not None else "crc32"


def validate_relpath(rel: str, *, allow_root: bool = False, uri: str = "") -> str:
    """Return `rel` if it is a safe POSIX path relative to the root, else raise StorageError.

    Why strict: manifest entries come from storage and are used for reads and deletes, so a name
    must not be able to climb out of the root on any OS or object store.
    """
    where = f" (root {uri})" if uri else ""
    if not isinstance(rel, str):
        raise StorageError(f"path must be a str, got {type(rel).__name__} {rel!r}{where}")
    if rel == "":
        if allow_root:
            return rel
        raise StorageError(f"empty path: the root itself is not allowed here{where}")
    if rel.startswith("/") or rel.startswith("~"):
        raise StorageError(f"absolute path {rel!r} escapes the checkpoint root{where}")
    if _BAD_CHARS.search(rel):
        raise StorageError(
            f"path {rel!r} has a backslash, colon (drive letter or scheme) or control "
            f"character{where}")
    for part in rel.split("/"):
        if part in ("", ".", ".."):
            raise StorageError(
                f"path {rel!r} has an empty, '.' or '..' component; paths must stay "
                f"inside the checkpoint root{where}")
    return rel


def checksum_algorithms() -> list[str]:
    """Names of the checksum algorithms available in this process."""
    return sorted(_CHECKSUMS)


class Storage:
    """One job's checkpoint root on any fsspec filesystem.

    `uri` is an fsspec URL (`file:///x`, `memory://x`, `s3://bucket/prefix`) or a plain local
    path. All methods take paths relative to the root, '/'-separated. Caveat: file:// and
    memory:// calls cannot be given a deadline (fsspec has no hook for sync filesystems), so a
    hung NFS mount blocks the caller; callers run saves off the training thread for this reason.
    """

    def __init__(self, uri: str, *, timeout_s: float = 60.0,
                 storage_options: dict[str, Any] | None = None) -> None:
        if not isinstance(uri, str) or not uri.strip():
            raise StorageError(f"checkpoint URI must be a non-empty string, got {uri!r}")
        if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
            raise StorageError(f"timeout_s must be > 0 for {uri}, got {timeout_s!r}")
        self._options = dict(storage_options or {})
        self.timeout_s = float(timeout_s)
        try:
            fs, root = fsspec.core.url_to_fs(uri, **self._options)
        except Exception as exc:
            raise StorageError(f"cannot open checkpoint URI {uri}: "
                               f"{type(exc).__name__}: {exc}") from exc
        root = root.rstrip("/")
        if root in ("", "."):
            raise StorageError(f"checkpoint URI {uri} resolves to a filesystem root; "
                               f"give it a directory of its own")
        self.fs: fsspec.AbstractFileSystem = fs
        self.root: str = root
        self._given_uri = uri
        self.uri: str = fs.unstrip_protocol(root)

    def __reduce__(self) -> tuple[Any, ...]:
        # rebuild from the URI so the filesystem object and its event loop are not pickled
        return (_rebuild_storage, (self._given_uri, self.timeout_s, self._options))

    def __repr__(self) -> str:
        return f"Storage({self.uri!r})"

    # ---- paths ---------------------------------------------------------------------------
    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    def path(self, rel: str = "") -> str:
        """Full filesystem path (protocol stripped) of `rel`, for use with `self.fs`."""
        validate_relpath(rel, allow_root=True, uri=self.uri)
        return f"{self.root}/{rel}" if rel else self.root

    def url(self, rel: str = "") -> str:
        """Full URI of `rel` (what DCP's fsspec writer or a log line wants)."""
        return self.fs.unstrip_protocol(self.path(rel))

    def local_path(self, rel: str = "") -> str:
        """OS path of `rel` when the root is on a local filesystem (DCP's FileSystemWriter)."""
        full = self.path(rel)
        if not self.is_local:
            raise StorageError(f"{self.uri} is not on a local filesystem; use Storage.fs with "
                               f"Storage.path() (e.g. DCP's fsspec writer) instead")
        return full

    # ---- the one place errors and deadlines are handled ----------------------------------
    def _call(self, what: str, rel: str, method: str, *args: Any,
              nbytes: int = 0, **kwargs: Any) -> Any:
        fn = getattr(self.fs, method)
        timeout = None
        if inspect.iscoroutinefunction(getattr(fn, "__wrapped__", None)):
            # a sync wrapper over a coroutine: fsspec.asyn.sync honours `timeout`
            timeout = self.timeout_s + nbytes / MIN_BYTES_PER_S
            kwargs["timeout"] = timeout
        try:
            return fn(*args, **kwargs)
        except StorageError:
            raise
        except FileNotFoundError as exc:
            raise StorageNotFoundError(f"{what} {self.url(rel)}: not found") from exc
        except TimeoutError as exc:
            limit = f"within {timeout:.0f}s" if timeout else "(OS-level timeout)"
            raise StorageTimeoutError(f"{what} {self.url(rel)}: no answer {limit}") from exc
        except Exception as exc:
            raise StorageError(
                f"{what} {self.url(rel)} failed: {type(exc).__name__}: {exc}") from exc

    def _fresh(self, full: str) -> None:
        # other ranks write under the root: never answer from a cached listing
        if not self.is_local:
            self.fs.invalidate_cache(full)

    # ---- queries -------------------------------------------------------------------------
    def exists(self, rel: str = "") -> bool:
        full = self.path(rel)
        self._fresh(full)
        return bool(self._call("exists", rel, "exists", full))

    def isdir(self, rel: str = "") -> bool:
        full = self.path(rel)
        self._fresh(full)
        return bool(self._call("isdir", rel, "isdir", full))

    def size(self, rel: str) -> int:
        full = self.path(validate_relpath(rel, uri=self.uri))
        self._fresh(full)
        info = self._call("size of", rel, "info", full)
        if info.get("type") == "directory":
            raise StorageError(f"size of {self.url(rel)}: is a directory")
        return int(info["size"])

    def list_dirs(self, rel: str = "") -> list[str]:
        """Names of the immediate subdirectories of `rel`, sorted; [] when `rel` is missing."""
        full = self.path(rel)
        self._fresh(full)
        try:
            entries = self._call("list", rel, "ls", full, detail=True)
        except StorageNotFoundError:
            return []
        names = [e["name"].rstrip("/").rsplit("/", 1)[-1]
                 for e in entries if e.get("type") == "directory"]
        return sorted(n for n in names if n)

    def list_files(self, rel: str = "") -> dict[str, int]:
        """Every file below `rel`, recursively: {path relative to `rel`: size}; {} if missing."""
        full = self.path(rel)
        self._fresh(full)
        try:
            found = self._call("list", rel, "find", full, detail=True, withdirs=False)
        except StorageNotFoundError:
            return {}
        prefix = full.rstrip("/") + "/"
        out: dict[str, int] = {}
        for name, info in found.items():
            name = self.fs._strip_protocol(name)
            if info.get("type") == "directory" or not name.startswith(prefix):
                continue  # object-store folder markers; anything not below `rel`
            out[name[len(prefix):]] = int(info.get("size") or 0)
        return dict(sorted(out.items()))

    # ---- data ----------------------------------------------------------------------------
    def read_bytes(self, rel: str) -> bytes:
        full = self.path(validate_relpath(rel, uri=self.uri))
        nbytes = self.size(rel) if self.fs.async_impl else 0
        return bytes(self._call("read", rel, "cat_file", full, nbytes=nbytes))

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of `rel`: one ranged GET on object stores."""
        if start < 0 or end < start:
            raise StorageError(f"bad byte range [{start}, {end}) for {self.url(rel)}")
        full = self.path(validate_relpath(rel, uri=self.uri))
        if end == start:  # s3fs reads an empty range as the whole object
            return b""
        return bytes(self._call("read", rel, "cat_file", full, start=start, end=end,
                                nbytes=end - start))

    def open_read(self, rel: str) -> IO[bytes]:
        """A seekable binary file object for ranged reads; close it (use `with`)."""
        full = self.path(validate_relpath(rel, uri=self.uri))
        return self._call("open", rel, "open", full, "rb")

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write `data` to `rel` atomically: readers see the old file or the new one, never half."""
        full = self.path(validate_relpath(rel, uri=self.uri))
        if self.is_local:
            try:
                _write_local_atomic(full, data)
            except OSError as exc:
                raise StorageError(f"write {self.url(rel)} failed: "
                                   f"{type(exc).__name__}: {exc}") from exc
            return
        # object stores: a single put is atomic, a temp + rename would be a copy
        self._call("write", rel, "pipe_file", full, bytes(data), nbytes=len(data))
        self._fresh(full)

    def makedirs(self, rel: str) -> None:
        full = self.path(validate_relpath(rel, uri=self.uri))
        self._call("mkdir", rel, "makedirs", full, exist_ok=True)

    def delete(self, rel: str) -> bool:
        """Delete one file; False if it did not exist."""
        full = self.path(validate_relpath(rel, uri=self.uri))
        if not self.exists(rel):  # object stores delete missing keys silently; say so here
            return False
        try:
            self._call("delete", rel, "rm_file", full)
        except StorageNotFoundError:
            return False
        finally:
            self._fresh(full)
        return True

    def delete_tree(self, rel: str) -> bool:
        """Delete `rel` and everything below it; False if nothing was there. Never the root."""
        full = self.path(validate_relpath(rel, uri=self.uri))
        if not self.exists(rel):
            return False
        try:
            self._call("delete", rel, "rm", full, recursive=True)
        except StorageNotFoundError:
            return False
        finally:
            self._fresh(full)
        return True

    # ---- integrity -----------------------------------------------------------------------
    def checksum(self, rel: str, algorithm: str = DEFAULT_CHECKSUM) -> tuple[int, str]:
        """Stream `rel` once: (bytes read, '<algorithm>:<hex>')."""
        fn = _CHECKSUMS.get(algorithm)
        if fn is None:
            raise StorageError(f"checksum of {self.url(rel)}: algorithm {algorithm!r} is not "
                               f"available here (have {checksum_algorithms()}; "
                               f"'crc32c' needs `pip install crc32c`)")
        if self.is_local and algorithm == "crc32c":
            return self._local_crc32c(rel)
        value, total = 0, 0
        with self.open_read(rel) as f:
            while True:
                try:
                    chunk = f.read(READ_CHUNK_BYTES)
                except Exception as exc:
                    raise StorageError(f"read {self.url(rel)} failed at byte {total}: "
                                       f"{type(exc).__name__}: {exc}") from exc
                if not chunk:
                    break
                value = fn(chunk, value)
                total += len(chunk)
        return total, f"{algorithm}:{value & 0xFFFFFFFF:08x}"

    def _local_crc32c(self, rel: str) -> tuple[int, str]:
        """A local file's CRC32C, its ranges read by parallel threads (format/split_crc.py)."""
        with self.open_read(rel) as f:
            try:
                size = os.fstat(f.fileno()).st_size
                value = file_crc32c(f.fileno(), size)
            except OSError as exc:
                raise StorageError(f"read {self.url(rel)} failed: {type(exc).__name__}: "
                                   f"{exc}") from exc
        return size, f"crc32c:{value & 0xFFFFFFFF:08x}"

    def checksum_many(self, rels: Iterable[str], algorithm: str = DEFAULT_CHECKSUM,
                      workers: int = 4) -> dict[str, tuple[int, str] | StorageError]:
        """Checksum several files concurrently (object stores are latency-bound).

        A file that cannot be read maps to its StorageError rather than aborting the batch, so a
        verifier can report every problem at once.
        """
        rels = list(rels)

        def one(rel: str) -> tuple[int, str] | StorageError:
            try:
                return self.checksum(rel, algorithm)
            except StorageError as exc:
                return exc

        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(rels) or 1))) as pool:
            return dict(zip(rels, pool.map(one, rels)))


def _rebuild_storage(uri: str, timeout_s: float, options: dict[str, Any]) -> Storage:
    return Storage(uri, timeout_s=timeout_s, storage_options=options)


def _write_local_atomic(full: str, data: bytes) -> None:
    parent, name = os.path.split(full)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{name}{_TMP_MARKER}{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # the data must be durable before the name points at it
        os.replace(tmp, full)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:  # make the rename itself durable; some filesystems refuse fsync on a directory
        dir_fd = os.open(parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        logger.debug("fsync of directory %s not supported: %s", parent, exc)
