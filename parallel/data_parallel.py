"""Data parallelism: plain DDP (zero 0), ZeRO-1, ZeRO-2 by hand, ZeRO-3 via FSDP2.

Why hand-written for stages 0-2: torch's DDP refuses DTensor (TP) parameters and FSDP2 has no
"shard only the optimizer" mode, while users need every stage to shard exactly what its name
says, on top of TP, with a memory ledger they can check. So:

- zero 0: every rank keeps full params, grads and optimizer state; grads are averaged with
  bucketed all-reduces launched from post-accumulate-grad hooks during the last micro-batch's
  backward, so communication overlaps the rest of the backward pass.
- zero 1: each rank's optimizer owns one 1/N chunk of every parameter (a *view* into the
  parameter, so no extra copy of the weights). Grads accumulate in full (ZeRO-1 does not shard
  them); during the last micro-batch's backward each bucket is reduce-scattered, and the rank's
  averaged chunk is written into its own slice of p.grad (the optimizer's shard grad is a view of
  that slice; the rest of p.grad keeps this rank's unreduced sum and is not meaningful). After
  the step the chunks are all-gathered back: 2(N-1)/N of the grad bytes per step, like one
  all-reduce, where all-reduce + all-gather would move 3(N-1)/N.
- zero 2: every micro-batch's backward reduce-scatters each bucket as soon as its grads are
  complete and frees the full grads; the rank adds the reduced chunk into a per-bucket
  accumulator, so between micro-batches it holds only 1/N of the gradient bytes. Costs
  (m+1)(N-1)/N of the grad bytes for m micro-batches (m reduce-scatters + the all-gather).
  Pipeline schedules (overlap=False) run backward outside our loop: one reduce-scatter at the end.
- zero 3 (parallel/fully_sharded.py): FSDP2 `fully_shard` per block, then the embedding, final
  norm and head each as their own unit, then the root (which then owns no parameters). FSDP2
  keeps the *root's* parameters unsharded from forward to backward; giving embedding/norm/head
  their own units reshards them after forward like every block, so every parameter is
  all-gathered twice per micro-batch.

All stages *average* gradients over the dp group; the trainer scales each rank's loss so that the
average equals the gradient of the global-batch mean loss.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 25 * 2**20  # DDP's default: on gloo every extra collective is a sync
# torch 2.13 renamed these; older torch (2.11 on the lent GPU hosts) has only the old names.
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local storage of a tensor (a DTensor's shard, else the tensor itself)."""
    return t._local_tensor if isinstance(t, DTensor) else t


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    chunks: list[int]  # per param: ceil(local numel / N), the ZeRO chunk length
    pending: int = 0
    work: dist.Work | None = None
    buffer: torch.Tensor | None = None  # the collective's input, alive until it completes
    recv: torch.Tensor | None = None  # zero 1/2: the reduce-scatter's output
    shard_grad: torch.Tensor | None = None  # zero 2: accumulated reduced chunk of every grad

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
    # param -> its shard, in bucket order; a dict because a snapshot's plan looks up every
    # parameter at every step (a list rebuilt into a dict per lookup made that quadratic, ~20 ms)
    _shards: dict[nn.Parameter, nn.Parameter] = field(default_factory=dict)

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

    def _make_hook(self, bucket: _Bucket) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            # zero 2 reduces every micro-batch (that is what bounds its grads to 1/N); the
            # others reduce the accumulated grads once, in the last micro-batch.
            if self.overlap and (self._last_micro or self.zero == 2):
                bucket.pending -= 1
                if bucket.pending == 0:
                    self._launch(bucket)
        return hook

    def _chunk_range(self, numel: int, chunk: int) -> tuple[int, int]:
        start = min(self.rank * chunk, numel)
        return start, min(start + chunk, numel)

    def _make_shards(self) -> dict[nn.Parameter, nn.Parameter]:
        """param -> shard; a shard is a view of this rank's chunk of the param."""
        shards: dict[nn.Parameter, nn.Parameter] = {}
        for bucket in self.buckets:
            for p, chunk in zip(bucket.params, bucket.chunks):
                flat = local(p).data.view(-1)
                start, end = self._chunk_range(flat.numel(), chunk)
                if end > start:
                    shards[p] = nn.Parameter(flat[start:end])
        return shards

    def shard_of(self, p: nn.Parameter) -> nn.Parameter | None:
        """This rank's optimizer-owned chunk of `p` (None when the chunk is empty)."""
        return self._shards.get(p)

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
        all_gather_flat(recv, send, group=self.group)
        return recv[:local(p).numel()].view_as(local(p))

    def chunk_view(self, p: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a tensor shaped like p's local shard."""
        start, end = self._chunk_range(full.numel(), self._chunk_len(p))
        return full.reshape(-1)[start:end]

    def optimizer_params(self) -> list[nn.Parameter]:
        """What the optimizer should own: full params (zero 0) or this rank's chunks."""
        if self.zero == 0:
            return [p for p in self.params if p.requires_grad]
        return list(self._shards.values())

    # ---- per step --------------------------------------------------------------------------
    def begin_micro_batch(self, last: bool) -> None:
        """zero 0/1 reduce during the last micro-batch's backward only (accumulate before);
        zero 2 first settles the previous micro-batch's reductions, so that between
        micro-batches a rank holds only its accumulated chunks."""
        self._last_micro = last
        if self.zero == 2 and self.overlap:
            for bucket in self.buckets:
                if self._has_grads(bucket):  # a bucket some param left incomplete
                    self._launch(bucket)
            for bucket in self.buckets:
                self._settle(bucket)
                bucket.pending = len(bucket.params)
        elif last or not self.overlap:
            for bucket in self.buckets:
                bucket.pending, bucket.work, bucket.buffer = len(bucket.params), None, None

    @staticmethod
    def _has_grads(bucket: _Bucket) -> bool:
        return any(p.grad is not None for p in bucket.params)

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
        if self.zero == 0:
            bucket.buffer = self._flat_grads(bucket).div_(self.divisor)
            bucket.work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)
            return
        self._settle(bucket)
        rows = self._padded_rows(bucket).div_(self.divisor)
        if self.zero == 2:  # the padded copy is all the collective needs: drop the full grads
            for p in bucket.params:
                p.grad = None
        bucket.recv = torch.empty(bucket.chunk_total, dtype=rows.dtype, device=rows.device)
        bucket.buffer = rows
        bucket.work = reduce_scatter_flat(bucket.recv, rows.view(-1), group=self.group,
                                                 async_op=True)

    def _settle(self, bucket: _Bucket) -> None:
        """zero 2: wait for the bucket's reduce-scatter and add it into the accumulator."""
        if self.zero != 2 or bucket.work is None:
            return
        bucket.work.wait()
        if bucket.shard_grad is None:
            bucket.shard_grad = bucket.recv
        else:
            bucket.shard_grad.add_(bucket.recv)
        bucket.work, bucket.recv, bucket.buffer = None, None, None

    def _needs_launch(self, bucket: _Bucket) -> bool:
        if self.zero == 2:  # grads left since the last reduce-scatter (or never reduced)
            return self._has_grads(bucket)
        return bucket.work is None  # not launched by the hooks (no overlap, or a missing grad)

    def finish_grads(self) -> None:
        """Wait for every bucket's reduction and put the averaged grads in place."""
        for bucket in self.buckets:
            if self._needs_launch(bucket):
                self._launch(bucket)
        for bucket in self.buckets:
            if self.zero == 2:
                self._settle(bucket)
                self._scatter_shard_grads(bucket)
                continue
            bucket.work.wait()
            if self.zero == 1:
                self._write_owned_chunks(bucket)
            else:
                self._copy_back(bucket)
            bucket.buffer, bucket.work, bucket.recv = None, None, None
        self._last_micro = False

    def _copy_back(self, bucket: _Bucket) -> None:
        """zero 0: each grad becomes a view of the reduced bucket (no copy back, and the
        unreduced grad is freed), as DDP's gradient_as_bucket_view does."""
        offset = 0
        for p in bucket.params:
            n = local(p).numel()
            p.grad = _like_param(p, bucket.buffer[offset:offset + n].view_as(local(p)))
            offset += n

    def _write_owned_chunks(self, bucket: _Bucket) -> None:
        """zero 1: the reduced chunk goes into this rank's own slice of p.grad (the optimizer's
        shard grad is a view of it), so grads keep ZeRO-1's full size and no second buffer."""
        by_param = self._shards
        offset = 0
        for p, chunk in zip(bucket.params, bucket.chunks):
            if p.grad is None:
                p.grad = _like_param(p, torch.zeros_like(local(p)))
            start, end = self._chunk_range(local(p).numel(), chunk)
            owned = local(p.grad).view(-1)[start:end]
            owned.copy_(bucket.recv[offset:offset + end - start])
            if p in by_param:
                by_param[p].grad = owned
            offset += chunk

    def _scatter_shard_grads(self, bucket: _Bucket) -> None:
        if bucket.shard_grad is None:  # no param of the bucket got a grad this step
            bucket.shard_grad = torch.zeros(bucket.chunk_total, dtype=local(bucket.params[0]).dtype,
                                            device=local(bucket.params[0]).device)
        by_param = self._shards
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
            send = torch.cat([self._padded_chunk(p, c)
                              for p, c in zip(bucket.params, bucket.chunks)])
            recv = torch.empty(self.world * send.numel(), dtype=send.dtype, device=send.device)
            all_gather_flat(recv, send, group=self.group)
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
        for shard in self._shards.values():
            shard.grad = None
        for bucket in self.buckets:
            bucket.shard_grad = bucket.recv = bucket.buffer = bucket.work = None

    def held_grad_bytes(self) -> int:
        """Grad bytes held now: local grads + zero 2's accumulators (zero 1's are views)."""
        total = sum(local(p.grad).numel() * local(p.grad).element_size()
                    for p in self.params if p.grad is not None)
        return total + sum(b.shard_grad.numel() * b.shard_grad.element_size()
                           for b in self.buckets if b.shard_grad is not None)

    def owned_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(param, grad piece) whose squares this rank contributes to the global grad norm.

        zero 0: every rank holds the full reduced grads, so dp rank 0 alone contributes;
        zero 1/2: each rank contributes its own (reduced) chunk.
        """
        if self.zero >= 1:
            return [(p, s.grad) for p, s in self._shards.items() if s.grad is not None]
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
