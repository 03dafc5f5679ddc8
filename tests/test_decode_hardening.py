"""The JSON decoders of things read back from outside the process: a handed save plan
(plan_codec) and a checkpoint's `.metadata` (metadata_codec). Whatever the bytes, a decoder
returns a well-formed object or raises its module's error type: never OverflowError,
RecursionError or a silently truncated plan."""
from __future__ import annotations

import json
from typing import Any, Callable

import pytest
import torch
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from tenax.checkpoint.errors import MetadataFormatError, PlanFormatError
from tenax.checkpoint.format.metadata_codec import decode_metadata
from tenax.checkpoint.save.plan_codec import decode_plan, encode_plan
from tenax.checkpoint.save.planning import PlanCache

DEEP = "[" * 200_000 + "]" * 200_000


def shard(fqn: str, offset: int, size: int, total: int) -> WriteItem:
    chunk = ChunkStorageMetadata(torch.Size([offset]), torch.Size([size]))
    return WriteItem(index=MetadataIndex(fqn, torch.Size([offset])), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk, TensorProperties(dtype=torch.float32),
                                                 torch.Size([total])))


def plan_doc() -> dict[str, Any]:
    items = [shard("w", 0, 4, 8), shard("w", 4, 4, 8)]
    cache = PlanCache(items, items, [0, 16], "__0_0.distcp", 32, b"meta", token=3)
    return json.loads(encode_plan(cache, 0, 1))


def test_a_good_plan_round_trips() -> None:
    cache = decode_plan(json.dumps(plan_doc()), 0, 1)
    assert cache.offsets == [0, 16] and len(cache.final_items) == 2 and cache.token == 3


@pytest.mark.parametrize("change", [
    lambda d: d.update(offsets=[0]),  # fewer offsets than items: the zip would drop one
    lambda d: d.update(offsets=[0, 16, 32]),
    lambda d: d.update(offsets=[0, -16]),
    lambda d: d.update(offsets=[0, "16"]),
    lambda d: d.update(nbytes=-1),
    lambda d: d["final"][0]["tensor"].update(sizes=[2 ** 70]),  # OverflowError in torch.Size
    lambda d: d["final"][0]["tensor"].update(offsets=[0, 0]),  # dims disagree with size
    lambda d: d["final"][0].update(offset=[2 ** 70]),
    lambda d: d.update(token=2 ** 80),
    lambda d: d.update(rank=float("inf")),
], ids=["fewer-offsets", "more-offsets", "negative-offset", "string-offset", "negative-nbytes",
        "huge-size", "dims", "huge-index-offset", "huge-token", "inf-rank"])
def test_a_malformed_plan_is_a_plan_format_error(change: Callable[[dict], Any]) -> None:
    doc = plan_doc()
    change(doc)
    with pytest.raises(PlanFormatError):
        decode_plan(json.dumps(doc), 0, 1)


def test_a_deeply_nested_plan_is_a_plan_format_error() -> None:
    with pytest.raises(PlanFormatError):
        decode_plan(DEEP, 0, 1)
    with pytest.raises(PlanFormatError):
        decode_plan('{"format": ' + DEEP + "}", 0, 1)


GOOD = {"format": "tenax-dcp-metadata", "version": 1, "planner_data": {"w": ["w"]},
        "tensors": {"w": {"dtype": "float32", "requires_grad": False, "size": [8],
                          "chunks": [{"offsets": [0], "sizes": [4]},
                                     {"offsets": [4], "sizes": [4]}]}},
        "storage": [{"fqn": "w", "offset": [0], "index": 0, "file": "__0_0.distcp", "at": 0,
                     "length": 16, "shape": [4], "dtype": "float32"},
                    {"fqn": "w", "offset": [4], "index": 1, "file": "__0_0.distcp", "at": 16,
                     "length": 16, "shape": [4], "dtype": "float32"}]}


def metadata(change: Callable[[dict], Any] | None = None) -> bytes:
    doc = json.loads(json.dumps(GOOD))
    if change is not None:
        change(doc)
    return json.dumps(doc).encode()


@pytest.mark.parametrize("change", [
    lambda d: d["tensors"]["w"].update(size=[2 ** 70]),
    lambda d: d["tensors"]["w"]["chunks"][0].update(sizes=[2 ** 70]),
    lambda d: d["storage"][0].update(offset=[2 ** 70]),
    lambda d: d["tensors"]["w"]["chunks"][0].update(offsets=[]),  # fewer offsets than dims
    lambda d: d["tensors"]["w"]["chunks"][0].update(sizes=[4, 1]),
    lambda d: d["tensors"]["w"]["chunks"][1].update(sizes=[9]),  # past the tensor's end
    lambda d: d["storage"][1].update(offset=[]),
    lambda d: d["storage"].pop(),  # a chunk with nowhere to read it from
    lambda d: d["storage"][1].update(shape=[4, 4]),
    lambda d: d["storage"][1].update(at=2 ** 64),
], ids=["huge-size", "huge-chunk", "huge-storage-offset", "fewer-offsets", "more-sizes",
        "past-the-end", "storage-dims", "missing-storage", "storage-shape", "huge-at"])
def test_malformed_metadata_is_a_metadata_format_error(change: Callable[[dict], Any]) -> None:
    decode_metadata(metadata(), "file:///x/.metadata")  # the baseline decodes
    with pytest.raises(MetadataFormatError, match="/x/.metadata"):
        decode_metadata(metadata(change), "file:///x/.metadata")


def test_deeply_nested_metadata_is_a_metadata_format_error() -> None:
    with pytest.raises(MetadataFormatError):
        decode_metadata(DEEP.encode(), "file:///x/.metadata")


# ---- snapshot stamps ----------------------------------------------------------------------------
def good_stamp() -> dict[str, Any]:
    return {"generation": 3, "rank": 1, "world": 2, "step": 7, "files": {"model.bin": [64, 99]},
            "commit": {"layout": {}}, "written_at": 1.0}


@pytest.mark.parametrize("change", [
    {"step": 1e400},                          # inf: int() raised OverflowError before
    {"generation": -1},
    {"rank": True},
    {"world": 2.5},
    {"files": {"model.bin": [64]}},           # fewer items than [bytes, crc32c]
    {"files": {"model.bin": [64, 99, 5]}},
    {"files": {"model.bin": [64, -1]}},
    {"files": {"model.bin": [2**63, 0]}},
    {"files": ["model.bin"]},
    {"commit": [1, 2]},
    {"written_at": "soon"},
    {"written_at": 1e400},
])
def test_a_bad_snapshot_stamp_is_a_snapshot_error(change: dict[str, Any]) -> None:
    from tenax.checkpoint.errors import SnapshotError
    from tenax.checkpoint.memory.snapshot_store import SnapshotStamp

    assert SnapshotStamp.from_json(json.dumps(good_stamp())).files == {"model.bin": [64, 99]}
    with pytest.raises(SnapshotError):
        SnapshotStamp.from_json(json.dumps({**good_stamp(), **change}))


def test_a_deeply_nested_snapshot_stamp_is_a_snapshot_error() -> None:
    from tenax.checkpoint.errors import SnapshotError
    from tenax.checkpoint.memory.snapshot_store import SnapshotStamp

    with pytest.raises(SnapshotError):
        SnapshotStamp.from_json('{"commit": ' + "[" * 100_000 + "]" * 100_000 + "}")
