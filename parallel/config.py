"""The engine's own model config: plain frozen dataclasses, built from the job spec by the caller.

`parallel/` is the bottom layer (orchestrator -> workers -> parallel), so it cannot see the
user-facing pydantic spec; like torchtitan's `ModelArgs`, the engine takes only the numbers it
needs. Validation of user input happens once, in the spec; these classes trust their inputs
except for the shape rules the engine itself relies on (`degree_problems` in layout.py checks
the parallel degrees against them).
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any, Mapping

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MoEArgs:
    num_experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25
    aux_loss_coef: float = 0.01


@dataclass(frozen=True)
class RopeScalingArgs:
    """Llama 3.1's rotary frequency scaling (HF `rope_type: llama3`): wavelengths longer than
    original_max_position_embeddings / low_freq_factor are divided by `factor`, shorter than
    .../ high_freq_factor are kept, and the band between is interpolated smoothly."""
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelArgs:
    """A Llama-style decoder's shape; `moe` set means routed SwiGLU experts replace the FFN."""
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    vocab_size: int = 512
    seq_len: int = 128
    ffn_hidden: int = 688
    moe: MoEArgs | None = None
    rope_theta: float = 10000.0
    rope_scaling: RopeScalingArgs | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False  # the output head's weight is the embedding's weight

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelArgs":
        """From the spec's `model` section as a plain mapping (unknown keys are an error)."""
        fields = dict(d)
        moe = fields.pop("moe", None)
        scaling = fields.pop("rope_scaling", None)
        unknown = sorted(set(fields) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"model: unknown keys {unknown} "
                             f"(known: {sorted(cls.__dataclass_fields__)})")
        return cls(**fields, moe=MoEArgs(**moe) if moe is not None else None,
                   rope_scaling=RopeScalingArgs(**scaling) if scaling is not None else None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def ffn_params(self) -> int:
        return 3 * self.dim * self.ffn_hidden  # SwiGLU: gate, up, down

    def layer_params(self, active: bool = False) -> int:
        """Parameters of one decoder block (attention, FFN or MoE, two RMSNorms)."""
        kv = self.n_kv_heads * self.head_dim
        attn = 2 * self.dim * self.dim + 2 * self.dim * kv
        if self.moe is None:
            ffn = self.ffn_params()
        else:
            experts = self.moe.top_k if active else self.moe.num_experts
            ffn = experts * self.ffn_params() + self.dim * self.moe.num_experts  # + router
        return attn + ffn + 2 * self.dim

    def num_params(self, active: bool = False) -> int:
        """Total parameters (one matrix if the head is tied to the embedding); `active` counts
        top_k experts only."""
        embed_and_head = (1 if self.tie_embeddings else 2) * self.vocab_size * self.dim
        return embed_and_head + self.n_layers * self.layer_params(active) + self.dim

    def expert_params(self) -> int:
        """Parameters that live in experts (sharded by ep); 0 for a dense model."""
        if self.moe is None:
            return 0
        return self.n_layers * self.moe.num_experts * self.ffn_params()


def tie_problems(spec: ModelArgs, pp: int, zero: int) -> list[str]:
    """Layouts a tied head cannot use: pipeline stages hold the embedding and head apart, and
    FSDP2 gives the embedding and the head units of their own."""
    if not spec.tie_embeddings:
        return []
    problems = []
    if pp > 1:
        problems.append(f"model.tie_embeddings: true needs parallel.pp=1 (got {pp}): the "
                        f"embedding and the output head live on different pipeline stages")
    if zero == 3:
        problems.append("model.tie_embeddings: true is not supported with parallel.zero=3 "
                        "(FSDP2 shards the embedding and the head as separate units); use "
                        "zero 0, 1 or 2")
    return problems
