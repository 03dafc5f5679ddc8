"""Context parallelism (CP): exact causal ring attention over a zig-zag split of the sequence.

Why zig-zag. Under a causal mask query i attends to keys 0..i, so a chunk's work grows with its
position: with cp contiguous pieces the last rank would do ~2cp-1 times the work of the first,
and a ring runs at its slowest rank's pace. So the sequence is cut into 2*cp chunks and rank i
holds chunks i and 2cp-1-i, one cheap and one costly: equal work everywhere. Bonus: on every
ring step but the local one, half of the (query chunk, key chunk) pairs are fully masked and
skipped, and the other half need no mask.

Why online softmax. A rank holds only its own K/V block and the one visiting, never all keys.
Softmax over all keys is still exact if each query keeps its output normalised over the keys
seen so far and their log-sum-exp (lse), folding in each block's (out_b, lse_b) as
lse' = logaddexp(lse, lse_b), out' = out*exp(lse - lse') + out_b*exp(lse_b - lse'); block order
only changes rounding. Blocks use explicit float32 maths with masks from GLOBAL positions.

Communication (`dist.batch_isend_irecv`, gloo and NCCL alike): forward, K/V hop to group rank+1
cp-1 times per layer, each hop posted before the compute it overlaps. Backward recomputes the
probabilities from the saved lse: K/V make the same cp-1 hops while a float32 dK/dV accumulator
rides along collecting each rank's share, plus one hop home: 3(cp-1) block sends per layer, as
`cost_model.cp_comm` charges. Backward hops wait (an accumulator is ready only after compute).
GQA: `Attention` repeats k/v to the q heads; `kv_repeat` sends one copy per kv head, and the
repeat's backward sums that copy's gradient into the kv head, as if every copy had its share.

Contract with the trainer (`apply_cp`):
- every rank of a cp group gets the SAME global micro-batch [b, s] (s % (2*cp) == 0) and feeds
  `model(zigzag_split(tokens, cp, r), positions=zigzag_indices(s, cp, r))`, r = its rank in the
  cp group; targets are split the same way (`zigzag_split(targets, cp, r)`).
- a rank's loss covers its tokens only: divide by the global batch's token count; the loss is
  the SUM over cp ranks. Parameter gradients are partial per cp rank: SUM them over cp (in the
  one reduction over dp*cp, the ranks replicating dense weights; a reducer that averages over N
  ranks needs the loss scaled by N). After groups are rebuilt, call `apply_cp` again.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tenax.parallel.model import Attention

logger = logging.getLogger(__name__)

KV_TAG, GRAD_TAG = 0, 1  # distinct tags so K/V and gradient hops can never be matched crosswise


def zigzag_indices(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions held by `rank`, in local order: chunk rank, then chunk 2cp-1-rank."""
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"zigzag: rank {rank} is not in [0, cp={cp})")
    if seq_len % (2 * cp):
        raise ValueError(f"zigzag: sequence length {seq_len} is not divisible by 2*cp={2 * cp} "
                         "(the zig-zag split cuts it into 2*cp equal chunks)")
    c, late = seq_len // (2 * cp), 2 * cp - 1 - rank
    return torch.cat((torch.arange(rank * c, (rank + 1) * c),
                      torch.arange(late * c, (late + 1) * c)))


def zigzag_split(x: torch.Tensor, cp: int, rank: int, seq_dim: int = 1) -> torch.Tensor:
    """The part of `x` (full sequence along `seq_dim`) that cp rank `rank` holds."""
    return x.index_select(seq_dim, zigzag_indices(x.shape[seq_dim], cp, rank).to(x.device))


def zigzag_gather(local: torch.Tensor, cp: int, group: dist.ProcessGroup,
                  seq_dim: int = 1) -> torch.Tensor:
    """All-gather every rank's zig-zag part back into global order (not differentiable)."""
    if dist.get_world_size(group) != cp:
        raise ValueError(f"zigzag_gather: cp={cp} != group size {dist.get_world_size(group)}")
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(parts, local, group=group)
    seq_len = local.shape[seq_dim] * cp
    held = torch.cat([zigzag_indices(seq_len, cp, r) for r in range(cp)])
    return torch.cat(parts, seq_dim).index_select(seq_dim, torch.argsort(held).to(local.device))


@dataclass
class RingCommCounter:
    """Bytes and hops (one hop = K+V, or dK+dV, to the next rank) this rank sent since `reset`.
    K/V travel in the input dtype, dK/dV accumulators in float32."""
    forward_bytes: int = 0
    backward_bytes: int = 0
    forward_hops: int = 0
    backward_hops: int = 0

    @property
    def total_bytes(self) -> int:
        return self.forward_bytes + self.backward_bytes

    def reset(self) -> None:
        self.forward_bytes = self.backward_bytes = self.forward_hops = self.backward_hops = 0


