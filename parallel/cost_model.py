"""Closed-form cost model: communication volume and time, compute, and which groups cross nodes
(memory per rank: memory_model.py; bubble: bubble.py).

The planner must rank hundreds of layouts in well under a second after every failure, so every
estimate here is a pure function of a few numbers (no torch, no process groups). Each function
states its formula; the numbers are first-order (they ignore fragmentation, NCCL buffers and
kernel efficiency) and are meant to rank layouts, not to predict a profiler trace.

The memory figures (model states, activations) live in memory_model.py: they decide whether a
layout fits, these how fast it runs. They are re-exported here, where the planner's callers,
the benches and the tests import them.

Units: bytes, seconds, FLOP/s. 1 GiB = 2**30 bytes.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from tenax.parallel.memory_model import (FP32_ADAMW, GIB, MIXED_ADAMW, RECOMPUTE, ZERO_NAMES,
                                         ActivationShape, MemoryLedger, StateBytes,
                                         attention_activation_bytes, block_activation_bytes, gib,
                                         head_activation_bytes, in_flight_microbatches,
                                         layer_activation_bytes, mlp_activation_bytes,
                                         model_state_memory, positive, stage_activation_bytes,
                                         zero_stage_ledgers)

__all__ = [  # the memory names first: re-exported from memory_model.py
    "FP32_ADAMW", "GIB", "MIXED_ADAMW", "RECOMPUTE", "ZERO_NAMES", "ActivationShape",
    "MemoryLedger", "StateBytes", "attention_activation_bytes", "block_activation_bytes", "gib",
    "head_activation_bytes", "in_flight_microbatches", "layer_activation_bytes",
    "mlp_activation_bytes", "model_state_memory", "stage_activation_bytes", "zero_stage_ledgers",
    "INFINIBAND", "NVLINK", "Comm", "Link", "Network", "all_gather", "all_reduce", "all_to_all",
    "cp_comm", "crossing_dims", "dp_comm", "ep_comm", "pp_comm", "reduce_scatter", "tp_comm",
    "train_flops_per_token",
]

logger = logging.getLogger(__name__)


# ---- communication -------------------------------------------------------------------------
@dataclass(frozen=True)
class Link:
    """alpha-beta link: a message of n bytes sent in k steps takes k*alpha + n/bandwidth."""
    alpha_s: float
    bandwidth_Bps: float

    def time(self, nbytes: float, steps: float) -> float:
        return steps * self.alpha_s + nbytes / self.bandwidth_Bps


# Per-GPU figures of an H100 node: NVLink 4 (450 GB/s per direction) inside, one 400 Gb/s NIC
# per GPU (50 GB/s) across nodes.
NVLINK = Link(alpha_s=1e-6, bandwidth_Bps=450e9)
INFINIBAND = Link(alpha_s=5e-6, bandwidth_Bps=50e9)


@dataclass(frozen=True)
class Network:
    intra: Link = NVLINK
    inter: Link = INFINIBAND

    def link(self, crosses_nodes: bool) -> Link:
        """A ring that leaves the node runs at the slowest hop: the inter-node link."""
        return self.inter if crosses_nodes else self.intra

    def to_dict(self) -> dict[str, Any]:
        return {"intra": vars(self.intra), "inter": vars(self.inter)}


@dataclass(frozen=True)
class Comm:
    """Bytes one rank sends (and receives) and sequential latency steps, per optimizer step."""
    name: str
    nbytes: float
    steps: float

    def time(self, link: Link) -> float:
        return link.time(self.nbytes, self.steps)

    def scaled(self, k: float, name: str | None = None) -> "Comm":
        return Comm(name or self.name, self.nbytes * k, self.steps * k)

    def to_dict(self, link: Link | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "bytes": self.nbytes,
                               "gib": round(gib(self.nbytes), 4), "steps": self.steps}
        if link is not None:
            out["time_s"] = self.time(link)
        return out


def all_reduce(size: float, n: int) -> Comm:
    """Ring all-reduce of S bytes: 2(N-1)/N*S per rank in 2(N-1) steps."""
    positive(n=n)
    return Comm("all_reduce", 2 * (n - 1) / n * size, 2 * (n - 1))


def all_gather(size: float, n: int) -> Comm:
    """Ring all-gather of an S-byte result: (N-1)/N*S per rank in N-1 steps."""
    positive(n=n)
    return Comm("all_gather", (n - 1) / n * size, n - 1)


def reduce_scatter(size: float, n: int) -> Comm:
    """Ring reduce-scatter of an S-byte input: (N-1)/N*S per rank in N-1 steps."""
    return all_gather(size, n).scaled(1, "reduce_scatter")


def all_to_all(size: float, n: int) -> Comm:
    """Pairwise all-to-all of S bytes per rank: (N-1)/N*S leaves the rank, in N-1 steps."""
    positive(n=n)
    return Comm("all_to_all", (n - 1) / n * size, n - 1)


def tp_comm(batch: int, seq: int, hidden: int, tp: int, layers: int, dtype_bytes: float = 2,
            recompute: str = "none", vocab: int = 0, norm_grad_bytes: float = 0.0) -> Comm:
    """4 ring all-reduces per layer per step (2 forward, 2 backward) of b*s*h*dtype each.

    b is the batch the rank processes per step (global batch / dp, all micro-batches). With
    sequence parallel each all-reduce becomes all-gather + reduce-scatter: same volume. Full
    recompute reruns the forward, adding its 2 all-reduces per layer.

    `vocab` > 0 adds the stage ends the engine runs (tensor_parallel.py): the vocab-parallel
    embedding's reduce-scatter into the sequence-sharded stream and its backward all-gather,
    the head's sequence all-gather and its backward reduce-scatter (one all-reduce each), and
    the all-gather of the vocab-sharded logits, b*s*V*dtype. `norm_grad_bytes`: the
    sequence-parallel norms' weight grads are partial sums over tokens, all-reduced once per
    step ((2L+1)*h*grad bytes for a whole model).
    """
    count = 4 + (2 if recompute == "full" else 0)
    comm = all_reduce(batch * seq * hidden * dtype_bytes, tp).scaled(count * layers, "tp")
    if vocab:
        ends = all_reduce(batch * seq * hidden * dtype_bytes, tp).scaled(2)
        logits = all_gather(batch * seq * vocab * dtype_bytes, tp)
        comm = Comm("tp", comm.nbytes + ends.nbytes + logits.nbytes,
                    comm.steps + ends.steps + logits.steps)
    if norm_grad_bytes:
        norms = all_reduce(norm_grad_bytes, tp)
        comm = Comm("tp", comm.nbytes + norms.nbytes, comm.steps + norms.steps)
    return comm


def dp_comm(grad_bytes: float, n: int, zero: int, microbatches: int = 1,
            per_micro_batch: bool = True) -> Comm:
    """Gradient sync of the rank's (model-parallel-sharded) gradient bytes G over N ranks,
    as data_parallel.py runs it.

    DDP: one ring all-reduce; ZeRO-1: reduce-scatter + all-gather of the updated chunks; both
    2(N-1)/N*G per step. ZeRO-2: reduce-scatter per micro-batch + param all-gather:
    (m+1)(N-1)/N*G; under a pipeline schedule (`per_micro_batch=False`) backward runs outside
    the engine's micro-batch loop and ZeRO-2 reduces once, like ZeRO-1. ZeRO-3: param
    all-gather forward and backward per micro-batch (embedding, norm and head resharded like
    the blocks) + one reduce-scatter: (2m+1)(N-1)/N*G, 1.5x DDP at m=1. Steps count one
    bucketed collective each.
    """
    if zero not in ZERO_NAMES:
        raise ValueError(f"zero: {zero!r} must be 0, 1, 2 or 3")
    zero2 = microbatches + 1 if per_micro_batch else 2
    calls = {0: 2, 1: 2, 2: zero2, 3: 2 * microbatches + 1}[zero]
    return all_gather(grad_bytes, n).scaled(calls, "dp")


def pp_comm(micro_batch: int, seq: int, hidden: int, microbatches: int, dtype_bytes: float = 2,
            tp: int = 1) -> Comm:
    """Per stage boundary: each micro-batch sends b*s*h*dtype forward and the same backward.

    With TP+SP each tp rank sends its 1/tp sequence slice. One step per message.
    """
    size = micro_batch * seq * hidden * dtype_bytes / tp
    return Comm("pp", 2 * microbatches * size, 2 * microbatches)


def ep_comm(batch: int, seq: int, hidden: int, top_k: int, ep: int, moe_layers: int,
            dtype_bytes: float = 2) -> Comm:
    """Per MoE layer: dispatch + combine forward and the same backward = 4 all-to-alls,
    each of b*s*top_k*h*dtype bytes (b: the rank's batch per step)."""
    return all_to_all(batch * seq * top_k * hidden * dtype_bytes, ep).scaled(4 * moe_layers, "ep")


def cp_comm(batch: int, seq: int, kv_heads: int, head_dim: int, cp: int, layers: int,
            dtype_bytes: float = 2, microbatches: int = 1) -> Comm:
    """Ring attention: the local K and V block, 2*b*(s/cp)*n_kv*hd*dtype, makes cp-1 hops
    forward; backward passes K/V again plus dK/dV, so 3(cp-1) block sends per layer in all.
    `kv_heads` is per rank (n_kv_heads / tp). The ring runs once per micro-batch: the bytes
    (b = the rank's whole batch per step) do not depend on m, the latency steps scale with it."""
    positive(microbatches=microbatches)
    block = 2 * batch * (seq / cp) * kv_heads * head_dim * dtype_bytes
    return Comm("cp", 3 * (cp - 1) * block * layers, 3 * (cp - 1) * layers * microbatches)


# ---- compute and topology ----------------------------------------------------------------
def train_flops_per_token(active_params: float, n_layers: int, hidden: int, seq: int,
                          recompute: str = "none", block_params: float | None = None) -> float:
    """6*P + 12*L*h*s FLOPs per trained token (PaLM, app. B: matmuls + attention scores, no
    causal discount). Selective recompute reruns the attention core's forward (+4Lhs), full
    each block's forward (+2*block params + 4Lhs; `block_params` defaults to P)."""
    attn = n_layers * hidden * seq
    rerun = active_params if block_params is None else block_params
    extra = {"none": 0.0, "selective": 4 * attn, "full": 2 * rerun + 4 * attn}
    if recompute not in extra:
        raise ValueError(f"recompute: {recompute!r} must be one of {RECOMPUTE}")
    return 6 * active_params + 12 * attn + extra[recompute]


@lru_cache(maxsize=8192)
def crossing_dims(pp: int, dp: int, cp: int, tp: int, ep: int, gpus_per_node: int
                  ) -> dict[str, bool]:
    """Which dims have a group spanning nodes: ParallelLayout.crosses_nodes in O(world) integer
    steps instead of building every group (the planner asks for hundreds of layouts).

    Ranks are ordered (pp, dp, cp, tp), tp fastest, packed gpus_per_node per node; a group of a
    dim with rank stride `stride` is increasing, so it crosses iff its first and last rank sit
    on different nodes. ep groups are runs of ep consecutive (dp, cp) positions: stride tp.
    """
    world, gpn = pp * dp * cp * tp, gpus_per_node

    def crosses(stride: int, size: int) -> bool:
        span = stride * (size - 1)
        if size == 1 or world <= gpn:
            return False
        return span >= gpn or any(r // gpn != (r + span) // gpn for r in range(world)
                                  if (r // stride) % size == 0)

    return {"tp": crosses(1, tp), "cp": crosses(tp, cp), "dp": crosses(tp * cp, dp),
            "pp": crosses(tp * cp * dp, pp), "ep": crosses(tp, ep)}
