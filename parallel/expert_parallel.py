"""Mixture-of-experts feed-forward with expert parallelism (hand-written token dispatch).

Why hand-written: torch has no MoE dispatch, so routing, capacity and the all-to-all live here.
The rules below are chosen so that routing never depends on the parallel layout.

Routing. A bias-free router (Linear dim -> E) gives logits; softmax over all E experts (float32)
gives probs; each token picks its top_k experts, and those k probs are renormalised to sum to 1
(so top_k=1 passes the expert output at full weight; it also keeps the output scale independent
of E). Weights are not renormalised again after drops: a dropped slot simply contributes zero.

Capacity is per *source micro-batch*: C = ceil(capacity_factor * T * top_k / E), T = tokens this
rank feeds to the layer in this forward, and each source may send at most C assignments to each
expert. Priority is slot-major (every token's first choice before any second choice), token order
within a slot. So drop decisions are a function of the micro-batch alone: the same whatever ep,
dp or gradient accumulation is, and an ep run equals the ep=1 module run on each rank's chunk
separately. (A capacity on the global ep token count would make drops depend on ep.) Dropped
assignments contribute zero; the residual connection carries the token on.

Aux loss (Switch-style): aux = E * sum_e f_e * P_e, f_e = share of this micro-batch's T*top_k
assignments (before drops) that chose e, P_e = mean router prob of e; 1.0 at perfect balance.
Contract for the trainer: after each forward, `moe_aux_loss(model)` = sum over MoE layers of
aux_loss_coef * aux (a per-token mean quantity). Add `moe_aux_loss(model) * n_tokens` to the
micro-batch's cross-entropy *sum* before the usual division by the global-batch token count, so
it is averaged over the global batch exactly like the CE. With pipeline parallelism each stage
must add its own layers' term to what it backpropagates.

Expert parallelism (`apply_ep`): rank r of the ep group keeps experts [r*E/ep, (r+1)*E/ep) as a
DTensor Shard(0) on a mesh of the ep group; `init_weights` therefore fills each shard from the
full tensor generated from (seed, name), and DCP can reshard experts to another ep. A forward
exchanges per-expert counts (all_to_all_single of E int64), then sends the kept token rows to
their experts' ranks with one uneven all_to_all_single and brings the outputs back with a second;
each one's backward is the reverse all-to-all. With ep=1 the same code runs with no comm.

Gradient reduction (owned by the DP code): non-expert params (router included) are replicated on
every dp rank and are averaged over the dp group as usual. An expert shard's local grad already
holds the contributions of all tokens of its ep group, so expert grads must be reduced over the
*expert-dp* group (ranks with the same ep index, size dp*cp/ep), not over dp:
grad = mean over expert-dp group / ep (= sum / (dp*cp)). `is_expert_param` tells them apart; grad
norms must sum expert squares over the ep group once.

Stats per forward (`last_stats`, a `MoEStats`; add them up per step): tokens, assignments
(T*top_k), tokens_per_expert (before drops), dropped, aux, and a2a_bytes_sent = bytes of the token
rows this rank hands to the dispatch all-to-all = kept assignments * dim * dtype bytes (T*top_k*
dim*bytes when nothing drops; includes rows for its own experts; the combine sends back
a2a_bytes_received, and backward repeats both). a2a_remote_bytes_sent is the part that leaves.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from tenax.parallel.config import MoEArgs

logger = logging.getLogger(__name__)

EXPERT_NAME_PART = "experts"


@dataclass(frozen=True)
class MoEStats:
    """Router statistics of one or more forwards of one MoE layer on one rank (summable)."""
    forwards: int = 0
    tokens: int = 0
    assignments: int = 0
    dropped: int = 0
    tokens_per_expert: tuple[int, ...] = ()
    aux_loss_sum: float = 0.0
    a2a_bytes_sent: int = 0
    a2a_remote_bytes_sent: int = 0
    a2a_bytes_received: int = 0

    @property
    def drop_rate(self) -> float:
        return self.dropped / self.assignments if self.assignments else 0.0

    @property
    def aux_loss(self) -> float:
        return self.aux_loss_sum / self.forwards if self.forwards else 0.0

    def __add__(self, other: MoEStats) -> MoEStats:
        per_expert = tuple(a + b for a, b in zip(self.tokens_per_expert, other.tokens_per_expert))
        merged = {f.name: getattr(self, f.name) + getattr(other, f.name)
                  for f in dataclasses.fields(self) if f.name != "tokens_per_expert"}
        return MoEStats(**merged, tokens_per_expert=per_expert or self.tokens_per_expert
                        or other.tokens_per_expert)


class ExpertWeights(nn.Module):
    """Stacked [E, d_in, d_out] weights; a module so the parameter is named `<w1|w3|w2>.weight`
    and `init_weights` applies the same owner-name rules (w2 depth-scaled) as the dense FFN."""

    def __init__(self, num_experts: int, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, d_in, d_out))

    def local(self) -> torch.Tensor:
        w = self.weight
        return w.to_local() if isinstance(w, DTensor) else w


class _AllToAll(torch.autograd.Function):
    """Uneven all_to_all_single along dim 0 whose backward is the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


