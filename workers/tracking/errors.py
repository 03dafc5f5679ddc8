"""Errors of experiment tracking (workers/tracking). A tracking error never fails a job: the
tracker switches the backend off and reports it (`tracking_off`); these name what to fix."""
from __future__ import annotations


class TensorBoardDirError(OSError):
    """`logging.tensorboard_dir` cannot be written: names the key, the URI and the file."""

    def __init__(self, uri: str, path: str, cause: BaseException) -> None:
        super().__init__(f"logging.tensorboard_dir {uri!r}: cannot write {path}: "
                         f"{type(cause).__name__}: {cause}")
