"""GPU memory per rank, in closed form: model states under ZeRO and saved activations.

Separate from the rest of the cost model (cost_model.py: communication, compute, topology)
because memory answers a different question: whether a layout fits at all, a hard limit, where
the rest prices how fast a fitting layout runs. The host-memory sizing of snapshots
(host_memory.py) and the plan's figures (estimate.py) need only this half. Like all of the cost
model these are pure functions of a few numbers (no torch); cost_model.py re-exports every name
here, where callers have always imported them.

Units: bytes. 1 GiB = 2**30 bytes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

GIB = float(2 ** 30)
RECOMPUTE = ("none", "selective", "full")


def gib(nbytes: float) -> float:
    return nbytes / GIB


def positive(**values: float) -> None:
    """Every formula divides by these counts: reject any that is not > 0, naming it."""
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
    positive(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
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
    positive(seq=seq, micro_batch=micro_batch, hidden=hidden, heads=heads, tp=tp, cp=cp)
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
    positive(seq=s.seq, micro_batch=s.micro_batch, hidden=s.hidden, tp=s.tp, cp=s.cp)
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
    positive(pp=pp, microbatches=microbatches, virtual=virtual)
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
