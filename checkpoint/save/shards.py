"""DCP storage plugins that separate planning a save from writing its bytes.

Why not DCP's FileSystemWriter: it serialises each tensor with `torch.save` while it writes, so
the byte offsets in `.metadata` are only known after the write, and the whole save must run
where the tensors are. Tenax wants the opposite split: plan on the training thread (DCP's
collectives, milliseconds), then write later from a snapshot — a forked low-priority process, a
background thread, or inline. So tensors are stored as raw contiguous bytes, one file per rank
(`__<rank>_0.distcp`), at offsets decided during planning; `.metadata` is DCP's own `Metadata`
whose `storage_data` maps each chunk to a `ShardLocation`, stored as JSON (metadata_codec.py:
nothing read from storage is unpickled). `RawReader`
(load/raw_reader.py) reads them back through `Storage` on any fsspec protocol, and DCP's load
planner does the resharding into any layout.

The format tag `FORMAT` goes into the manifest; stock DCP readers cannot read these files.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from tenax.checkpoint.errors import ShardError
from tenax.checkpoint.format.metadata_codec import FORMAT, ShardLocation, encode_metadata

logger = logging.getLogger(__name__)

def shard_file(rank: int) -> str:
    return f"__{rank}_0.distcp"


class DeferredWriter(StorageWriter):
    """Plans offsets and metadata during `dcp.save`, writes nothing.

    After `dcp.save(state, storage_writer=w)` returns, `w.tensors` lists this rank's
    (offset, tensor) pieces of `w.file` (None when dedup left the rank nothing to write) and, on
    the coordinator, `w.metadata_bytes` is the JSON `.metadata`. The caller writes them.
    """

    def __init__(self) -> None:
        super().__init__()
        self.file: str | None = None
        self.tensors: list[tuple[int, torch.Tensor]] = []
        self.items: list[Any] = []  # the final plan's write items, in file order
        self.total_bytes = 0
        self.metadata_bytes: bytes | None = None

    def reset(self, checkpoint_id: Any = None) -> None:
        self.file, self.tensors, self.items = None, [], []
        self.total_bytes, self.metadata_bytes = 0, None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=shard_file(i)) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results, offset = [], 0
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                raise ShardError(f"checkpoint entry {item.index.fqn!r} is not a tensor; the "
                                 f"training state must hold tensors only")
            tensor = planner.resolve_data(item).detach()
            nbytes = tensor.numel() * tensor.element_size()
            loc = ShardLocation(plan.storage_data, offset, nbytes, tuple(tensor.shape),
                                str(tensor.dtype).removeprefix("torch."))
            self.tensors.append((offset, tensor))
            self.items.append(item)
            results.append(WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=loc))
            offset += nbytes
        self.file = plan.storage_data if self.tensors else None
        self.total_bytes = offset
        fut: Future[list[WriteResult]] = Future()  # DCP calls .wait() on it
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
        metadata.version = FORMAT
        self.metadata_bytes = encode_metadata(metadata)

    def storage_meta(self) -> StorageMeta | None:
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # only ever passed explicitly as storage_writer