class _RingHop:
    """Send tensors to group rank+1 and receive same-shaped ones from rank-1, asynchronously."""

    def __init__(self, tensors: list[torch.Tensor], group: dist.ProcessGroup, tag: int,
                 counter: RingCommCounter, phase: str) -> None:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        tensors = [t.contiguous() for t in tensors]
        self.received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, group=group, group_peer=(rank + 1) % size, tag=tag)
               for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, group=group, group_peer=(rank - 1) % size, tag=tag)
                for t in self.received]
        self.works = dist.batch_isend_irecv(ops)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        setattr(counter, f"{phase}_bytes", getattr(counter, f"{phase}_bytes") + nbytes)
        setattr(counter, f"{phase}_hops", getattr(counter, f"{phase}_hops") + 1)

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()  # bounded by the group's timeout, set from the spec at init
        return self.received


def _visible_pairs(q_pos: torch.Tensor, k_pos: torch.Tensor
                   ) -> Iterator[tuple[slice, slice, torch.Tensor | None]]:
    """(query chunk, key chunk, mask or None if all visible) for pairs with any visible key.
    Correctness rests on the mask from global positions alone; chunking only saves work."""
    cq, ck = q_pos.numel() // 2, k_pos.numel() // 2
    for qs in (slice(0, cq), slice(cq, 2 * cq)):
        for ks in (slice(0, ck), slice(ck, 2 * ck)):
            mask = k_pos[ks].unsqueeze(0) <= q_pos[qs].unsqueeze(1)
            if mask.any():
                yield qs, ks, None if mask.all() else mask


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None,
            scale: float) -> torch.Tensor:
    """Scaled scores [b, g, r, sq, sk] of grouped q [b, g, r, sq, d] against k [b, g, sk, d]."""
    scores = torch.einsum("bgrqd,bgkd->bgrqk", q, k) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask.to(scores.device), float("-inf"))
    return scores


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of one block: (out normalised over this block, its lse)."""
    scores = _scores(q, k, mask, scale)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.einsum("bgrqk,bgkd->bgrqd", torch.exp(scores - lse.unsqueeze(-1)), v), lse


def _merge(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """Fold a block's (out_b, lse_b) into the running (out, lse), in place (online softmax)."""
    new_lse = torch.logaddexp(lse, lse_b)
    out.mul_(torch.exp(lse - new_lse).unsqueeze(-1))
    out.add_(out_b * torch.exp(lse_b - new_lse).unsqueeze(-1))
    lse.copy_(new_lse)


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[b, h, s, d] -> [b, g, r, s, d]: q head j*r+t reads kv head j (repeat_interleave order)."""
    b, _, s, d = q.shape
    return q.to(torch.promote_types(q.dtype, torch.float32)).reshape(b, kv_heads, -1, s, d)


def _ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                  counter: RingCommCounter) -> tuple[torch.Tensor, torch.Tensor]:
    """Local queries against every rank's K/V block: (out [b, h, s, d] in q.dtype, lse fp32)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    qg = _grouped(q, k.shape[1])
    seq_len, scale, dtype = q.shape[2] * size, 1.0 / math.sqrt(q.shape[-1]), qg.dtype
    q_pos = zigzag_indices(seq_len, size, rank)
    out = torch.zeros(qg.shape, dtype=dtype, device=q.device)
    lse = torch.full(qg.shape[:-1], float("-inf"), dtype=dtype, device=q.device)
    kv = [k, v]
    for step in range(size):
        # Post the next hop first so the transfer overlaps this block's compute.
        hop = _RingHop(kv, group, KV_TAG, counter, "forward") if step < size - 1 else None
        k_pos = zigzag_indices(seq_len, size, (rank - step) % size)
        kb, vb = kv[0].to(dtype), kv[1].to(dtype)
        for qs, ks, mask in _visible_pairs(q_pos, k_pos):
            out_b, lse_b = _attend(qg[..., qs, :], kb[..., ks, :], vb[..., ks, :], mask, scale)
            _merge(out[..., qs, :], lse[..., qs], out_b, lse_b)
        if hop is not None:
            kv = hop.wait()
    return out.view(q.shape).to(q.dtype), lse


def _block_backward(qg: torch.Tensor, dog: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor,
                    kv: list[torch.Tensor], q_pos: torch.Tensor, k_pos: torch.Tensor,
                    dq: torch.Tensor, dkv: list[torch.Tensor]) -> None:
    """Add one K/V block's contribution to dq and to that block's dk, dv (all in place)."""
    scale = 1.0 / math.sqrt(qg.shape[-1])
    kb, vb = kv[0].to(qg.dtype), kv[1].to(qg.dtype)
    for qs, ks, mask in _visible_pairs(q_pos, k_pos):
        q, do, k, v = qg[..., qs, :], dog[..., qs, :], kb[..., ks, :], vb[..., ks, :]
        p = torch.exp(_scores(q, k, mask, scale) - lse[..., qs].unsqueeze(-1))
        ds = p * (torch.einsum("bgrqd,bgkd->bgrqk", do, v) - delta[..., qs].unsqueeze(-1))
        dq[..., qs, :] += torch.einsum("bgrqk,bgkd->bgrqd", ds, k) * scale
        dkv[0][..., ks, :] += torch.einsum("bgrqk,bgrqd->bgkd", ds, q) * scale
        dkv[1][..., ks, :] += torch.einsum("bgrqk,bgrqd->bgkd", p, do)