@dataclass
class _Routing:
    token_idx: torch.Tensor  # [N] source token of each kept assignment, sorted by expert
    weights: torch.Tensor    # [N] renormalised gate weight of each kept assignment
    kept_counts: torch.Tensor  # [E] kept assignments per expert (int64)
    routed_counts: torch.Tensor  # [E] assignments per expert before drops
    aux: torch.Tensor


class MoEFeedForward(nn.Module):
    """Top-k routed SwiGLU experts; a drop-in replacement for the dense `FeedForward`."""

    def __init__(self, dim: int, hidden: int, moe: MoEArgs) -> None:
        super().__init__()
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.capacity_factor, self.aux_loss_coef = moe.capacity_factor, moe.aux_loss_coef
        self.router = nn.Linear(dim, moe.num_experts, bias=False)
        self.experts = nn.ModuleDict({"w1": ExpertWeights(moe.num_experts, dim, hidden),
                                      "w3": ExpertWeights(moe.num_experts, dim, hidden),
                                      "w2": ExpertWeights(moe.num_experts, hidden, dim)})
        self.ep_group: dist.ProcessGroup | None = None
        self.ep_size, self.ep_rank = 1, 0
        self.last_aux_loss: torch.Tensor | None = None
        self.last_stats = MoEStats()

    def capacity(self, tokens: int) -> int:
        """Assignments one source micro-batch of `tokens` tokens may send to each expert."""
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)

    def shard_experts(self, mesh: DeviceMesh) -> None:
        """Keep this rank's contiguous block of experts as a Shard(0) DTensor over `mesh`."""
        ep, rank = mesh.size(), mesh.get_local_rank()
        if self.num_experts % ep:
            raise ValueError(f"apply_ep: ep={ep} does not divide num_experts={self.num_experts}")
        per_rank = self.num_experts // ep
        for w in self.experts.values():
            if isinstance(w.weight, DTensor):
                raise ValueError("apply_ep: experts are already sharded")
            block = w.weight.detach()[rank * per_rank:(rank + 1) * per_rank].clone()
            w.weight = nn.Parameter(DTensor.from_local(block, mesh, [Shard(0)], run_check=False),
                                    requires_grad=w.weight.requires_grad)
        self.ep_group, self.ep_size, self.ep_rank = mesh.get_group(), ep, rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        routing = self._route(flat)
        kept = flat.index_select(0, routing.token_idx)
        y, sent, remote, received = self._dispatch_and_compute(kept, routing.kept_counts)
        y = y * routing.weights.to(y.dtype).unsqueeze(-1)
        out = flat.new_zeros(flat.shape).index_add(0, routing.token_idx, y)
        self.last_aux_loss = routing.aux
        assignments = flat.shape[0] * self.top_k
        self.last_stats = MoEStats(
            forwards=1, tokens=flat.shape[0], assignments=assignments,
            dropped=assignments - routing.token_idx.numel(),
            tokens_per_expert=tuple(routing.routed_counts.tolist()),
            aux_loss_sum=float(routing.aux.detach()), a2a_bytes_sent=sent,
            a2a_remote_bytes_sent=remote, a2a_bytes_received=received)
        return out.view(x.shape)

    def _route(self, x: torch.Tensor) -> _Routing:
        tokens, n_exp, k = x.shape[0], self.num_experts, self.top_k
        probs = self.router(x).float().softmax(dim=-1)
        top_p, top_e = probs.topk(k, dim=-1)
        top_w = top_p / top_p.sum(dim=-1, keepdim=True)
        # Slot-major flattening: all first choices come before any second choice, so a token
        # loses its primary expert to capacity only after other tokens' primaries filled it.
        expert = top_e.t().reshape(-1)
        weight = top_w.t().reshape(-1)
        token = torch.arange(tokens, device=x.device).repeat(k)
        onehot = F.one_hot(expert, n_exp)
        position = (onehot.cumsum(dim=0) * onehot).sum(dim=-1) - 1
        keep = position < self.capacity(tokens)
        kept_expert = expert[keep]
        order = torch.argsort(kept_expert, stable=True)
        routed_counts = onehot.sum(dim=0)
        if tokens:
            share = routed_counts.float() / (tokens * k)
            aux = n_exp * (share * probs.mean(dim=0)).sum()
        else:  # keep the router in the graph so every rank's grad hooks still fire
            aux = probs.sum() * 0.0
        return _Routing(token[keep][order], weight[keep][order],
                        torch.bincount(kept_expert, minlength=n_exp), routed_counts, aux)

    def _dispatch_and_compute(self, x: torch.Tensor, counts: torch.Tensor
                              ) -> tuple[torch.Tensor, int, int, int]:
        """Expert outputs for expert-sorted rows `x`, and (sent, remote, received) bytes."""
        if self.ep_group is None:
            return self._compute(x, counts.tolist()), 0, 0, 0
        ep, per_rank, group = self.ep_size, self.num_experts // self.ep_size, self.ep_group
        from_sources = torch.empty_like(counts)
        dist.all_to_all_single(from_sources, counts, group=group)
        by_source = from_sources.view(ep, per_rank)  # [source rank, local expert]
        send = counts.view(ep, per_rank).sum(dim=1).tolist()
        recv = by_source.sum(dim=1).tolist()
        received = _AllToAll.apply(x, recv, send, group)
        # Rows arrive source-major; the experts want them expert-major (sources kept in order).
        local_expert = torch.arange(ep * per_rank, device=x.device) % per_rank
        row_expert = torch.repeat_interleave(local_expert, by_source.reshape(-1))
        perm = torch.argsort(row_expert, stable=True)
        y = self._compute(received.index_select(0, perm), by_source.sum(dim=0).tolist())
        y = y.index_select(0, torch.argsort(perm))
        out = _AllToAll.apply(y, send, recv, group)
        row_bytes = x.shape[-1] * x.element_size()
        sent = x.shape[0] * row_bytes
        return out, sent, sent - send[self.ep_rank] * row_bytes, sum(recv) * row_bytes

    def _compute(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """SwiGLU of each local expert on its contiguous block of rows."""
        w1, w3, w2 = (self.experts[n].local() for n in ("w1", "w3", "w2"))
        outs = []
        # Empty blocks still run, so every expert gets a (zero) grad and DP hooks always fire.
        for e, rows in enumerate(x.split(counts)):
            outs.append((F.silu(rows @ w1[e]) * (rows @ w3[e])) @ w2[e])
        return torch.cat(outs)


def moe_layers(model: nn.Module) -> list[tuple[str, MoEFeedForward]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoEFeedForward)]


