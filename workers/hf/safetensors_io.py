"""safetensors files read and written one tensor at a time, on any fsspec filesystem.

Why not `safetensors.torch.save_file`/`load_file`: both hold a whole file's tensors (save_file
also a second serialised copy), and an exported shard is up to 5 GB. The format is simple: an
8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}} padded
to 8 bytes, then the bytes. Writing the header first (sizes are known from the checkpoint's
metadata) lets the exporter stream tensors in; reading a tensor is one ranged read, so a rank
fetches only the tensors it owns. The header is checked against the file's size up front, so a
truncated file is refused before any weight is used.
"""
from __future__ import annotations

import json
import logging
import math
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from tenax.workers.hf.errors import SafetensorsError

logger = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER = 100 << 20
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
          "F64": torch.float64}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class TensorEntry:
    file: str  # URI of the file holding it
    name: str
    dtype: str  # safetensors dtype name (F32, BF16, ...)
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


def _fs(uri: str) -> tuple[Any, str]:
    from fsspec.core import url_to_fs

    return url_to_fs(uri)


def shard_name(index: int, count: int) -> str:
    return SINGLE_NAME if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def read_header(uri: str) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file, checked against the file's size."""
    fs, path = _fs(uri)
    try:
        size = fs.size(path)
        with fs.open(path, "rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                raise SafetensorsError(f"{uri}: truncated ({size} bytes, no header)")
            (length,) = struct.unpack("<Q", head)
            if length > min(MAX_HEADER, size - 8):
                raise SafetensorsError(f"{uri}: truncated or not safetensors (header of "
                                       f"{length} bytes in a {size}-byte file)")
            header = json.loads(handle.read(length))
    except (OSError, ValueError) as exc:
        if isinstance(exc, SafetensorsError):
            raise
        raise SafetensorsError(f"{uri}: unreadable: {type(exc).__name__}: {exc}") from None
    return _entries(uri, header, 8 + length, size)


def _entries(uri: str, header: dict[str, Any], base: int, size: int) -> dict[str, TensorEntry]:
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = (base + int(o) for o in info["data_offsets"])
        shape = tuple(int(d) for d in info["shape"])
        if info["dtype"] not in DTYPES:
            raise SafetensorsError(f"{uri}: tensor {name!r} has dtype {info['dtype']!r} "
                                   f"(supported: {sorted(DTYPES)})")
        want = math.prod(shape) * DTYPES[info["dtype"]].itemsize
        if end - begin != want:
            raise SafetensorsError(f"{uri}: tensor {name!r} spans {end - begin} bytes, its "
                                   f"shape {list(shape)} needs {want}")
        if end > size:
            raise SafetensorsError(f"{uri}: truncated: tensor {name!r} ends at byte {end}, "
                                   f"the file has {size}")
        out[name] = TensorEntry(uri, name, info["dtype"], shape, begin, end)
    return out


def read_index(root: str) -> dict[str, TensorEntry]:
    """Every tensor of an HF directory: sharded (index.json) or one model.safetensors."""
    fs, path = _fs(f"{root.rstrip('/')}/{INDEX_NAME}")
    files = [SINGLE_NAME]
    if fs.exists(path):
        try:
            with fs.open(path, "r") as handle:
                files = sorted(set(json.load(handle)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SafetensorsError(f"{root}/{INDEX_NAME}: unreadable: {exc}") from None
    out: dict[str, TensorEntry] = {}
    for name in files:
        uri = f"{root.rstrip('/')}/{name}"
        fs, path = _fs(uri)
        if not fs.exists(path):
            raise SafetensorsError(f"{uri}: missing (no {INDEX_NAME} naming other files either)"
                                   if name == SINGLE_NAME else f"{uri}: missing")
        out.update(read_header(uri))
    return out


def read_tensor(entry: TensorEntry, handle: BinaryIO | None = None) -> torch.Tensor:
    """One tensor, read with a single ranged read (a fresh CPU tensor)."""
    if handle is None:
        fs, path = _fs(entry.file)
        with fs.open(path, "rb") as fresh:
            return read_tensor(entry, fresh)
    handle.seek(entry.start)
    data = bytearray(handle.read(entry.end - entry.start))
    if len(data) != entry.end - entry.start:
        raise SafetensorsError(f"{entry.file}: truncated while reading {entry.name!r}")
    if not data:
        return torch.empty(entry.shape, dtype=DTYPES[entry.dtype])
    return torch.frombuffer(data, dtype=DTYPES[entry.dtype]).reshape(entry.shape)


class StreamingWriter:
    """Writes one safetensors file whose tensors (names, dtypes, shapes) are known up front;
    `write` them in the declared order, then `close`."""

    def __init__(self, handle: BinaryIO, layout: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None) -> None:
        header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
        offset = 0
        for name, dtype, shape in layout:
            size = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, like save_file's
        handle.write(struct.pack("<Q", len(text)) + text)
        self.handle, self.pending = handle, [(n, d, s) for n, d, s in layout]
        self.data_bytes = offset

    def write(self, name: str, tensor: torch.Tensor) -> None:
        _, dtype, shape = self._next(name)
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise SafetensorsError(f"safetensors writer: {name!r} is {tensor.dtype} "
                                   f"{list(tensor.shape)}, declared {dtype} {list(shape)}")
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        self.handle.write(memoryview(flat.numpy()))

    def write_cast(self, name: str, source: torch.Tensor, scratch: torch.Tensor) -> None:
        """Write `source` in the declared dtype, cast a chunk at a time into `scratch` (a
        reused buffer of that dtype): no full-size copy is allocated."""
        _, dtype, shape = self._next(name)
        if tuple(source.shape) != shape:
            raise SafetensorsError(f"safetensors writer: {name!r} has shape "
                                   f"{list(source.shape)}, declared {list(shape)}")
        flat = source.detach().contiguous().reshape(-1)
        if flat.dtype == dtype:
            self.handle.write(memoryview(flat.view(torch.uint8).numpy()))
            return
        if scratch.dtype != dtype:
            raise SafetensorsError(f"safetensors writer: scratch is {scratch.dtype}, "
                                   f"{name!r} is declared {dtype}")
        step = scratch.numel()
        for start in range(0, flat.numel(), step):
            piece = scratch[:min(step, flat.numel() - start)]
            piece.copy_(flat[start:start + piece.numel()])
            self.handle.write(memoryview(piece.view(torch.uint8).numpy()))

    def _next(self, name: str) -> tuple[str, torch.dtype, tuple[int, ...]]:
        if not self.pending or self.pending[0][0] != name:
            want = self.pending[0][0] if self.pending else "nothing"
            raise SafetensorsError(f"safetensors writer: got {name!r}, expected {want!r}")
        return self.pending.pop(0)

    def close(self) -> None:
        if self.pending:
            raise SafetensorsError(f"safetensors writer: {len(self.pending)} tensors never "
                                   f"written (first {self.pending[0][0]!r})")
