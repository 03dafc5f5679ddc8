"""Tenax parameter names <-> Hugging Face Llama / Mixtral names, and the layout of each tensor.

Layout: every Llama tensor is stored the same way in both (nn.Linear's [out, in] weights, the
embedding as [vocab, dim]); in particular no q/k permutation is needed. Meta's original Llama
checkpoints pair rotary dimensions interleaved (2i, 2i+1) and HF's conversion script permutes
wq/wk rows into HF's `rotate_half` convention, which pairs dimension i with i + head_dim/2;
Tenax's `apply_rotary` already uses that half-split pairing, so HF's q_proj/k_proj are Tenax's
wq/wk as they are. tests/test_rope.py checks this against HF's own rotary code.

MoE blocks map onto Mixtral's classic on-disk layout (what vLLM and every transformers version
read; transformers 5 fuses the experts in memory when it loads them). The router is the same
[E, dim] Linear weight (`block_sparse_moe.gate`). Tenax stores each expert weight stacked,
`experts.w1` [E, dim, hidden] used as `x @ w1[e]`, so one Tenax tensor becomes E HF Linear
weights `block_sparse_moe.experts.{e}.w1.weight` = `w1[e].T` ([out, in]); likewise w3, and w2
[E, hidden, dim] -> E tensors [dim, hidden].
"""
from __future__ import annotations

import logging
import re

from tenax.workers.hf.errors import NameMapError

logger = logging.getLogger(__name__)

# Tenax's name of a block's sub-module -> HF's, under `layers.{i}.` / `model.layers.{i}.`.
BLOCK_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.router.weight": "block_sparse_moe.gate.weight",
}
# A block's stacked expert weights (Tenax) -> the per-expert HF projection name.
EXPERT_NAMES = {
    "feed_forward.experts.w1.weight": "w1",
    "feed_forward.experts.w3.weight": "w3",
    "feed_forward.experts.w2.weight": "w2",
}
TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
HF_BLOCK = {v: k for k, v in BLOCK_NAMES.items()}
HF_TOP = {v: k for k, v in TOP_NAMES.items()}
_TENAX_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def hf_name(name: str) -> str:
    """HF's name for a Tenax canonical parameter name."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    match = _TENAX_LAYER.match(name)
    if match and match.group(2) in BLOCK_NAMES:
        return f"model.layers.{match.group(1)}.{BLOCK_NAMES[match.group(2)]}"
    if match and match.group(2) in EXPERT_NAMES:
        raise NameMapError(f"parameter {name!r} holds stacked experts: it maps to one HF tensor "
                           f"per expert (hf_parts)")
    raise NameMapError(f"parameter {name!r} has no Hugging Face Llama counterpart")


def is_stacked_expert(name: str) -> bool:
    """True for a Tenax MoE expert weight ([E, d_in, d_out], one HF tensor per expert)."""
    match = _TENAX_LAYER.match(name)
    return bool(match and match.group(2) in EXPERT_NAMES)


def hf_parts(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """HF (name, shape) of each tensor the Tenax parameter becomes: itself, or for stacked
    experts [E, d_in, d_out] the E per-expert Linear weights [d_out, d_in], in expert order."""
    match = _TENAX_LAYER.match(name)
    if match is None or match.group(2) not in EXPERT_NAMES:
        return [(hf_name(name), tuple(shape))]
    if len(shape) != 3:
        raise NameMapError(f"parameter {name!r} has shape {list(shape)}; stacked experts are "
                           f"[num_experts, d_in, d_out]")
    proj = EXPERT_NAMES[match.group(2)]
    return [(f"model.layers.{match.group(1)}.block_sparse_moe.experts.{e}.{proj}.weight",
             (shape[2], shape[1])) for e in range(shape[0])]


def tenax_name(name: str) -> str:
    """Tenax's canonical name for an HF Llama parameter name."""
    if name in HF_TOP:
        return HF_TOP[name]
    match = _HF_LAYER.match(name)
    if match and match.group(2) in HF_BLOCK:
        return f"layers.{match.group(1)}.{HF_BLOCK[match.group(2)]}"
    raise NameMapError(f"HF tensor {name!r} has no Tenax counterpart")


def layer_order(name: str) -> tuple[int, int, str]:
    """Sort key: embedding, the blocks in order, final norm, head (how HF files read)."""
    match = _TENAX_LAYER.match(name)
    if match:
        return (1, int(match.group(1)), match.group(2))
    return (0 if name.startswith("tok_") else 2, 0, name)
