"""Llama-style decoder built from a `ModelArgs`, shaped so every parallelism can be applied later.

Why it looks the way it does:
- `layers` is an `nn.ModuleDict` keyed "0".."n-1": a pipeline stage deletes the blocks it does
  not own and the remaining parameters keep the names a checkpoint uses, whatever the layout.
- `tok_embeddings`, `norm` and `output` may be set to None (pipeline stages): without an
  embedding the input is already hidden states; without an output head hidden states come out.
- Attention infers its local head count from the projected tensor (`view(b, s, -1, head_dim)`),
  so column-sharded `wq`/`wk`/`wv` under tensor parallelism need no change to this module.
- Rotary cos/sin are computed from explicit global token positions, not from a buffer indexed by
  local position, because context parallelism hands a rank non-contiguous chunks of a sequence.
- Initial weights are a function of (seed, parameter name) only (`init_weights`), never of the
  layout, the rank or the order modules were built in; that is what lets a run re-planned onto a
  different layout start from, and reproduce, the same model.
"""
from __future__ import annotations

import hashlib
import logging
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tenax.parallel.config import ModelArgs, RopeScalingArgs

logger = logging.getLogger(__name__)

ROPE_THETA = 10000.0
NORM_EPS = 1e-5
INIT_STD = 0.02
NORM_MODULES = frozenset({"attention_norm", "ffn_norm", "norm"})
# Output projections that write into the residual stream get a depth-scaled std (GPT-2 style) so
# the residual variance does not grow with the number of layers.
RESIDUAL_OUT_MODULES = frozenset({"wo", "w2"})
# Wrappers (activation checkpointing, torch.compile) insert these into parameter names; they are
# dropped so a wrapped model initialises exactly like an unwrapped one.
WRAPPER_NAME_PARTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = NORM_EPS) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32: bf16 mean-of-squares loses too much precision.
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_inv_freq(head_dim: int, theta: float = ROPE_THETA,
                    scaling: RopeScalingArgs | None = None,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """The [head_dim // 2] rotary frequencies, float32; `scaling` applies Llama 3.1's rule."""
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    # Llama 3.1 (HF rope_type "llama3"): long wavelengths are slowed down by `factor`, short
    # ones kept, and the band between blends the two linearly in context-length / wavelength.
    context = float(scaling.original_max_position_embeddings)
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / scaling.factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(medium, blended, scaled)


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float = ROPE_THETA,
                   scaling: RopeScalingArgs | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [b or 1, s, 1, head_dim // 2] for global token `positions` ([s] or
    [b, s])."""
    if positions.dim() == 1:
        positions = positions.unsqueeze(0)
    if positions.dim() != 2:
        raise ValueError(f"positions: expected shape [s] or [b, s], got {tuple(positions.shape)}")
    inv_freq = rotary_inv_freq(head_dim, theta, scaling, positions.device)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    return angles.cos().unsqueeze(2), angles.sin().unsqueeze(2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [b, s, h, head_dim] by the position angles (half-split pairing), in float32."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Default attention core on [b, h, s, head_dim]; context parallelism swaps in ring attention.

    `attn_mask` ([b, 1, s, s] bool, True = may attend) replaces the plain causal mask, e.g. a
    block-causal mask that keeps attention inside each document."""
    if attn_mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)


