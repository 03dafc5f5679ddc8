"""Closed-form cost model: memory per rank, communication volume and time (bubble: bubble.py).

The planner must rank hundreds of layouts in well under a second after every failure, so every
estimate here is a pure function of a few numbers (no torch, no process groups). Each function
states its formula; the numbers are first-order (they ignore fragmentation, NCCL buffers and
kernel efficiency) and are meant to rank layouts, not to predict a profiler trace.

Units: bytes, seconds, FLOP/s. 1 GiB = 2**30 bytes.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

logger = logging.getLogger(__name__)

GIB = float(2 ** 30)
RECOMPUTE = ("none", "selective", "full")


def gib(nbytes: float) -> float:
    return nbytes / GIB


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name}: {value!r} must be > 0")


# ---- memory: model states ------------------------------------------------------------------
@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter held for weights, gradients and optimizer state."""
    weights: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


# bf16 weights + bf16 grads + fp32 (master weights, Adam m, Adam v) = 2 + 2 + 12 = 16 B/param.
MIXED_ADAMW = StateBytes(2, 2, 12)
# fp32 weights + fp32 grads + fp32 (m, v); no master copy needed = 4 + 4 + 8 = 16 B/param.
FP32_ADAMW = StateBytes(4, 4, 8)
ZERO_NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


@dataclass(frozen=True)
class MemoryLedger:
    """Bytes one rank holds. `buffers` is transient working memory (e.g. ZeRO-3 gathered layers)."""
    params: float
    grads: float
    optimizer: float
    activations: float = 0.0
    buffers: float = 0.0

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.buffers

    def to_dict(self) -> dict[str, float]:
        return {f"{k}_gib": round(gib(v), 3) for k, v in (
            ("params", self.params), ("grads", self.grads), ("optimizer", self.optimizer),
            ("model_states", self.model_states), ("activations", self.activations),
            ("buffers", self.buffers), ("total", self.total))}


def _sharded(params: float, n: int, zero: int, state: StateBytes) -> tuple[float, float, float]:
    """ZeRO stage s shards the optimizer (s>=1), then grads (s>=2), then weights (s>=3) over n."""
    return (state.weights * params / (n if zero >= 3 else 1),
            state.grads * params / (n if zero >= 2 else 1),
            state.optimizer * params / (n if zero >= 1 else 1))


