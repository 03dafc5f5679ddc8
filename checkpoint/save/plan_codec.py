"""PlanCodec: one rank's cached save plan as JSON, so a restarted training process reuses it.

Why: a new training process planned its first save from scratch — DCP's collective planning,
~0.1 s of the training thread on 2 gloo ranks, at every restart (the largest fixed cost left
in a killed rank's recovery after the redone step itself). The rank's agent outlives the
process: it keeps the newest plan this codec encodes and hands it to the next process, which
uses it only if every rank's own plan is unchanged and all of them come from the same
planning round (checkpoint/save/planning.py checks both, collectively). JSON, never pickle: the
blob crosses a process boundary, and decoding builds DCP's objects from checked primitives
(the same rule as `.metadata`, metadata_codec.py).
"""
from __future__ import annotations

import base64
import json
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import (BytesIOWriteData, TensorWriteData, WriteItem,
                                                  WriteItemType)

from tenax.checkpoint.errors import MetadataFormatError, PlanFormatError
from tenax.checkpoint.format.metadata_codec import dtype_from_name
from tenax.checkpoint.save.planning import PlanCache

PLAN_FORMAT = "tenax-save-plan-1"
MAX_PLAN_BYTES = 64 << 20
_LAYOUTS = {str(v): v for v in (torch.strided, torch.sparse_coo)}
_MEMORY_FORMATS = {str(v): v for v in (torch.contiguous_format, torch.preserve_format,
                                       torch.channels_last, torch.channels_last_3d)}


def encode_plan(cache: PlanCache, rank: int, world: int) -> str:
    return json.dumps({
        "format": PLAN_FORMAT, "rank": rank, "world": world, "token": cache.token,
        "file": cache.file, "nbytes": cache.nbytes, "offsets": cache.offsets,
        "metadata": None if cache.metadata_bytes is None
        else base64.b64encode(cache.metadata_bytes).decode("ascii"),
        "local": [_item(i) for i in cache.local_items],
        "final": [_item(i) for i in cache.final_items]})


def decode_plan(blob: str, rank: int, world: int) -> PlanCache:
    """The plan `encode_plan` wrote for this rank of a group of this size; PlanFormatError
    for anything else (whatever the JSON holds: no OverflowError or RecursionError escapes)."""
    if not isinstance(blob, str) or len(blob) > MAX_PLAN_BYTES:
        raise PlanFormatError("a handed save plan must be a JSON string of bounded size")
    try:
        doc = json.loads(blob)
        if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT:
            found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise PlanFormatError(f"save plan format {str(found)[:40]!r}")
        if (_count(doc["rank"], "rank"), _count(doc["world"], "world")) != (rank, world):
            raise PlanFormatError(f"the save plan of rank {doc['rank']} of {doc['world']}, "
                                  f"not {rank} of {world}")
        return _plan_cache(doc)
    except PlanFormatError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, ArithmeticError, RecursionError,
            MetadataFormatError) as exc:  # ArithmeticError: an int too large for torch.Size
        raise PlanFormatError(f"unreadable save plan: {type(exc).__name__}: "
                              f"{str(exc)[:200]}") from None


def _count(value: Any, what: str, limit: int = 1 << 63) -> int:
    """A JSON int in [0, limit): never a bool, float or string that int() would accept."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < limit:
        raise PlanFormatError(f"save plan {what}: {str(value)[:40]} is not an int in "
                              f"[0, {limit})")
    return value


def _plan_cache(doc: dict[str, Any]) -> PlanCache:
    final = [_write_item(d) for d in _list(doc["final"], "final")]
    offsets = [_count(o, "offsets[]") for o in _list(doc["offsets"], "offsets")]
    if len(offsets) != len(final):  # each final item is written at its offset: one per item
        raise PlanFormatError(f"save plan has {len(offsets)} offsets for {len(final)} items")
    metadata = doc["metadata"]
    return PlanCache(
        local_items=[_write_item(d) for d in _list(doc["local"], "local")],
        final_items=final, offsets=offsets,
        file=None if doc["file"] is None else str(doc["file"]),
        nbytes=_count(doc["nbytes"], "nbytes"),
        metadata_bytes=None if metadata is None else base64.b64decode(metadata, validate=True),
        token=_count(doc["token"], "token"))


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise PlanFormatError(f"save plan {what}: not a list")
    return value


def _item(item: WriteItem) -> dict[str, Any]:
    index = item.index
    out: dict[str, Any] = {"fqn": index.fqn, "type": item.type.name, "index": index.index,
                           "offset": None if index.offset is None else list(index.offset)}
    if item.bytes_io_data is not None:
        out["bytes"] = item.bytes_io_data.nbytes
    if item.tensor_data is not None:
        data, props = item.tensor_data, item.tensor_data.properties
        out["tensor"] = {"offsets": list(data.chunk.offsets), "sizes": list(data.chunk.sizes),
                         "size": list(data.size),
                         "dtype": str(props.dtype).removeprefix("torch."),
                         "layout": str(props.layout), "requires_grad": props.requires_grad,
                         "memory_format": str(props.memory_format),
                         "pin_memory": props.pin_memory}
    return out


def _size(raw: Any, dims: int | None = None) -> torch.Size:
    if not isinstance(raw, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 63 for v in raw):
        raise PlanFormatError(f"not a shape: {str(raw)[:40]}")
    if dims is not None and len(raw) != dims:
        raise PlanFormatError(f"shape {str(raw)[:40]} has {len(raw)} dims, not {dims}")
    return torch.Size(raw)


def _write_item(raw: dict[str, Any]) -> WriteItem:
    offset = raw["offset"]
    tensor = _tensor_data(raw["tensor"]) if "tensor" in raw else None
    dims = None if tensor is None else len(tensor.size)
    index = MetadataIndex(str(raw["fqn"]), None if offset is None else _size(offset, dims),
                          None if raw["index"] is None else _count(raw["index"], "index"))
    nbytes = raw.get("bytes")
    return WriteItem(index=index, type=WriteItemType[raw["type"]],
                     bytes_io_data=None if nbytes is None
                     else BytesIOWriteData(_count(nbytes, "bytes")),
                     tensor_data=tensor)


def _tensor_data(t: dict[str, Any]) -> TensorWriteData:
    props = TensorProperties(dtype=dtype_from_name(t["dtype"]),
                             layout=_LAYOUTS[t["layout"]],
                             requires_grad=bool(t["requires_grad"]),
                             memory_format=_MEMORY_FORMATS[t["memory_format"]],
                             pin_memory=bool(t["pin_memory"]))
    size = _size(t["size"])
    chunk = ChunkStorageMetadata(_size(t["offsets"], len(size)), _size(t["sizes"], len(size)))
    return TensorWriteData(chunk, props, size)
