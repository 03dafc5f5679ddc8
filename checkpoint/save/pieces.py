"""Save-side training state that never gathers ZeRO-1/2 optimizer moments.

Why: `reshard.training_state` all-gathers every ZeRO-1/2 moment into parameter shape on every
rank (2 x params bytes through the process group, on the training thread), and DCP's dedup
then writes only one copy. Measured on 2 ranks with 60 MB of state that gather was 60-100 ms of
the save's blocked time — most of it. Here each rank instead contributes its own flat chunk of
each moment as the few hyper-rectangles of the parameter-shaped tensor that chunk covers (a flat
range of a row-major tensor is at most 2*ndim-1 boxes, each a view of the chunk: no copy), under
the same keys, global shapes and offsets `training_state` uses. The checkpoint is therefore
byte-for-byte the same kind of thing, and `training_state(for_load=True)` +
`apply_training_state` load it into any layout.

The planner below adds these pieces to DCP's plan as ordinary SHARD write items, so DCP's global
plan, coverage validation and metadata treat them like any sharded tensor.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def flat_range_boxes(shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    """Hyper-rectangles covering flat elements [start, end) of a row-major `shape`, in order."""
    if end <= start:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    boxes: list[Box] = []
    row = start // inner
    if start % inner:  # partial first row
        stop = min(end, (row + 1) * inner)
        boxes += [((row, *o), (1, *s)) for o, s in
                  flat_range_boxes(shape[1:], start - row * inner, stop - row * inner)]
        start, row = stop, row + 1
    last = end // inner
    if start < end and last > row:  # whole rows
        boxes.append(((row, *[0] * (len(shape) - 1)), (last - row, *shape[1:])))
    if start < end and end % inner and last >= row:  # partial last row
        boxes += [((last, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], 0, end % inner)]
    return boxes


@dataclass
class PiecewiseTensor:
    """This rank's pieces of one global tensor: views keyed by their global offsets."""

    size: tuple[int, ...]
    pieces: list[tuple[tuple[int, ...], torch.Tensor]]


def _global_offset(p: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offset of this rank's local shard, global shape) — how DCP itself places `p`."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        chunks = p.__create_chunk_list__()  # DCP's own protocol for a DTensor's local shard
        return tuple(chunks[0].offsets), tuple(p.shape)
    return (0,) * p.dim(), tuple(p.shape)


def _moment_pieces(p: torch.Tensor, dp: Any, flat: torch.Tensor | None) -> PiecewiseTensor:
    from tenax.parallel import local

    shape = tuple(local(p).shape)
    numel = math.prod(shape)
    chunk = math.ceil(numel / dp.world)  # DataParallel's per-parameter flat chunking
    start = min(dp.rank * chunk, numel)
    end = min(start + chunk, numel)
    if flat is None:
        flat = torch.zeros(end - start, dtype=local(p).dtype, device=local(p).device)
    if flat.numel() != end - start:
        raise ValueError(f"ZeRO chunk of {tuple(shape)} has {flat.numel()} elements, expected "
                         f"{end - start} (rank {dp.rank} of {dp.world})")
    base, size = _global_offset(p)
    flat, pos, pieces = flat.reshape(-1), 0, []
    for offsets, sizes in flat_range_boxes(shape, start, end):
        n = math.prod(sizes)
        pieces.append((tuple(b + o for b, o in zip(base, offsets)),
                       flat[pos:pos + n].view(sizes)))
        pos += n
    return PiecewiseTensor(size, pieces)


def save_state(trainer: Any) -> tuple[dict[str, torch.Tensor], dict[str, PiecewiseTensor]]:
    """(plain entries, piecewise entries) for DCP; same keys as `training_state(trainer)`."""
    from tenax.checkpoint.load.reshard import (MOMENTS, agree_on_step, local_step, model_state,
                                               param_states, training_state)

    if trainer.layout.zero not in (1, 2) or not isinstance(trainer.optimizer, torch.optim.AdamW):
        return training_state(trainer), {}  # nothing to gather in these cases
    plain = {f"model.{k}": v for k, v in model_state(trainer).items()}
    pieces: dict[str, PiecewiseTensor] = {}
    states = list(param_states(trainer))
    for s in states:
        for moment in MOMENTS:
            if s.dp is None:
                if moment in s.state:
                    plain[f"{s.key}.{moment}"] = s.state[moment]
                continue
            pieces[f"{s.key}.{moment}"] = _moment_pieces(s.param, s.dp, s.state.get(moment))
    plain["optim.step"] = agree_on_step(local_step(states))
    return plain, pieces


def state_fingerprint(trainer: Any) -> tuple[tuple[Any, ...], torch.Tensor]:
    """(identity of every tensor a save of `trainer` reads, this rank's optimizer step count).

    The identity is each parameter's and each of its optimizer moments' storage address,
    shape, strides and dtype, in order; no communication. Why it is enough to reuse a save plan
    and its tensor views: the engine changes parameters and moments only in place; anything
    that replaces one (a load, the optimizer's first step creating its state, another layout)
    changes an address here, and a replaced tensor cannot reappear at its old address while a
    cached plan still holds views of the old one. The step count is the one value a save holds
    by copy (`optim.step`), picked by the same walk (`reshard.param_states`) a save takes and
    left where the optimizer counts it; the caller takes the largest over ranks, as a save
    does.
    """
    from tenax.checkpoint.load.reshard import MOMENTS, local_step, param_states

    states = list(param_states(trainer))
    out: list[Any] = [trainer.layout.zero, type(trainer.optimizer).__name__]
    out += [(s.name, _identity(s.param), tuple(_identity(s.state.get(m)) for m in MOMENTS))
            for s in states]
    return tuple(out), local_step(states, on_host=False)


def _identity(t: torch.Tensor | None) -> tuple[Any, ...] | None:
    from tenax.parallel import local

    if t is None:
        return None
    t = local(t)
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype


class PiecewiseSavePlanner(DefaultSavePlanner):
    """DCP's default planner plus this rank's piecewise tensors as SHARD write items."""

    def __init__(self, pieces: dict[str, PiecewiseTensor]) -> None:
        super().__init__()
        self._pieces = pieces
        self._views: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = list(plan.items)
        for fqn, entry in self._pieces.items():
            for offsets, view in entry.pieces:
                self._views[(fqn, offsets)] = view
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=view.shape)
                items.append(WriteItem(
                    index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=chunk, properties=TensorProperties.create_from_tensor(view),
                        size=torch.Size(entry.size))))
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        key = (write_item.index.fqn, tuple(write_item.index.offset or ()))
        view = self._views.get(key)
        return view if view is not None else super().resolve_data(write_item)
