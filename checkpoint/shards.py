"""DCP storage plugins that separate planning a save from writing its bytes.

Why not DCP's FileSystemWriter: it serialises each tensor with `torch.save` while it writes, so
the byte offsets in `.metadata` are only known after the write, and the whole save must run
where the tensors are. Tenax wants the opposite split: plan on the training thread (DCP's
collectives, milliseconds), then write later from a snapshot — a forked low-priority process, a
background thread, or inline. So tensors are stored as raw contiguous bytes, one file per rank
(`__<rank>_0.distcp`), at offsets decided during planning; `.metadata` is DCP's own `Metadata`
whose `storage_data` maps each chunk to a `ShardLocation`, stored as JSON (metadata_codec.py:
nothing read from storage is unpickled). `RawReader` reads them back through
`Storage` on any fsspec protocol, and DCP's load planner does the resharding into any layout.

The format tag `FORMAT` goes into the manifest; stock DCP readers cannot read these files.
"""
from __future__ import annotations

import dataclasses
import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch.futures import Future
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, ReadItem,
                                                  SavePlan, SavePlanner, WriteItemType)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from checkpoint.local_reads import LocalChunkReader
from checkpoint.manifest import METADATA_NAME
from checkpoint.metadata_codec import (FORMAT, MetadataFormatError, ShardLocation,
                                       decode_metadata, dtype_from_name, encode_metadata)
from checkpoint.storage import Storage

logger = logging.getLogger(__name__)

READ_WINDOW = 4  # stored chunks read concurrently (object stores are latency-bound)


class ShardError(Exception):
    """A shard cannot be planned or read; the message names the file and tensor."""

    def __init__(self, message: str) -> None:
        super().__init__(message)




def shard_file(rank: int) -> str:
    return f"__{rank}_0.distcp"


