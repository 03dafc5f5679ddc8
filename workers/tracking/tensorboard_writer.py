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

Why object stores are written in segments: an s3:// (gs://, ...) file opened for writing is an
upload that no reader sees before `close()`, and a rank killed by a failure never closes it,
so a streamed file there would show nothing while the job runs and lose every record of an
attempt that ends in a failure. On any filesystem but the local one, the attempt's bytes are
kept in memory and the current segment file is uploaded whole (`pipe_file`) at most every
`OBJECT_FLUSH_S`; once it holds `SEGMENT_BYTES` the next records start a new file. Segment
files sort after each other; only the attempt's first holds the START, so TensorBoard reads
them as one attempt. A kill loses at most the last `OBJECT_FLUSH_S` of records.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import struct
import time
from typing import Any, Mapping

from tenax.workers.tracking.errors import TensorBoardDirError

logger = logging.getLogger(__name__)

FILE_VERSION = "brain.Event:2"
# Object stores (see the module doc): a segment is uploaded whole at most this often, so a
# killed attempt loses at most this many seconds of records ...
OBJECT_FLUSH_S = 2.0
# ... and a segment file this large is closed for good (each upload rewrites the whole
# segment: this bounds the bytes a flush sends).
SEGMENT_BYTES = 128 * 1024
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

    def __init__(self, uri: str, attempt: bool = True, object_flush_s: float = OBJECT_FLUSH_S,
                 segment_bytes: int = SEGMENT_BYTES) -> None:
        """`attempt`: rank 0's series (a START purging what the attempt redoes, the spec, the
        attempt's start); False for the controller's run, which never redoes a step.
        `object_flush_s`, `segment_bytes`: how an object store is written (module doc)."""
        self.uri, self.attempt = uri.rstrip("/"), attempt
        self.object_flush_s, self.segment_bytes = object_flush_s, segment_bytes
        self.path = ""  # the event file of this attempt (its current segment), once open
        # How often the tracker should call `flush` while no record comes (set at open: object
        # stores only; a local file is written through as records come).
        self.flush_every_s: float | None = None
        self._file: Any = None  # a local file system: the open event file
        self._fs: Any = None  # an object store: its file system ...
        self._segment: bytearray | None = None  # ... and the current segment's bytes
        self._dirty = False  # the segment holds bytes not uploaded yet
        self._uploaded = 0.0  # time.monotonic() of the last upload

    def open(self, first_step: int, spec: Mapping[str, Any]) -> None:
        import fsspec
        from fsspec.implementations.local import LocalFileSystem

        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        fs, root = fsspec.core.url_to_fs(self.uri)
        self.path = f"{root.rstrip('/')}/{event_file_name()}"
        try:
            fs.makedirs(root, exist_ok=True)
            if isinstance(fs, LocalFileSystem):
                self._file = fs.open(self.path, "wb")
            else:
                self._fs, self._segment = fs, bytearray()
                self.flush_every_s = self.object_flush_s
        except OSError as err:
            raise TensorBoardDirError(self.uri, self.path, err) from err
        now = time.time()
        purge = first_step + 1  # the attempt's first step: older values from here on are void
        self._append(Event(wall_time=now, step=purge, file_version=FILE_VERSION))
        if self.attempt:  # version 2 without a START (the `job` run): TensorBoard purges nothing
            self._append(Event(wall_time=now, step=purge,
                               session_log=SessionLog(status=SessionLog.START)))
            if first_step == 0:  # the spec once per run: a fresh start writes it
                self.text(purge, SPEC_TAG, "```\n" + json.dumps(spec, indent=2, default=str)
                          + "\n```", now)
            self.text(purge, ATTEMPTS_TAG, f"Rank 0 started at step {first_step} on "
                      f"{socket.gethostname()} (pid {os.getpid()})", now)
        self._flush(force=True)  # an unwritable store fails here, at open, not mid-run
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
        data = tfrecord(event.SerializeToString())
        if self._file is not None:
            self._file.write(data)
        elif self._segment is not None:
            if len(self._segment) >= self.segment_bytes:
                self._roll(event.step)
            self._segment += data
            self._dirty = True
        else:
            raise RuntimeError(f"tensorboard_dir {self.uri!r}: the event file is not open")

    def _roll(self, step: int) -> None:
        """Upload the full segment for good and start the next file (it sorts after it)."""
        from tensorboard.compat.proto.event_pb2 import Event

        self._upload()
        self.path = f"{self.path.rsplit('/', 1)[0]}/{event_file_name()}"
        # A version-2 file without a START: it continues the attempt, purging nothing.
        header = Event(wall_time=time.time(), step=step, file_version=FILE_VERSION)
        self._segment = bytearray(tfrecord(header.SerializeToString()))

    def _upload(self) -> None:
        if self._segment is None or not self._dirty:
            return
        try:
            self._fs.pipe_file(self.path, bytes(self._segment))
        except OSError as err:
            raise TensorBoardDirError(self.uri, self.path, err) from err
        self._dirty, self._uploaded = False, time.monotonic()

    def _flush(self, force: bool) -> None:
        if self._file is not None:
            self._file.flush()
        elif force or time.monotonic() - self._uploaded >= self.object_flush_s:
            self._upload()

    def flush(self) -> None:
        self._flush(force=False)

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            file.close()
        elif self._segment is not None:
            self._upload()
            self._segment = None
