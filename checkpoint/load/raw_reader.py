"""RawReader: a version written by `DeferredWriter` (save/shards.py), read back for DCP's load.

DCP's load planner decides which stored pieces each rank's destination tensors need (the
resharding); this reader fetches exactly those bytes through `Storage`, row ranges only.
"""
from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from tenax.checkpoint.errors import MetadataFormatError, ShardError
from tenax.checkpoint.format.manifest import METADATA_NAME
from tenax.checkpoint.format.metadata_codec import ShardLocation, decode_metadata, dtype_from_name
from tenax.checkpoint.format.storage import Storage
from tenax.checkpoint.load.local_reads import LocalChunkReader
from tenax.checkpoint.load.parallel_reads import read_pieces
from tenax.checkpoint.tensor_bytes import byte_view

logger = logging.getLogger(__name__)

READ_WINDOW = 4  # stored chunks read concurrently (object stores are latency-bound)


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
                direct: list[tuple[ReadItem, str, int, torch.Tensor]] = []
                for index, reqs in by_chunk.items():
                    self._read_local(planner, files, index, reqs, direct)
                for _, file, _, _ in direct:
                    files.open(file)  # here, before the reading threads share the reader
                read_pieces(files, [(file, start, target) for _, file, start, target in direct])
                for req, _, _, target in direct:
                    planner.commit_tensor(req, target)
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
                    reqs: list[ReadItem], direct: list[tuple[ReadItem, str, int, torch.Tensor]]
                    ) -> None:
        """Pieces that are whole rows of the stored chunk go to `direct`, to be read straight
        into their destination by parallel threads (parallel_reads.py); the others are cut
        from the rows that cover them, here."""
        loc = self._location(index)
        rest = []
        for req in reqs:
            target = planner.resolve_tensor(req).detach()
            start = _direct_offset(req, loc, target)
            if start is None:
                rest.append(req)
            else:
                direct.append((req, loc.file, start, target))
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
    as `target` (whole rows of the stored chunk, same dtype and shape, contiguous destination
    on the host or a CUDA device); None when the piece must be cut from its rows instead."""
    shape = tuple(loc.shape)
    if (target.device.type not in ("cpu", "cuda") or not target.is_contiguous()
            or target.dtype != dtype_from_name(loc.dtype)
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
