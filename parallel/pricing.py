"""Pricing: one candidate layout's memory per GPU and step time, under a PlanContext.

Separate from the search (planner.py) because it answers another question: the planner decides
which layouts to try and which one wins; this module prices a single layout, by the same rules
whether the search proposed it or a caller pinned it (`planner.estimate_layout`). The price:
1. fit: model states + activations + buffers <= gpu_mem * (1 - margin), with the pinned
   recompute or per layout the lightest that fits (none, then selective, then full);
2. step time: compute + TP comm (critical path) + DP comm not hidden behind compute
   (DP_OVERLAP of it at most) + PP p2p + EP all-to-all + CP ring (exposed: conservative)
   + bubble; a dimension whose groups cross nodes is timed on the inter-node link.
Pure arithmetic over the cost model (cost_model.py, memory_model.py, bubble.py): no torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from tenax.parallel.bubble import bubble_time
from tenax.parallel.config import ModelArgs
from tenax.parallel.cost_model import (Network, cp_comm, crossing_dims, dp_comm, ep_comm, pp_comm,
                                       tp_comm, train_flops_per_token)
from tenax.parallel.estimate import PART_LABELS, Estimate, StepTime, soft_warnings
from tenax.parallel.layout import ParallelLayout
from tenax.parallel.memory_model import (ActivationShape, MemoryLedger, StateBytes,
                                         block_activation_bytes, head_activation_bytes,
                                         in_flight_microbatches, model_state_memory,
                                         stage_activation_bytes)

DP_OVERLAP = 0.8            # share of DP comm that can hide behind compute (not the last bucket)


@dataclass(frozen=True)
class PlanContext:
    """A plan request resolved to numbers, once per request (planner.py builds it): what every
    candidate's estimate reads, and the pinned choices the search honours."""

    model: ModelArgs
    gpus: int
    gpn: int
    gbs: int
    budget: float
    network: Network
    flops_per_s: float          # sustained, all GPUs together
    state: StateBytes
    dtype_bytes: float
    max_micro_batch: int
    fixed: dict[str, Any] = field(default_factory=dict)
    params: int = 0             # model counts, cached: the search asks for them thousands of times
    active: int = 0
    experts: int = 0
    top_k: int = 1
    peak_flops: float = 0.0     # dense peak, all GPUs together (MFU's denominator)
    soft_ok: bool = False       # rules of thumb become warnings (a pinned layout must run)
    recompute: str = "auto"     # a pinned level, or "auto": the lightest that fits
    block_params: float = 0.0   # active parameters of the decoder blocks (full recompute reruns)

    def choices(self, name: str, free: Sequence[Any]) -> Sequence[Any]:
        return [self.fixed[name]] if name in self.fixed else free


def activation_shape(model: ModelArgs, lay: ParallelLayout, dtype_bytes: float,
                     top_k: int = 1) -> ActivationShape:  # one rank's micro-batch
    return ActivationShape(model.seq_len, lay.micro_batch_size, model.dim, model.n_heads,
                           model.ffn_hidden, lay.tp, lay.cp, top_k, dtype_bytes)


def _memory(ctx: PlanContext, lay: ParallelLayout, m: int, recompute: str,
            states: MemoryLedger) -> MemoryLedger:
    """activations: what the engine saves for backward (blocks of in-flight micro-batches, and
    the head of one, charged to every stage: conservative); buffers: transient working sets."""
    model = ctx.model
    shape = activation_shape(model, lay, ctx.dtype_bytes, ctx.top_k)
    layer = block_activation_bytes(shape, recompute)
    in_flight = in_flight_microbatches(lay.pp_schedule, lay.pp, m, lay.pp_virtual_stages)
    acts = stage_activation_bytes(layer, model.n_layers, lay.pp, in_flight, lay.pp_virtual_stages)
    acts += head_activation_bytes(shape, model.vocab_size, model.head_dim)
    # The block being recomputed in backward holds what `none` would, for that block only.
    buffers = block_activation_bytes(shape, "none") if recompute == "full" else 0.0
    if lay.zero == 3:  # the current and the prefetched layer are gathered in full
        per_layer = (ctx.params - ctx.experts * (1 - 1 / lay.ep)) / model.n_layers
        buffers += 2 * per_layer / lay.tp * ctx.state.weights
    return MemoryLedger(states.params, states.grads, states.optimizer, acts, buffers)


