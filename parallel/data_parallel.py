"""Data parallelism: plain DDP (zero 0), ZeRO-1, ZeRO-2 by hand, ZeRO-3 via FSDP2.

Why hand-written for stages 0-2: torch's DDP refuses DTensor (TP) parameters and FSDP2 has no
"shard only the optimizer" mode, while users need every stage to shard exactly what its name
says, on top of TP, with a memory ledger they can check. So:

- zero 0: every rank keeps full params, grads and optimizer state; grads are averaged with
  bucketed all-reduces launched from post-accumulate-grad hooks during the last micro-batch's
  backward, so communication overlaps the rest of the backward pass.
- zero 1: as zero 0 for grads, but each rank's optimizer owns one 1/N chunk of every parameter
  (a *view* into the parameter, so no extra copy of the weights); after the step the chunks are
  all-gathered back into the full parameters.
- zero 2: grads are reduce-scattered instead, so a rank keeps only its chunk of every grad (full
  grads are freed once reduced); optimizer and all-gather as zero 1.
- zero 3: FSDP2 `fully_shard` per block, then the root.

All stages *average* gradients over the dp group; the trainer scales each rank's loss so that the
average equals the gradient of the global-batch mean loss.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 4 * 2**20


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local storage of a tensor (a DTensor's shard, else the tensor itself)."""
    return t._local_tensor if isinstance(t, DTensor) else t


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    chunks: list[int]  # per param: ceil(local numel / N), the ZeRO chunk length
    pending: int = 0
    work: dist.Work | None = None
    buffer: torch.Tensor | None = None
    shard_grad: torch.Tensor | None = None  # zero 2: this rank's reduced chunk of every grad

    @property
    def chunk_total(self) -> int:
        return sum(self.chunks)


