"""Where `tenax export hf` writes: the output directory, made if absent, never the directory
the job's weights came from."""
from __future__ import annotations

import os
from typing import Any

from tenax.workers.hf.errors import ExportError

__all__ = ["check_not_source", "open_out", "same_location"]


def same_location(a: str, b: str) -> bool:
    """Whether two URIs name one directory (local paths through symlinks and `..`)."""
    from fsspec.core import url_to_fs

    try:
        (fs_a, path_a), (fs_b, path_b) = url_to_fs(a), url_to_fs(b)
    except (ValueError, ImportError):
        return False
    if fs_a.protocol != fs_b.protocol:
        return False
    if "file" in (fs_a.protocol if isinstance(fs_a.protocol, tuple) else (fs_a.protocol,)):
        path_a, path_b = os.path.realpath(path_a), os.path.realpath(path_b)
    return path_a.rstrip("/") == path_b.rstrip("/")


def check_not_source(out: str, init_from: str | None) -> None:
    """Refuse to export over the HF directory the job started from: its shards would be
    replaced by the trained weights, and the source was the user's only copy of them."""
    if init_from and same_location(out, init_from):
        raise ExportError(f"--out: {out!r} is the job's model.init_from (the weights it started "
                          f"from); export to another directory")


def open_out(out: str) -> tuple[Any, str]:
    """The filesystem and path of directory `out`, created if absent; ExportError naming
    --out when it cannot be (a file there, no permission, an unknown protocol)."""
    from fsspec.core import url_to_fs

    try:
        fs, root = url_to_fs(out)
        is_file = fs.exists(root) and not fs.isdir(root)
        if not is_file:
            fs.makedirs(root, exist_ok=True)
    except (OSError, ValueError, ImportError) as exc:
        raise ExportError(f"--out: {out!r}: {exc}") from None
    if is_file:
        raise ExportError(f"--out: {out!r}: exists and is not a directory")
    return fs, root