def apply_ep(model: nn.Module, ep_group: dist.ProcessGroup,
             device_type: str | None = None) -> nn.Module:
    """Shard every MoE layer's experts over `ep_group` and switch it to all-to-all dispatch.

    Works on a meta model (then `to_empty` + `init_weights`) or on an initialised one (each rank
    keeps its slice). `device_type` defaults to cuda for nccl groups, else cpu.
    """
    ep = dist.get_world_size(ep_group)
    layers = moe_layers(model)
    if ep == 1 or not layers:
        return model
    if device_type is None:
        device_type = "cuda" if dist.get_backend(ep_group) == "nccl" else "cpu"
    mesh = DeviceMesh.from_group(ep_group, device_type)
    for _, layer in layers:
        layer.shard_experts(mesh)
    logger.info("applied EP over ep=%d to %d MoE layers (%d experts each, %d per rank)", ep,
                len(layers), layers[0][1].num_experts, layers[0][1].num_experts // ep)
    return model


def moe_aux_loss(model: nn.Module) -> torch.Tensor:
    """Sum over MoE layers of coef * aux from the last forward (0 for a dense model)."""
    terms = [m.aux_loss_coef * m.last_aux_loss for _, m in moe_layers(model)
             if m.last_aux_loss is not None]
    return torch.stack(terms).sum() if terms else torch.zeros(())


def moe_stats(model: nn.Module) -> dict[str, MoEStats]:
    """Each MoE layer's stats of its last forward, keyed by module name."""
    return {name: m.last_stats for name, m in moe_layers(model)}


def is_expert_param(name: str) -> bool:
    """True for parameters sharded by ep (reduced over the expert-dp group, not dp)."""
    return EXPERT_NAME_PART in name.split(".")