def byte_view(tensor: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a CPU tensor's bytes (a copy only if it is not contiguous)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        raise ShardError(f"byte_view needs a CPU tensor, got one on {t.device}; stage it first")
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


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



class RawReader(StorageReader):
    """Reads a version written through `DeferredWriter` from `storage`/`version`.

    Each stored chunk is read once per rank, and only the rows (dim 0) that this rank's
    destination pieces need, so loading into a layout that shards dim 0 differently reads no
    more bytes than a same-layout load.
    """

    def __init__(self, storage: Storage, version: str) -> None:
        super().__init__()
        self.storage, self.version = storage, version
        self.storage_data: dict[MetadataIndex, ShardLocation] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        self.storage_data = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rel = f"{self.version}/{METADATA_NAME}"
        try:
            return decode_metadata(self.storage.read_bytes(rel), self.storage.url(rel))
        except MetadataFormatError as exc:
            raise ShardError(str(exc)) from None

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self.storage_data = dict(metadata.storage_data or {})

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_chunk: dict[MetadataIndex, list[ReadItem]] = {}
        for req in plan.items:
            if req.type == LoadItemType.BYTE_IO:
                raise ShardError(f"{req.storage_index.fqn!r}: byte entries are not supported")
            by_chunk.setdefault(req.storage_index, []).append(req)
        if self.storage.is_local:
            with LocalChunkReader(self.storage, self.version) as files:
                for index, reqs in by_chunk.items():
                    self._read_local(planner, files, index, reqs)
        else:
            self._read_windowed(planner, by_chunk)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_windowed(self, planner: LoadPlanner,
                       by_chunk: dict[MetadataIndex, list[ReadItem]]) -> None:
        with ThreadPoolExecutor(max_workers=READ_WINDOW) as pool:
            window: deque = deque()
            for index, reqs in by_chunk.items():
                window.append((reqs, pool.submit(self._read_rows, index, reqs)))
                if len(window) >= READ_WINDOW:  # bound memory: consume before reading more
                    reqs, fut = window.popleft()
                    self._install(planner, reqs, *fut.result())
            while window:
                reqs, fut = window.popleft()
                self._install(planner, reqs, *fut.result())

    def _read_local(self, planner: LoadPlanner, files: LocalChunkReader, index: MetadataIndex,
                    reqs: list[ReadItem]) -> None:
        """Pieces that are whole rows of the stored chunk are read straight into their
        destination; the others are cut from the rows that cover them."""
        loc = self._location(index)
        rest = []
        for req in reqs:
            target = planner.resolve_tensor(req).detach()
            start = _direct_offset(req, loc, target)
            if start is None:
                rest.append(req)
                continue
            if target.numel():
                files.read_into(loc.file, start, byte_view(target))
            planner.commit_tensor(req, target)
        if rest:
            self._install(planner, rest, *self._read_rows(index, rest, files))

    def _location(self, index: MetadataIndex) -> ShardLocation:
        loc = self.storage_data.get(index)
        if loc is None:
            raise ShardError(f"{self.version}: no stored chunk for {index.fqn!r} at "
                             f"{tuple(index.offset or ())}")
        return loc

    def _read_rows(self, index: MetadataIndex, reqs: list[ReadItem],
                   files: LocalChunkReader | None = None) -> tuple[int, torch.Tensor]:
        """The rows [lo, hi) of the stored chunk that cover every request; returns (lo, rows)."""
        loc = self._location(index)
        dtype, shape = dtype_from_name(loc.dtype), loc.shape
        if not shape:
            lo, hi, row_bytes = 0, 1, loc.length
        else:
            lo = min(r.storage_offsets[0] for r in reqs)
            hi = max(r.storage_offsets[0] + r.lengths[0] for r in reqs)
            row_bytes = _row_bytes(loc)
        out = torch.empty((hi - lo, *shape[1:]) if shape else (), dtype=dtype)
        rel = f"{self.version}/{loc.file}"
        start, end = loc.offset + lo * row_bytes, loc.offset + hi * row_bytes
        if end > start and files is not None:
            files.read_into(loc.file, start, byte_view(out))
        elif end > start:
            data = self.storage.read_range(rel, start, end)
            if len(data) != end - start:
                raise ShardError(f"{self.storage.url(rel)}: short read for {index.fqn!r} "
                                 f"({len(data)} of {end - start} bytes)")
            byte_view(out)[:] = np.frombuffer(data, dtype=np.uint8)
        return lo, out

    @staticmethod
    def _install(planner: LoadPlanner, reqs: list[ReadItem], lo: int, rows: torch.Tensor) -> None:
        for req in reqs:
            src = rows
            for dim, (off, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                src = src.narrow(dim, off - lo if dim == 0 else off, length)
            target = planner.resolve_tensor(req).detach()
            if target.shape != src.shape:
                raise ShardError(f"{req.storage_index.fqn!r}: stored piece {tuple(src.shape)} "
                                 f"does not fit destination {tuple(target.shape)}")
            target.copy_(src)
            planner.commit_tensor(req, target)


def _direct_offset(req: ReadItem, loc: ShardLocation, target: torch.Tensor) -> int | None:
    """Where in the file `req`'s bytes start when they are one contiguous range laid out exactly
    as `target` (whole rows of the stored chunk, same dtype and shape, contiguous destination);
    None when the piece must be cut from its rows instead."""
    shape = tuple(loc.shape)
    if (not target.is_contiguous() or target.dtype != dtype_from_name(loc.dtype)
            or tuple(target.shape) != tuple(req.lengths)):
        return None
    if not shape:
        return loc.offset
    first, rows = req.storage_offsets[0], req.lengths[0]
    if first < 0 or first + rows > shape[0]:
        raise ShardError(f"{req.storage_index.fqn!r}: rows [{first}, {first + rows}) are outside "
                         f"the stored chunk of {shape[0]} rows")
    if any(off != 0 or n != full for off, n, full in
           zip(req.storage_offsets[1:], req.lengths[1:], shape[1:])):
        return None
    return loc.offset + first * _row_bytes(loc)


def _row_bytes(loc: ShardLocation) -> int:
    """Bytes of one dim-0 row of a stored chunk (of a non-scalar shape)."""
    return loc.length // loc.shape[0] if loc.shape[0] else 0
