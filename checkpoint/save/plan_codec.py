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
    for anything else."""
    if not isinstance(blob, str) or len(blob) > MAX_PLAN_BYTES:
        raise PlanFormatError("a handed save plan must be a JSON string of bounded size")
    try:
        doc = json.loads(blob)
        if doc["format"] != PLAN_FORMAT:
            raise PlanFormatError(f"save plan format {str(doc['format'])[:40]!r}")
        if (int(doc["rank"]), int(doc["world"])) != (rank, world):
            raise PlanFormatError(f"the save plan of rank {doc['rank']} of {doc['world']}, "
                                  f"not {rank} of {world}")
        metadata = doc["metadata"]
        return PlanCache(
            local_items=[_write_item(d) for d in doc["local"]],
            final_items=[_write_item(d) for d in doc["final"]],
            offsets=[int(o) for o in doc["offsets"]],
            file=None if doc["file"] is None else str(doc["file"]), nbytes=int(doc["nbytes"]),
            metadata_bytes=None if metadata is None else base64.b64decode(metadata, validate=True),
            token=int(doc["token"]))
    except (KeyError, TypeError, ValueError, MetadataFormatError) as exc:
        if isinstance(exc, PlanFormatError):
            raise
        raise PlanFormatError(f"unreadable save plan: {type(exc).__name__}: {exc}") from None


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


def _size(raw: Any) -> torch.Size:
    if not isinstance(raw, list) or not all(isinstance(v, int) and v >= 0 for v in raw):
        raise PlanFormatError(f"not a shape: {str(raw)[:40]}")
    return torch.Size(raw)


def _write_item(raw: dict[str, Any]) -> WriteItem:
    offset = raw["offset"]
    index = MetadataIndex(str(raw["fqn"]), None if offset is None else _size(offset),
                          None if raw["index"] is None else int(raw["index"]))
    tensor = None
    if "tensor" in raw:
        t = raw["tensor"]
        props = TensorProperties(dtype=dtype_from_name(t["dtype"]),
                                 layout=_LAYOUTS[t["layout"]],
                                 requires_grad=bool(t["requires_grad"]),
                                 memory_format=_MEMORY_FORMATS[t["memory_format"]],
                                 pin_memory=bool(t["pin_memory"]))
        tensor = TensorWriteData(ChunkStorageMetadata(_size(t["offsets"]), _size(t["sizes"])),
                                 props, _size(t["size"]))
    nbytes = raw.get("bytes")
    return WriteItem(index=index, type=WriteItemType[raw["type"]],
                     bytes_io_data=None if nbytes is None else BytesIOWriteData(int(nbytes)),
                     tensor_data=tensor)