@dataclass
class DataParallel:
    """Gradient sync and optimizer sharding for zero 0-2 of `params` over one process group.

    `divisor` is what the summed gradients are divided by: the group size for ordinary
    parameters; for MoE experts, whose grads already hold their whole ep group's tokens, it is
    dp*cp while the group is only the dp*cp/ep ranks holding the same experts. `overlap=False`
    (pipeline schedules, which run backward outside our micro-batch loop) launches every bucket
    in `finish_grads` instead of from the backward hooks.
    """
    params: list[nn.Parameter]
    group: dist.ProcessGroup
    zero: int
    divisor: int | None = None
    overlap: bool = True
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    buckets: list[_Bucket] = field(default_factory=list)
    _last_micro: bool = False
    _shards: list[tuple[nn.Parameter, nn.Parameter]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.zero not in (0, 1, 2):
            raise ValueError(f"DataParallel handles zero 0-2, got {self.zero} (zero 3 is FSDP2)")
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.divisor = self.divisor or self.world
        self._build_buckets()
        if self.zero >= 1:
            self._shards = self._make_shards()

    # ---- set-up ----------------------------------------------------------------------------
    def _build_buckets(self) -> None:
        # Grads become ready roughly in reverse registration order, so bucket in that order.
        params = [p for p in self.params if p.requires_grad]
        current: list[nn.Parameter] = []
        size = 0
        for p in reversed(params):
            current.append(p)
            size += local(p).numel() * local(p).element_size()
            if size >= self.bucket_bytes:
                self.buckets.append(self._new_bucket(current))
                current, size = [], 0
        if current:
            self.buckets.append(self._new_bucket(current))
        for bucket in self.buckets:
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(self._make_hook(bucket))

    def _new_bucket(self, params: list[nn.Parameter]) -> _Bucket:
        return _Bucket(params, [math.ceil(local(p).numel() / self.world) for p in params])

    def _make_hook(self, bucket: _Bucket):
        def hook(_: torch.Tensor) -> None:
            if self._last_micro and self.overlap:
                bucket.pending -= 1
                if bucket.pending == 0:
                    self._launch(bucket)
        return hook

    def _chunk_range(self, numel: int, chunk: int) -> tuple[int, int]:
        start = min(self.rank * chunk, numel)
        return start, min(start + chunk, numel)

    def _make_shards(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """(param, shard) pairs; a shard is a view of this rank's chunk of the param."""
        pairs = []
        for bucket in self.buckets:
            for p, chunk in zip(bucket.params, bucket.chunks):
                flat = local(p).data.view(-1)
                start, end = self._chunk_range(flat.numel(), chunk)
                if end > start:
                    pairs.append((p, nn.Parameter(flat[start:end])))
        return pairs

    def shard_of(self, p: nn.Parameter) -> nn.Parameter | None:
        """This rank's optimizer-owned chunk of `p` (None when the chunk is empty)."""
        return dict(self._shards).get(p)

    def _chunk_len(self, p: nn.Parameter) -> int:
        return math.ceil(local(p).numel() / self.world)

    def gather_full(self, p: nn.Parameter, chunk: torch.Tensor | None) -> torch.Tensor:
        """All-gather every rank's chunk of a per-element state of `p` into p's local shape.

        Checkpoints store optimizer moments in the parameter's own shape so that any other
        layout can load them; ZeRO-1/2 keep them as flat chunks, hence this (collective) call.
        """
        c = self._chunk_len(p)
        send = torch.zeros(c, dtype=local(p).dtype, device=local(p).device)
        if chunk is not None:
            send[:chunk.numel()] = chunk.reshape(-1)
        recv = torch.empty(self.world * c, dtype=send.dtype, device=send.device)
        dist.all_gather_single(recv, send, group=self.group)
        return recv[:local(p).numel()].view_as(local(p))

    def chunk_view(self, p: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a tensor shaped like p's local shard."""
        start, end = self._chunk_range(full.numel(), self._chunk_len(p))
        return full.reshape(-1)[start:end]

    def optimizer_params(self) -> list[nn.Parameter]:
        """What the optimizer should own: full params (zero 0) or this rank's chunks."""
        if self.zero == 0:
            return [p for p in self.params if p.requires_grad]
        return [shard for _, shard in self._shards]

    # ---- per step --------------------------------------------------------------------------
    def begin_micro_batch(self, last: bool) -> None:
        """Reductions launch only during the last micro-batch's backward (accumulate before)."""
        self._last_micro = last
        if last or not self.overlap:
            for bucket in self.buckets:
                bucket.pending, bucket.work, bucket.buffer = len(bucket.params), None, None

    def _local_grad(self, p: nn.Parameter) -> torch.Tensor:
        if p.grad is None:
            return torch.zeros_like(local(p))
        p.grad = canonical_grad(p)
        return local(p.grad)

    def _flat_grads(self, bucket: _Bucket) -> torch.Tensor:
        return torch.cat([self._local_grad(p).reshape(-1) for p in bucket.params])

    def _padded_rows(self, bucket: _Bucket) -> torch.Tensor:
        """[N, sum(chunks)]: row j holds chunk j of every grad in the bucket, zero padded."""
        cols = []
        for p, chunk in zip(bucket.params, bucket.chunks):
            g = self._local_grad(p)
            flat = torch.zeros(self.world * chunk, dtype=g.dtype, device=g.device)
            flat[:g.numel()] = g.reshape(-1)
            cols.append(flat.view(self.world, chunk))
        return torch.cat(cols, dim=1)

    def _launch(self, bucket: _Bucket) -> None:
        if self.zero == 2:
            rows = self._padded_rows(bucket).div_(self.divisor)
            bucket.shard_grad = torch.empty(bucket.chunk_total, dtype=rows.dtype, device=rows.device)
            bucket.buffer = rows
            bucket.work = dist.reduce_scatter_single(bucket.shard_grad, rows.view(-1), group=self.group,
                                                     async_op=True)
        else:
            bucket.buffer = self._flat_grads(bucket).div_(self.divisor)
            bucket.work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)

    def finish_grads(self) -> None:
        """Wait for every bucket's reduction and put the averaged grads in place."""
        for bucket in self.buckets:
            if bucket.work is None and not self.overlap:
                self._launch(bucket)
        for bucket in self.buckets:
            if bucket.work is None:  # some param got no grad: launch what is left now
                self._launch(bucket)
            bucket.work.wait()
            if self.zero == 2:
                self._scatter_shard_grads(bucket)
            else:
                self._copy_back(bucket)
            bucket.buffer, bucket.work = None, None
        self._last_micro = False

    def _copy_back(self, bucket: _Bucket) -> None:
        offset = 0
        for p in bucket.params:
            n = local(p).numel()
            reduced = bucket.buffer[offset:offset + n].view_as(local(p))
            if p.grad is None:
                p.grad = _like_param(p, reduced.clone())
            else:
                local(p.grad).copy_(reduced)
            offset += n
        if self.zero == 1:
            self._point_shard_grads()

    def _point_shard_grads(self) -> None:
        by_param = dict(self._shards)
        for bucket in self.buckets:
            for p, chunk in zip(bucket.params, bucket.chunks):
                if p in by_param:
                    start, end = self._chunk_range(local(p).numel(), chunk)
                    by_param[p].grad = local(p.grad).view(-1)[start:end]

    def _scatter_shard_grads(self, bucket: _Bucket) -> None:
        by_param = dict(self._shards)
        offset = 0
        for p, chunk in zip(bucket.params, bucket.chunks):
            start, end = self._chunk_range(local(p).numel(), chunk)
            if p in by_param:
                by_param[p].grad = bucket.shard_grad[offset:offset + end - start]
            offset += chunk
            p.grad = None  # zero 2 keeps only the reduced chunk

    def after_optimizer_step(self) -> None:
        """zero 1/2: all-gather every rank's updated chunk back into the full params."""
        if self.zero == 0:
            return
        for bucket in self.buckets:
            send = torch.cat([self._padded_chunk(p, c) for p, c in zip(bucket.params, bucket.chunks)])
            recv = torch.empty(self.world * send.numel(), dtype=send.dtype, device=send.device)
            dist.all_gather_single(recv, send, group=self.group)
            rows = recv.view(self.world, -1)
            offset = 0
            for p, chunk in zip(bucket.params, bucket.chunks):
                full = rows[:, offset:offset + chunk].reshape(-1)[:local(p).numel()]
                local(p).data.view(-1).copy_(full)
                offset += chunk

    def _padded_chunk(self, p: nn.Parameter, chunk: int) -> torch.Tensor:
        flat = local(p).data.view(-1)
        start, end = self._chunk_range(flat.numel(), chunk)
        out = torch.zeros(chunk, dtype=flat.dtype, device=flat.device)
        out[:end - start] = flat[start:end]
        return out

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for _, shard in self._shards:
            shard.grad = None

    def owned_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(param, grad piece) whose squares this rank contributes to the global grad norm.

        zero 0/1: every rank holds the full reduced grads, so dp rank 0 alone contributes;
        zero 2: each rank contributes its own chunk.
        """
        if self.zero == 2:
            return [(p, s.grad) for p, s in self._shards if s.grad is not None]
        if self.rank != 0:
            return []
        return [(p, local(p.grad)) for p in self.params if p.grad is not None]


def canonical_grad(p: nn.Parameter) -> torch.Tensor:
    """p.grad with p's own placements.

    Under TP, autograd may return a sequence-parallel norm's grad as Partial (each tp rank holds
    a partial sum over its tokens) and the vocab-sharded embedding's grad as Replicate; both
    must be brought to the parameter's placement (an all-reduce over tp, or a local slice)
    before data parallelism or the optimizer can use the local shard.
    """
    g = p.grad
    if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
        return g.redistribute(p.device_mesh, p.placements)
    return g


def _like_param(p: nn.Parameter, local_grad: torch.Tensor) -> torch.Tensor:
    if isinstance(p, DTensor):
        return DTensor.from_local(local_grad, p.device_mesh, p.placements, run_check=False)
    return local_grad


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, block_names: str = "layers") -> nn.Module:
    """ZeRO-3: shard each transformer block, then the root (embedding, norm, head).

    `dp_mesh` spans dp*cp ranks: context-parallel ranks hold the same weights, so they shard
    them like data-parallel ranks do.
    """
    from torch.distributed.fsdp import fully_shard

    blocks = getattr(model, block_names)
    for block in blocks.values():
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    logger.info("applied FSDP2 (zero 3) over dp=%d: %d blocks + root", dp_mesh.size(), len(blocks))
    return model