class Attention(nn.Module):
    def __init__(self, spec: ModelArgs) -> None:
        super().__init__()
        self.head_dim = spec.head_dim
        kv_dim = spec.n_kv_heads * spec.head_dim
        self.wq = nn.Linear(spec.dim, spec.n_heads * spec.head_dim, bias=False)
        self.wk = nn.Linear(spec.dim, kv_dim, bias=False)
        self.wv = nn.Linear(spec.dim, kv_dim, bias=False)
        self.wo = nn.Linear(spec.n_heads * spec.head_dim, spec.dim, bias=False)
        # A plain attribute (not a submodule) so context parallelism can replace the core only.
        self.attention_fn: AttentionFn = causal_sdpa

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        # Shapes come from the projections, not from `x` or the spec: under TP the projections
        # hold only this rank's heads, and under SP `x` may be a sequence-sharded DTensor.
        b, s = q.shape[0], q.shape[1]
        q = q.view(b, s, -1, self.head_dim)
        k = k.view(b, s, -1, self.head_dim)
        v = v.view(b, s, -1, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        n_rep = q.shape[2] // k.shape[2]
        if n_rep > 1:
            # Query head j reads kv head j // n_rep; TP shards both contiguously, so this local
            # mapping matches the global one.
            k = k.repeat_interleave(n_rep, dim=2)
            v = v.repeat_interleave(n_rep, dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        # The mask goes as a keyword only when there is one: attention cores that take just
        # (q, k, v) (ring attention) keep working, and wrappers pass **kwargs through.
        out = self.attention_fn(q, k, v) if attn_mask is None else \
            self.attention_fn(q, k, v, attn_mask=attn_mask)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def build_feed_forward(spec: ModelArgs) -> nn.Module:
    """The FFN of one block: dense SwiGLU, or top-k routed SwiGLU experts when `spec.moe` is set."""
    if spec.moe is not None:
        # Imported here: expert_parallel is only needed by MoE models.
        from tenax.parallel.expert_parallel import MoEFeedForward
        return MoEFeedForward(spec.dim, spec.ffn_hidden, spec.moe)
    return FeedForward(spec.dim, spec.ffn_hidden)


class TransformerBlock(nn.Module):
    def __init__(self, spec: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(spec.dim, spec.norm_eps)
        self.attention = Attention(spec)
        self.ffn_norm = RMSNorm(spec.dim, spec.norm_eps)
        self.feed_forward = build_feed_forward(spec)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        # A keyword, not a positional input: TP's PrepareModuleInput checks positional inputs
        # against its layouts and passes keywords through untouched.
        h = x + self.attention(self.attention_norm(x), cos, sin, attn_mask=attn_mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, spec: ModelArgs) -> None:
        super().__init__()
        # The full spec stays attached: a pipeline stage holding a few layers still needs the
        # global n_layers for the depth-scaled init.
        self.spec = spec
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(spec.vocab_size, spec.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(spec) for i in range(spec.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(spec.dim, spec.norm_eps)
        self.output: nn.Linear | None = nn.Linear(spec.dim, spec.vocab_size, bias=False)
        tie_output(self)
        # This rank's global token positions, set by the trainer when they are not arange(s):
        # under context parallelism, and on pipeline stages whose input is sequence-sharded
        # hidden state (its length is then not the sequence length). Not a buffer: it is a
        # property of the layout, not of the model, and must not enter checkpoints.
        self.positions: torch.Tensor | None = None

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [b, s] (or hidden states [b, s, dim] without an embedding) -> logits or hidden.

        `positions` are global token positions ([s] or [b, s]); they default to arange(s) and
        differ from it only when this rank holds non-contiguous chunks (context parallelism)
        or restart at document starts. `attn_mask` ([b, 1, s, s] bool, True = may attend)
        replaces the causal mask in every layer (document masks); None keeps plain causal.
        """
        seq_len = tokens.shape[1]
        if positions is None and self.positions is not None:
            positions = self.positions
        elif positions is None:
            positions = torch.arange(seq_len, device=tokens.device)
        elif positions.shape[-1] != seq_len:
            raise ValueError(f"positions: last dim {positions.shape[-1]} does not match "
                             f"sequence length {seq_len}")
        cos, sin = rotary_cos_sin(positions.to(tokens.device), self.spec.head_dim,
                                  self.spec.rope_theta, self.spec.rope_scaling)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, cos, sin) if attn_mask is None else layer(h, cos, sin, attn_mask=attn_mask)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def tie_output(model: nn.Module) -> None:
    """With `tie_embeddings`, make the head's weight the embedding's Parameter (one tensor,
    one name: `tok_embeddings.weight`). Needed again after anything that replaces parameters
    (TP's parallelize_module, `to_empty`); a no-op without the flag or on a pipeline stage
    that lacks either module."""
    spec = getattr(model, "spec", None)
    embed, head = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    if spec is None or not spec.tie_embeddings or embed is None or head is None:
        return
    head.weight = embed.weight


def canonical_param_name(name: str) -> str:
    """The parameter's name with wrapper-inserted parts removed (the init and checkpoint key)."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_NAME_PARTS)


def param_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed from (seed, name); hashlib, because Python's hash() is salted."""
    digest = hashlib.sha256(f"tenax-init:{seed}:{canonical_param_name(name)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def full_init_tensor(name: str, shape: torch.Size, seed: int, n_layers: int) -> torch.Tensor:
    """The full float32 CPU value of parameter `name`; CPU so values do not depend on the device."""
    parts = canonical_param_name(name).split(".")
    owner = parts[-2] if len(parts) >= 2 else ""
    if owner in NORM_MODULES:
        return torch.ones(shape, dtype=torch.float32)
    std = INIT_STD / math.sqrt(2 * n_layers) if owner in RESIDUAL_OUT_MODULES else INIT_STD
    generator = torch.Generator(device="cpu").manual_seed(param_seed(seed, name))
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator)


@torch.no_grad()
def init_weights(model: Transformer, seed: int) -> None:
    """Fill every parameter from (seed, parameter name) alone.

    Works on plain tensors (including a model built on the meta device and then `to_empty`'d)
    and on DTensor parameters (after TP or FSDP2 were applied): for a DTensor the full tensor is
    generated on every rank and only the local shard is kept, via `distribute_tensor` with
    `src_data_rank=None` (each rank uses its own identical copy, no communication). The cost is
    generating each full parameter once per rank, which is fine at the sizes this project trains.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    n_layers = model.spec.n_layers
    for name, param in model.named_parameters():
        if param.is_meta:
            raise ValueError(f"init_weights: parameter {name!r} is on the meta device; "
                             "call model.to_empty(device=...) first")
        full = full_init_tensor(name, param.shape, seed, n_layers)
        if isinstance(param, DTensor):
            local = param.to_local()
            shard = distribute_tensor(full.to(local.device), param.device_mesh, param.placements,
                                      src_data_rank=None)
            local.copy_(shard.to_local())
        else:
            param.copy_(full)
    logger.debug("initialised %d parameters from seed %d", len(list(model.parameters())), seed)


def build_model(model_spec: ModelArgs, seed: int, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> Transformer:
    """Build on meta (no wasted default init), materialise on `device`, then `init_weights`."""
    with torch.device("meta"):
        model = Transformer(model_spec)
    model.to_empty(device=device)
    tie_output(model)
    init_weights(model, seed)
    return model.to(dtype=dtype)


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed token cross-entropy (float32) and the token count, so the trainer can divide by the
    token count of the whole global batch rather than average per micro-batch or per rank."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"cross_entropy_sum: logits shape {tuple(logits.shape)} does not match "
                         f"targets shape {tuple(targets.shape)} plus a vocab dim")
    flat = logits.reshape(-1, logits.shape[-1]).float()
    loss_sum = F.cross_entropy(flat, targets.reshape(-1), reduction="sum")
    return loss_sum, targets.numel()
