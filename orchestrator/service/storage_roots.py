"""StorageRoots: which storage URIs `tenax serve` may read and write on a submitter's behalf.

Why: `checkpoint.uri` and `data.source` come from whoever can submit a job, and the server (and
its ranks) act on them with the server's credentials: `http://...` makes it fetch anything,
`file:///state/../../etc` reads outside the job's area (a string prefix check passes it), and an
error message can echo the bytes read. So the server has an allow-list of roots (`--storage-root
URI`, repeatable; default: `file://` under the state dir) and every URI is normalised before the
check: the scheme's aliases unified, `..`, `.` and `//` resolved, local symlinks followed. The
normal form is also what makes two spellings of one directory the same checkpoint root, so two
jobs cannot share it. `tenax run` (a user on their own machine) does not use this.
"""
from __future__ import annotations

import logging
import os
import posixpath
from dataclasses import dataclass
from typing import Any, Iterable

from tenax.orchestrator.errors import StorageRootError
from tenax.orchestrator.service.store import STATE_FILES

logger = logging.getLogger(__name__)

SCHEME_ALIASES = {"local": "file", "s3a": "s3", "gcs": "gs"}
STORAGE_SCHEMES = frozenset({"file", "s3", "gs", "az", "abfs", "memory"})
ECHO_CHARS = 120


@dataclass(frozen=True)
class CanonicalUri:
    scheme: str
    path: str  # no trailing '/', no '..' or '.', '/'-rooted for file://

    def __str__(self) -> str:
        return f"{self.scheme}://{self.path}"

    def within(self, root: "CanonicalUri") -> bool:
        return self.scheme == root.scheme and (
            self.path == root.path or self.path.startswith(root.path.rstrip("/") + "/"))


def _echo(uri: str) -> str:
    return repr(uri) if len(uri) <= ECHO_CHARS else f"{uri[:ECHO_CHARS]!r}... ({len(uri)} chars)"


def canonical_uri(uri: Any, field: str = "uri") -> CanonicalUri:
    """The normal form of a storage URI (plain absolute paths are file://); StorageRootError."""
    if not isinstance(uri, str) or not uri.strip():
        raise StorageRootError(f"{field}: must be a non-empty URI, got {_echo(str(uri))}")
    if "::" in uri or any(ord(c) < 32 for c in uri):
        raise StorageRootError(f"{field}: chained URLs and control characters are not "
                               f"accepted, got {_echo(uri)}")
    scheme, sep, rest = uri.partition("://")
    if not sep:
        scheme, rest = "file", uri
    scheme = SCHEME_ALIASES.get(scheme.lower(), scheme.lower())
    if scheme == "file":
        if not rest.startswith("/"):
            raise StorageRootError(f"{field}: a file URI must be an absolute path "
                                   f"(file:///abs/dir), got {_echo(uri)}")
        path = os.path.realpath(rest)  # '..', '//', symlinks: what the OS would open
    else:
        path = posixpath.normpath("/" + rest).lstrip("/")
        if not path or path == ".":
            raise StorageRootError(f"{field}: {_echo(uri)} names no bucket or directory")
    return CanonicalUri(scheme, path.rstrip("/") or "/")


def overlapping(a: str, b: str) -> bool:
    """True when two checkpoint URIs are one directory or one holds the other (any spelling)."""
    try:
        ca, cb = canonical_uri(a), canonical_uri(b)
    except StorageRootError:
        return a.rstrip("/") == b.rstrip("/")
    return ca.within(cb) or cb.within(ca)


class StorageRoots:
    """The allow-list of one server: a URI is allowed when its normal form is under a root."""

    def __init__(self, roots: Iterable[str], reserved: Iterable[str] = ()) -> None:
        # The server's own files (its job store, its lock): under the default root, yet a
        # job's checkpoint.uri or tensorboard_dir naming them, or the directory holding them,
        # would write beside or over the store, and a tokenizer naming them would read it.
        self.reserved = [canonical_uri(uri, "reserved") for uri in reserved]
        self.roots: list[CanonicalUri] = []
        for root in roots:
            canon = canonical_uri(root, "--storage-root")
            if canon.scheme not in STORAGE_SCHEMES:
                raise StorageRootError(f"--storage-root: scheme {canon.scheme!r} is not a "
                                       f"storage scheme (one of {sorted(STORAGE_SCHEMES)})")
            if canon.path == "/":
                raise StorageRootError(f"--storage-root: {root!r} is a whole filesystem; "
                                       f"give a directory")
            self.roots.append(canon)
        logger.info("storage roots allowed for jobs: %s", [str(r) for r in self.roots])

    @classmethod
    def default(cls, state_dir: str, extra: Iterable[str] = ()) -> "StorageRoots":
        """file:// under the state dir, plus what the operator listed; the server's own files
        in the state dir (and the state dir itself) are refused."""
        state = os.path.realpath(state_dir)
        return cls([f"file://{state}", *extra],
                   [f"file://{state}/{name}" for name in STATE_FILES])

    def check(self, uri: str, field: str) -> CanonicalUri:
        """The normal form of `uri` if it is under an allowed root; StorageRootError naming
        `field` otherwise."""
        canon = canonical_uri(uri, field)
        if not any(canon.within(root) for root in self.roots):
            allowed = ", ".join(str(r) for r in self.roots)
            raise StorageRootError(f"{field}: {_echo(uri)} (normalised {_echo(str(canon))}) is "
                                   f"outside the server's storage roots ({allowed}); the "
                                   f"operator can add one with tenax serve --storage-root")
        for own in self.reserved:
            if canon.within(own) or own.within(canon):
                raise StorageRootError(f"{field}: {_echo(uri)} (normalised "
                                       f"{_echo(str(canon))}) holds the server's own state "
                                       f"({own}); give a directory of its own under the "
                                       f"state dir")
        return canon

    def check_spec(self, spec: Any) -> None:
        """Every URI of a job spec: checkpoint.uri, every data file, the HF weights it starts
        from and the TensorBoard directory it writes."""
        self.check(spec.checkpoint.uri, "checkpoint.uri")
        for field, uri in spec.data.uris():  # data.source/sources, tokenizer, validation
            self.check(uri, field)
        if spec.model.init_from:
            self.check(spec.model.init_from, "model.init_from")
        if spec.logging.tensorboard_dir:
            self.check(spec.logging.tensorboard_dir, "logging.tensorboard_dir")

    def check_raw(self, raw: dict[str, Any]) -> None:
        """The file URIs of a spec before it is validated: validation itself reads some of them
        (the tokenizer for `vocab_size: auto`, `init_from`'s config.json), so a URI outside the
        roots must be refused before the server opens it on the submitter's behalf."""
        for field, uri in raw_file_uris(raw):
            self.check(uri, field)


def raw_file_uris(raw: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, URI) of the keys a spec's validation opens; values that are not strings are
    left to the spec's own type errors."""
    def get(*path: str | int) -> Any:
        node: Any = raw
        for part in path:
            if isinstance(part, int):
                node = node[part] if isinstance(node, list) and part < len(node) else None
            else:
                node = node.get(part) if isinstance(node, dict) else None
        return node

    fields: list[tuple[str, Any]] = [("data.tokenizer", get("data", "tokenizer")),
                                     ("model.init_from", get("model", "init_from"))]
    sources = get("data", "sources")
    for i in range(len(sources) if isinstance(sources, list) else 0):
        fields.append((f"data.sources[{i}].uri", get("data", "sources", i, "uri")))
    return [(f, v) for f, v in fields if isinstance(v, str) and v and v != "synthetic"]
