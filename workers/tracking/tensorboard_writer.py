"""TensorBoard event files written without torch or TensorFlow: the protos from the
`tensorboard` package, the TFRecord framing here (crc32c), the file through fsspec, so
`logging.tensorboard_dir` may be a local path or any fsspec URI (s3://, gs://, memory://).

One run, many attempts: every attempt of rank 0 (a fresh start, a recovery, a rescale, a
resumed `tenax run`) writes a new event file into the same directory, starting with a
SessionLog START at its first step (what `SummaryWriter(purge_step=...)` writes). TensorBoard
reads a directory's files in name order and drops the values it already read at steps >= that
step, so a step redone after a failure reads back once, with its final value. File names sort
by creation time to the microsecond, so a recovery within the same second still sorts after
the attempt it replaces.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import struct
import time
from typing import Any, Mapping

logger = logging.getLogger(__name__)

FILE_VERSION = "brain.Event:2"
SPEC_TAG = "spec"
ATTEMPTS_TAG = "attempts"


def masked_crc32c(data: bytes) -> int:
    """TFRecord's checksum: crc32c rotated right by 15 bits plus a constant."""
    import crc32c

    crc = crc32c.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(data: bytes) -> bytes:
    """One TFRecord: length, its masked crc, the data, its masked crc (little-endian)."""
    header = struct.pack("<Q", len(data))
    return (header + struct.pack("<I", masked_crc32c(header)) + data
            + struct.pack("<I", masked_crc32c(data)))


def event_file_name(now_ns: int | None = None) -> str:
    """`events.out.tfevents.<seconds>.<microseconds>.<host>.<pid>`: sorts by creation time."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    seconds, micros = divmod(now_ns // 1000, 1_000_000)
    host = socket.gethostname().replace("/", "-") or "host"
    return f"events.out.tfevents.{seconds:010d}.{micros:06d}.{host}.{os.getpid()}"


class TensorBoardWriter:
    """A tracking backend (workers/tracking/tracker.py `Backend`) for one TensorBoard run."""
    name = "tensorboard"

    def __init__(self, uri: str, attempt: bool = True) -> None:
        """`attempt`: rank 0's series (a START purging what the attempt redoes, the spec, the
        attempt's start); False for the controller's run, which never redoes a step."""
        self.uri, self.attempt = uri.rstrip("/"), attempt
        self.path = ""  # the event file of this attempt, once open
        self._file: Any = None

    def open(self, first_step: int, spec: Mapping[str, Any]) -> None:
        import fsspec

        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        fs, root = fsspec.core.url_to_fs(self.uri)
        fs.makedirs(root, exist_ok=True)
        self.path = f"{root.rstrip('/')}/{event_file_name()}"
        self._file = fs.open(self.path, "wb")
        now = time.time()
        purge = first_step + 1  # the attempt's first step: older values from here on are void
        self._append(Event(wall_time=now, step=purge, file_version=FILE_VERSION))
        if not self.attempt:  # version 2 without a START: TensorBoard purges nothing
            self.flush()
            return
        self._append(Event(wall_time=now, step=purge,
                           session_log=SessionLog(status=SessionLog.START)))
        if first_step == 0:  # the spec once per run: a fresh start writes it
            self.text(purge, SPEC_TAG, "```\n" + json.dumps(spec, indent=2, default=str)
                      + "\n```", now)
        self.text(purge, ATTEMPTS_TAG, f"Rank 0 started at step {first_step} on "
                  f"{socket.gethostname()} (pid {os.getpid()})", now)
        self.flush()
        logger.info("tensorboard: writing %s", self.path)

    def scalars(self, step: int, values: Mapping[str, float], wall_time: float) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(v))
                                 for tag, v in values.items()])
        self._append(Event(wall_time=wall_time, step=step, summary=summary))

    def text(self, step: int, tag: str, text: str, wall_time: float) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
        from tensorboard.compat.proto.types_pb2 import DT_STRING

        metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
        tensor = TensorProto(dtype=DT_STRING, string_val=[text.encode()],
                             tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
        summary = Summary(value=[Summary.Value(tag=tag, metadata=metadata, tensor=tensor)])
        self._append(Event(wall_time=wall_time, step=step, summary=summary))

    def _append(self, event: Any) -> None:
        if self._file is None:
            raise RuntimeError(f"tensorboard_dir {self.uri!r}: the event file is not open")
        self._file.write(tfrecord(event.SerializeToString()))

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            file.close()