def _ring_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, dout: torch.Tensor, group: dist.ProcessGroup,
                   counter: RingCommCounter) -> tuple[torch.Tensor, ...]:
    """Reverse of `_ring_forward`: K/V hop again, dK/dV accumulators ride along and come home."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    qg, dog = _grouped(q, k.shape[1]), _grouped(dout, k.shape[1])
    seq_len, dtype = q.shape[2] * size, qg.dtype
    # D_i = sum_d dO_i * O_i: the softmax-jacobian term shared by every key block.
    delta = (dog * _grouped(out, k.shape[1])).sum(-1)
    q_pos = zigzag_indices(seq_len, size, rank)
    dq = torch.zeros(qg.shape, dtype=dtype, device=q.device)
    own = [torch.zeros(k.shape, dtype=dtype, device=k.device) for _ in range(2)]
    _block_backward(qg, dog, lse, delta, [k, v], q_pos, q_pos, dq, own)
    kv, travelling = [k, v], [torch.zeros_like(t) for t in own]
    for step in range(1, size):
        hop = _RingHop(kv, group, KV_TAG, counter, "backward")
        if step > 1:  # at step 1 the visiting block's accumulator starts here, at zero
            travelling = _RingHop(travelling, group, GRAD_TAG, counter, "backward").wait()
        kv = hop.wait()
        k_pos = zigzag_indices(seq_len, size, (rank - step) % size)
        _block_backward(qg, dog, lse, delta, kv, q_pos, k_pos, dq, travelling)
    if size > 1:
        # The accumulator holds every other rank's share for the block of rank+1: send it home.
        for mine, theirs in zip(own, _RingHop(travelling, group, GRAD_TAG, counter,
                                              "backward").wait()):
            mine += theirs
    return dq.view(q.shape).to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor,  # type: ignore[override]
                v: torch.Tensor, group: dist.ProcessGroup,
                counter: RingCommCounter) -> torch.Tensor:
        out, lse = _ring_forward(q, k, v, group, counter)
        ctx.save_for_backward(q, k, v, out, lse)  # local blocks only, no score matrices
        ctx.group, ctx.counter = group, counter
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(q, k, v, out, lse, dout, ctx.group, ctx.counter)
        return dq, dk, dv, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                   *, kv_repeat: int = 1, counter: RingCommCounter | None = None) -> torch.Tensor:
    """Exact causal attention of this rank's zig-zag queries over the whole sequence.

    q, k, v: [b, h, s_local, d] holding the two zig-zag chunks of this rank (its rank in `group`);
    k/v heads are `repeat_interleave`d copies in groups of `kv_repeat` (GQA), only one per group
    travels. Returns [b, h, s_local, d] in q's dtype; differentiable."""
    if not q.shape == k.shape == v.shape or q.dim() != 4 or q.shape[2] % 2:
        raise ValueError("ring_attention: q, k, v need one [b, h, s, d] shape, s even (two zig-zag "
                         f"chunks); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if kv_repeat < 1 or q.shape[1] % kv_repeat:
        raise ValueError(f"ring_attention: kv_repeat={kv_repeat} must divide {q.shape[1]} heads")
    k, v = k[:, ::kv_repeat], v[:, ::kv_repeat]
    counter = counter if counter is not None else RingCommCounter()
    return _RingAttention.apply(q, k, v, group, counter)


def _cp_group(group_or_mesh: dist.ProcessGroup | DeviceMesh) -> dist.ProcessGroup:
    if not isinstance(group_or_mesh, DeviceMesh):
        return group_or_mesh
    if "cp" in (group_or_mesh.mesh_dim_names or ()):
        return group_or_mesh.get_group("cp")
    if group_or_mesh.ndim == 1:
        return group_or_mesh.get_group()
    raise ValueError(f"apply_cp: mesh dims {group_or_mesh.mesh_dim_names} have no 'cp' dimension")


def apply_cp(model: nn.Module, cp_group_or_mesh: dist.ProcessGroup | DeviceMesh,
             kv_repeat: int | None = None) -> RingCommCounter:
    """Make every `Attention` in `model` use ring attention over the cp group (a ProcessGroup,
    a 1-D mesh, or a mesh with a "cp" dim); the trainer's side is in the module docstring.

    `kv_repeat` defaults to n_heads // n_kv_heads of `model.spec` (TP divides both alike).
    Returns the comm counter, also kept as `model.cp_comm_counter`."""
    group = _cp_group(cp_group_or_mesh)
    if kv_repeat is None:
        spec = getattr(model, "spec", None)
        kv_repeat = spec.n_heads // spec.n_kv_heads if spec is not None else 1
    counter = RingCommCounter()

    def attention_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ring_attention(q, k, v, group, kv_repeat=kv_repeat, counter=counter)

    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    if not attentions:
        raise ValueError(f"apply_cp: {type(model).__name__} has no Attention module to replace")
    for module in attentions:
        module.attention_fn = attention_fn
    model.cp_comm_counter = counter
    logger.info("context parallel: ring attention over %d ranks in %d attention layers "
                "(kv_repeat=%d)", dist.get_world_size(group), len(attentions), kv_repeat)
    return counter
