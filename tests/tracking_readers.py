"""Read what the tracking backends wrote, independently of the code that wrote it: TensorBoard
through its own EventAccumulator, W&B offline runs by parsing their `.wandb` files (a LevelDB
log of `wandb_internal_pb2.Record`s; wandb ships no Python reader for them any more)."""
from __future__ import annotations

import json
import logging
import struct
from pathlib import Path
from typing import Any, Iterator

logger = logging.getLogger(__name__)

WANDB_BLOCK = 32768
WANDB_HEADER = 7  # ":W&B", magic 0xBEE1 (LE), version
FULL, LAST = 1, 4


def tensorboard_scalars(logdir: Path | str) -> dict[str, list[tuple[int, float]]]:
    """Tag -> [(step, value)] as TensorBoard shows it (orphaned steps purged)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def tensorboard_texts(logdir: Path | str) -> dict[str, list[tuple[int, str]]]:
    """Tag -> [(step, text)] of the text entries."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]
            for tag in acc.Tags()["tensors"]}


def wandb_records(path: Path | str) -> Iterator[Any]:
    """Every Record of one `.wandb` file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B data file (starts {data[:7]!r})")
    pos, pending = WANDB_HEADER, b""
    while pos + 7 <= len(data):
        left = WANDB_BLOCK - pos % WANDB_BLOCK
        if left < 7:  # a block's tail too short for a record header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        body, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            continue
        pending += body
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_run(run_dir: Path | str) -> dict[str, Any]:
    """{"id", "config": {key: value}, "history": [{key: value}]} of one offline run directory."""
    files = list(Path(run_dir).glob("run-*.wandb"))
    if len(files) != 1:
        raise ValueError(f"{run_dir}: expected one run-*.wandb file, found {files}")
    out: dict[str, Any] = {"id": "", "config": {}, "history": []}
    for record in wandb_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["id"] = record.run.run_id
            for item in record.run.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "history":
            out["history"].append({item.key or "/".join(item.nested_key): json.loads(
                item.value_json) for item in record.history.item})
    return out
