"""Tenax parameter names <-> Hugging Face Llama names, and the layout of each tensor.

Layout: every Llama tensor is stored the same way in both (nn.Linear's [out, in] weights, the
embedding as [vocab, dim]); in particular no q/k permutation is needed. Meta's original Llama
checkpoints pair rotary dimensions interleaved (2i, 2i+1) and HF's conversion script permutes
wq/wk rows into HF's `rotate_half` convention, which pairs dimension i with i + head_dim/2;
Tenax's `apply_rotary` already uses that half-split pairing, so HF's q_proj/k_proj are Tenax's
wq/wk as they are. tests/test_rope.py checks this against HF's own rotary code.
"""
from __future__ import annotations

import logging
import re

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


class NameMapError(KeyError):
    """A parameter name with no counterpart (e.g. MoE experts: no HF export yet)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def hf_name(name: str) -> str:
    """HF's name for a Tenax canonical parameter name."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    match = _TENAX_LAYER.match(name)
    if match and match.group(2) in BLOCK_NAMES:
        return f"model.layers.{match.group(1)}.{BLOCK_NAMES[match.group(2)]}"
    raise NameMapError(f"parameter {name!r} has no Hugging Face Llama counterpart")


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
