"""MetadataCodec: DCP's `.metadata` as versioned JSON, never as a pickle.

Why: `.metadata` is read from `checkpoint.uri`, which whoever can write the bucket (or submit a
job with a crafted URI) controls. `pickle.loads` of such bytes runs arbitrary code in every rank
and in `tenax ckpt inspect`. DCP's `Metadata` only holds names, shapes, offsets and dtypes, so a
plain JSON document carries all of it; decoding builds the DCP objects from checked primitives
and nothing from storage is ever unpickled. Checkpoints of the old pickled format
(`LEGACY_FORMAT`) are refused with a message saying why and what to do.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)

from tenax.checkpoint.errors import MetadataFormatError

logger = logging.getLogger(__name__)

METADATA_FORMAT = "tenax-dcp-metadata"
METADATA_VERSION = 1
FORMAT = "tenax-raw-2"  # raw shard bytes + JSON .metadata (manifest extra.format)
LEGACY_FORMAT = "tenax-raw-1"  # raw shard bytes + pickled .metadata: refused
MAX_METADATA_BYTES = 256 << 20  # a JSON document larger than this is not ours
_PICKLE_MAGIC = b"\x80"
_INT64_END = 1 << 63


@dataclass(frozen=True)
class ShardLocation:
    """Where one saved chunk lives: raw row-major bytes of `shape` and `dtype`."""

    file: str
    offset: int
    length: int
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the 'torch.' prefix


def legacy_refusal(url: str) -> str:
    """The one message for a checkpoint whose metadata is a pickle."""
    return (f"checkpoint {url} was written by an older Tenax ({LEGACY_FORMAT}) whose .metadata "
            f"is a Python pickle; Tenax no longer unpickles anything read from storage (a "
            f"crafted file would run code). Resume it once with the Tenax release that wrote "
            f"it so it saves a {FORMAT} version, or start over with a new checkpoint.uri")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: Any) -> torch.dtype:
    """A torch dtype from its name; only real dtypes (getattr on torch is otherwise too wide)."""
    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise MetadataFormatError(f"unknown dtype {str(name)[:40]!r} in checkpoint metadata")
    return dtype


def encode_metadata(metadata: Metadata) -> bytes:
    """JSON bytes for a `Metadata` whose storage_data maps indexes to `ShardLocation`s."""
    tensors: dict[str, Any] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise MetadataFormatError(f"checkpoint entry {fqn!r} is not a tensor")
        props = entry.properties
        if props.layout != torch.strided:
            raise MetadataFormatError(f"checkpoint entry {fqn!r} has layout {props.layout}; "
                                      f"only strided tensors are stored")
        tensors[fqn] = {"dtype": _dtype_name(props.dtype),
                        "requires_grad": bool(props.requires_grad),
                        "size": list(entry.size),
                        "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)}
                                   for c in entry.chunks]}
    storage = [{"fqn": index.fqn, "offset": list(index.offset or ()), "index": index.index,
                "file": loc.file, "at": loc.offset, "length": loc.length,
                "shape": list(loc.shape), "dtype": loc.dtype}
               for index, loc in (metadata.storage_data or {}).items()]
    planner = {k: list(v) for k, v in dict(metadata.planner_data or {}).items()}
    doc = {"format": METADATA_FORMAT, "version": METADATA_VERSION, "tensors": tensors,
           "planner_data": planner, "storage": storage}
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def _ints(value: Any, what: str, minimum: int = 0, dims: int | None = None) -> list[int]:
    """Ints in [minimum, 2**63) (what torch.Size holds), `dims` of them when given."""
    if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and minimum <= v < _INT64_END
            for v in value):
        raise MetadataFormatError(f"{what} must be a list of ints in [{minimum}, 2**63), "
                                  f"got {str(value)[:60]}")
    if dims is not None and len(value) != dims:
        raise MetadataFormatError(f"{what}: {str(value)[:60]} has {len(value)} dims, the "
                                  f"tensor has {dims}")
    return value


def _field(doc: Any, key: str, kind: type, what: str) -> Any:
    value = doc.get(key) if isinstance(doc, dict) else None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise MetadataFormatError(f"{what}.{key} must be a {kind.__name__}, "
                                  f"got {str(value)[:60]}")
    return value


def _tensor_entry(fqn: str, raw: Any) -> TensorStorageMetadata:
    what = f"tensors[{fqn[:60]!r}]"
    size = _ints(_field(raw, "size", list, what), f"{what}.size")
    chunks = []
    for c in _field(raw, "chunks", list, what):
        offsets = _ints(_field(c, "offsets", list, what), f"{what}.offsets", dims=len(size))
        sizes = _ints(_field(c, "sizes", list, what), f"{what}.sizes", dims=len(size))
        if any(o + n > whole for o, n, whole in zip(offsets, sizes, size)):
            raise MetadataFormatError(f"{what}: chunk at {str(offsets)[:40]} of "
                                      f"{str(sizes)[:40]} lies outside {str(size)[:40]}")
        chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
    props = TensorProperties(dtype=dtype_from_name(_field(raw, "dtype", str, what)),
                             requires_grad=bool(_field(raw, "requires_grad", bool, what)))
    return TensorStorageMetadata(props, torch.Size(size), chunks)


def _storage_entry(raw: Any) -> tuple[MetadataIndex, ShardLocation]:
    what = "storage[]"
    position = raw.get("index") if isinstance(raw, dict) else None
    if position is not None:  # DCP leaves it None for some items; it is only a lookup hint
        position = _field(raw, "index", int, what)
    index = MetadataIndex(_field(raw, "fqn", str, what),
                          torch.Size(_ints(_field(raw, "offset", list, what), what)), position)
    loc = ShardLocation(_field(raw, "file", str, what), _field(raw, "at", int, what),
                        _field(raw, "length", int, what),
                        tuple(_ints(_field(raw, "shape", list, what), what)),
                        _dtype_name(dtype_from_name(_field(raw, "dtype", str, what))))
    if not (0 <= loc.offset < _INT64_END and 0 <= loc.length < _INT64_END):
        raise MetadataFormatError(f"{what}: offset or length outside [0, 2**63) for "
                                  f"{index.fqn[:60]!r}")
    return index, loc


def _check_coverage(tensors: dict[str, TensorStorageMetadata],
                    storage: dict[MetadataIndex, ShardLocation]) -> None:
    """Every chunk is stored somewhere, with its shape; every stored piece is some chunk."""
    chunks = {(fqn, tuple(c.offsets)): tuple(c.sizes)
              for fqn, t in tensors.items() for c in t.chunks}
    for index, loc in storage.items():
        sizes = chunks.get((index.fqn, tuple(index.offset or ())))
        if sizes is None:
            raise MetadataFormatError(f"storage[]: {index.fqn[:60]!r} at "
                                      f"{str(list(index.offset or ()))[:40]} is no chunk of "
                                      f"any tensor")
        if loc.shape != sizes:
            raise MetadataFormatError(f"storage[]: {index.fqn[:60]!r} has shape "
                                      f"{str(list(loc.shape))[:40]}, its chunk {list(sizes)}")
    if len(chunks) != len(storage):
        stored = {(i.fqn, tuple(i.offset or ())) for i in storage}
        fqn, offsets = next(k for k in chunks if k not in stored)
        raise MetadataFormatError(f"tensors[{fqn[:60]!r}]: the chunk at {list(offsets)} is "
                                  f"stored nowhere")


def _planner_path(key: str, value: Any) -> tuple[str | int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, (str, int)) for v in value):
        raise MetadataFormatError(f"planner_data[{key[:60]!r}] must be a list of keys")
    return tuple(value)


def decode_metadata(data: bytes, url: str) -> Metadata:
    """Build DCP's `Metadata` from `encode_metadata`'s bytes; MetadataFormatError otherwise."""
    if data[:1] == _PICKLE_MAGIC:
        raise MetadataFormatError(legacy_refusal(url))
    if len(data) > MAX_METADATA_BYTES:
        raise MetadataFormatError(f"{url}: {len(data)} bytes is larger than any Tenax "
                                  f"metadata ({MAX_METADATA_BYTES})")
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise MetadataFormatError(f"{url} is not JSON checkpoint metadata: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != METADATA_FORMAT:
        raise MetadataFormatError(f"{url} is not {METADATA_FORMAT} JSON")
    version = doc.get("version")
    if version != METADATA_VERSION:
        raise MetadataFormatError(f"{url}: metadata version {str(version)[:20]} is not the one "
                                  f"this Tenax reads ({METADATA_VERSION})")
    try:
        tensors = {fqn: _tensor_entry(fqn, raw)
                   for fqn, raw in _field(doc, "tensors", dict, "metadata").items()}
        storage = dict(_storage_entry(raw) for raw in _field(doc, "storage", list, "metadata"))
        planner = {k: _planner_path(k, v)
                   for k, v in _field(doc, "planner_data", dict, "metadata").items()}
        _check_coverage(tensors, storage)
    except MetadataFormatError as exc:
        raise MetadataFormatError(f"{url}: {exc}") from None
    except (ArithmeticError, RecursionError, TypeError, ValueError) as exc:  # belt and braces
        raise MetadataFormatError(f"{url}: unreadable metadata: {type(exc).__name__}: "
                                  f"{str(exc)[:200]}") from None
    return Metadata(state_dict_metadata=tensors, planner_data=planner, storage_data=storage,
                    version=FORMAT)