def _step_time(ctx: PlanContext, lay: ParallelLayout, m: int, recompute: str) -> StepTime:
    model, net, dt = ctx.model, ctx.network, ctx.dtype_bytes
    cross = crossing_dims(lay.pp, lay.dp, lay.cp, lay.tp, lay.ep, ctx.gpn)
    flops = train_flops_per_token(ctx.active, model.n_layers, model.dim, model.seq_len, recompute,
                                  ctx.block_params)
    compute = flops * ctx.gbs * model.seq_len / ctx.flops_per_s
    b, s_local = ctx.gbs // lay.dp, model.seq_len / lay.cp
    layers, experts = math.ceil(model.n_layers / lay.pp), ctx.experts
    t = {**dict.fromkeys(PART_LABELS, 0.0), "compute_s": compute}
    if lay.tp > 1:  # stage ends charged to every stage: the busiest holds the head
        comm = tp_comm(b, s_local, model.dim, lay.tp, layers, dt, recompute, model.vocab_size,
                       (2 * layers + 1) * model.dim * ctx.state.grads)
        t["tp_comm_s"] = comm.time(net.link(cross["tp"]))
    dp_link = net.link(cross["dp"] or cross["cp"])
    dense_grads = (ctx.params - experts) / (lay.tp * lay.pp) * ctx.state.grads
    per_micro = lay.pp == 1  # pipeline schedules run backward outside the micro-batch loop
    raw = dp_comm(dense_grads, lay.dp * lay.cp, lay.zero, m, per_micro).time(dp_link)
    if experts:
        expert_grads = experts / (lay.tp * lay.pp * lay.ep) * ctx.state.grads
        expert_dp = dp_comm(expert_grads, lay.dp * lay.cp // lay.ep, lay.zero, m, per_micro)
        raw += expert_dp.time(dp_link)
    t["dp_comm_s"] = raw - min(DP_OVERLAP * raw, compute)
    if lay.pp > 1:
        comm = pp_comm(lay.micro_batch_size, s_local, model.dim, m, dt, lay.tp)
        t["pp_comm_s"] = comm.scaled(lay.pp_virtual_stages).time(net.link(cross["pp"]))
        mb = compute / m  # F : B : W = 1 : 2 : 0.5, as in the bubble defaults
        t["bubble_s"] = bubble_time(lay.pp_schedule, lay.pp, mb / 3, 2 * mb / 3, mb / 6,
                                    2 * mb / 3, lay.pp_virtual_stages)
    if lay.ep > 1 and model.moe is not None:
        comm = ep_comm(b, s_local, model.dim, model.moe.top_k, lay.ep, layers, dt)
        t["ep_comm_s"] = comm.time(net.link(cross["ep"]))
    if lay.cp > 1:
        comm = cp_comm(b, model.seq_len, model.n_kv_heads // lay.tp, model.head_dim, lay.cp,
                       layers, dt, m)
        t["cp_comm_s"] = comm.time(net.link(cross["cp"]))
    return StepTime(**t)


def estimate_candidate(ctx: PlanContext, lay: ParallelLayout, m: int) -> Estimate:
    """`lay` priced with `m` micro-batches per step, at the pinned recompute level or the
    lightest that fits (full, the smallest, if none)."""
    states = model_state_memory(ctx.params, lay.dp, lay.zero, ctx.state, tp=lay.tp, pp=lay.pp,
                                cp=lay.cp, ep=lay.ep, expert_params=ctx.experts)
    pinned = ctx.recompute != "auto"
    recompute = ctx.recompute if pinned else "full"
    memory = _memory(ctx, lay, m, recompute, states)
    if not pinned and memory.total <= ctx.budget:  # otherwise nothing lighter can fit either
        for level in ("none", "selective"):
            candidate = _memory(ctx, lay, m, level, states)
            if candidate.total <= ctx.budget:
                recompute, memory = level, candidate
                break
    tokens, model = ctx.gbs * ctx.model.seq_len, ctx.model
    flops = train_flops_per_token(ctx.active, model.n_layers, model.dim, model.seq_len)
    return Estimate(lay, recompute, m, memory, _step_time(ctx, lay, m, recompute), ctx.budget,
                    tokens, flops_per_step=flops * tokens, peak_flops=ctx.peak_flops,
                    warnings=tuple(soft_warnings(lay, m)))