def model_state_memory(params: float, dp: int = 1, zero: int = 1, state: StateBytes = MIXED_ADAMW,
                       *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                       expert_params: float = 0.0) -> MemoryLedger:
    """Per-rank model-state bytes; with 16 B/param (P params, sharding degree N):

    DDP 16P; ZeRO-1 4P + 12P/N; ZeRO-2 2P + 14P/N; ZeRO-3 16P/N.

    Model parallelism first divides P by tp*pp (even split; the embedding/head imbalance of the
    first/last stage is ignored). Dense params are replicated over dp*cp ranks (CP ranks hold the
    same weights), so their sharding degree is N = dp*cp. Expert params are further divided by
    ep, and an expert is replicated over the dp*cp/ep ranks outside its ep group, so N_e = dp*cp/ep.
    """
    if params < 0 or not 0 <= expert_params <= params:
        raise ValueError(f"params: {params!r} and expert_params: {expert_params!r} need "
                         f"0 <= expert_params <= params")
    if zero not in ZERO_NAMES:
        raise ValueError(f"zero: {zero!r} must be 0, 1, 2 or 3")
    _positive(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
    if (dp * cp) % ep:
        raise ValueError(f"ep: {ep} does not divide dp*cp={dp * cp}")
    dense = _sharded((params - expert_params) / (tp * pp), dp * cp, zero, state)
    expert = _sharded(expert_params / (tp * pp * ep), dp * cp // ep, zero, state)
    return MemoryLedger(*(d + e for d, e in zip(dense, expert)))


def zero_stage_ledgers(params: float, dp: int,
                       state: StateBytes = MIXED_ADAMW) -> dict[int, MemoryLedger]:
    """The four ZeRO stages side by side for `tenax plan memory --params-b P --world N`."""
    return {z: model_state_memory(params, dp, z, state) for z in ZERO_NAMES}


# ---- memory: activations -------------------------------------------------------------------
def attention_activation_bytes(seq: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                               cp: int = 1, dtype_bytes: float = 2, scores: bool = True) -> float:
    """dtype*(11*s*b*h + 5*a*s^2*b) / tp (Korthikanti et al. 2022, TP+SP; CP: s/cp queries), for
    comparison: the planner charges what this engine saves (`block_activation_bytes`)."""
    s_local = seq / cp
    score_term = 5 * heads * s_local * seq * micro_batch if scores else 0.0
    return dtype_bytes * (11 * s_local * micro_batch * hidden + score_term) / tp


def mlp_activation_bytes(seq: int, micro_batch: int, hidden: int, tp: int = 1, cp: int = 1,
                         dtype_bytes: float = 2, top_k: int = 1) -> float:
    """dtype*19*s*b*h / tp for a SwiGLU MLP; an MoE layer runs each token through top_k experts."""
    return dtype_bytes * 19 * (seq / cp) * micro_batch * hidden * top_k / tp


def layer_activation_bytes(seq: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                           cp: int = 1, recompute: str = "none", dtype_bytes: float = 2,
                           top_k: int = 1) -> float:
    """Korthikanti et al.'s layer (attention + MLP; selective drops the scores; full keeps the
    input dtype*s*b*h/tp, s -> s/cp), for comparison with `block_activation_bytes`."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute: {recompute!r} must be one of {RECOMPUTE}")
    _positive(seq=seq, micro_batch=micro_batch, hidden=hidden, heads=heads, tp=tp, cp=cp)
    if recompute == "full":
        return dtype_bytes * (seq / cp) * micro_batch * hidden / tp
    attn = attention_activation_bytes(seq, micro_batch, hidden, heads, tp, cp, dtype_bytes,
                                      scores=recompute == "none")
    return attn + mlp_activation_bytes(seq, micro_batch, hidden, tp, cp, dtype_bytes, top_k)


@dataclass(frozen=True)
class ActivationShape:
    """One rank's micro-batch: b sequences of s/cp tokens, width h, a heads, SwiGLU width F."""
    seq: int
    micro_batch: int
    hidden: int
    heads: int
    ffn_hidden: int
    tp: int = 1
    cp: int = 1
    top_k: int = 1
    dtype_bytes: float = 2


def block_activation_bytes(shape: ActivationShape, recompute: str = "none") -> float:
    """Bytes one decoder block of this engine saves for backward per micro-batch (measured with
    saved-tensor hooks, tests/test_recompute.py). Per token, in dtype bytes (t = tp). none:
    8h/t + 2h + 4F*top_k/t, + float32 4*(2 + a)/t. Sequence-sharded (SP): each norm's input and
    normalised input (4h/t). Gathered for the column-parallel projections: each norm's output
    (2h, not divided). Head-sharded: the attention core's
    q, k, v (3h/t; GQA keys/values are repeated to h first) and output (h/t, also wo's input),
    SwiGLU's w1 out, w3 out, silu out and product (4F/t). Float32: one rsqrt per norm (2/t) and
    one log-sum-exp per head (a/t). Flash-style attention (SDPA, ring attention) keeps no s x s
    scores at any level. With cp > 1 ring attention's output is laid out [b, a, s, d], so wo's
    input is a copy of it: one more h/t. selective: none minus the core's own saves (the
    log-sum-exp, and under cp > 1 its output). full: only the block input x (h/t). All scale
    with b*s/cp tokens."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute: {recompute!r} must be one of {RECOMPUTE}")
    s, t = shape, shape.tp
    _positive(seq=s.seq, micro_batch=s.micro_batch, hidden=s.hidden, tp=s.tp, cp=s.cp)
    if recompute == "full":
        per_token = s.dtype_bytes * s.hidden / t
    else:
        none = recompute == "none"
        ring_out = s.hidden if none and s.cp > 1 else 0
        per_token = (s.dtype_bytes * ((8 * s.hidden + ring_out + 4 * s.ffn_hidden * s.top_k) / t
                                      + 2 * s.hidden) + 4 * (2 + (s.heads if none else 0)) / t)
    return per_token * s.micro_batch * s.seq / s.cp


def head_activation_bytes(shape: ActivationShape, vocab: int, head_dim: int) -> float:
    """The rest of a model's saved bytes per micro-batch: final norm (2h/tp + h gathered + fp32
    rsqrt/tp), fp32 log-softmax (4V: tp ranks gather every logit), int64 ids and targets (16)."""
    s = shape  # + the rotary cos/sin every block shares (fp32, 4*head_dim per position)
    per_token = s.dtype_bytes * (2 * s.hidden / s.tp + s.hidden) + 4 / s.tp + 4 * vocab + 16
    return (per_token * s.micro_batch + 4 * head_dim) * s.seq / s.cp


def in_flight_microbatches(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> float:
    """Micro-batches whose activations the first (busiest) stage holds at peak. GPipe: all m.
    1F1B and zero-bubble (ZB-H1): min(p, m). Interleaved 1F1B: p*(1 + (p-1)/(p*v))
    (Korthikanti et al. 2022, sec. 4.2), never more than m."""
    _positive(pp=pp, microbatches=microbatches, virtual=virtual)
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(microbatches)
    if schedule == "interleaved_1f1b":
        return min(float(microbatches), pp * (1 + (pp - 1) / (pp * virtual)))
    return float(min(pp, microbatches))


def stage_activation_bytes(layer_bytes: float, n_layers: int, pp: int, in_flight: float,
                           virtual: int = 1) -> float:
    """layers on the stage (ceil(L/(p*v))*v) * per-layer bytes * in-flight micro-batches."""
    return math.ceil(n_layers / (pp * virtual)) * virtual * layer_bytes * in_flight


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
    _positive(n=n)
    return Comm("all_reduce", 2 * (n - 1) / n * size, 2 * (n - 1))


def all_gather(size: float, n: int) -> Comm:
    """Ring all-gather of an S-byte result: (N-1)/N*S per rank in N-1 steps."""
    _positive(n=n)
    return Comm("all_gather", (n - 1) / n * size, n - 1)


def reduce_scatter(size: float, n: int) -> Comm:
    """Ring reduce-scatter of an S-byte input: (N-1)/N*S per rank in N-1 steps."""
    return all_gather(size, n).scaled(1, "reduce_scatter")


def all_to_all(size: float, n: int) -> Comm:
    """Pairwise all-to-all of S bytes per rank: (N-1)/N*S leaves the rank, in N-1 steps."""
    _positive(n=n)
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
    _positive(microbatches=microbatches)
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
