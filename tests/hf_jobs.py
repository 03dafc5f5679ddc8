"""Per-rank jobs and references for the Hugging Face export/import tests (importable by ranks).

The reference side is transformers' own LlamaForCausalLM (MixtralForCausalLM for MoE), built
from a tiny config in the test process (nothing is downloaded); the Tenax side is the engine's
Transformer, fed the parameters a job gathered (`Trainer.full_params`, any layout).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from tenax.testing.checkpoint_jobs import save_one_step

logger = logging.getLogger(__name__)

# hidden 64, 2 layers, 4 heads, 2 kv heads, vocab 128: splits over tp2 and pp2
HF_TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
           "model.vocab_size=128", "model.ffn_hidden=96", "model.seq_len=16",
           "train.global_batch_size=4", "train.warmup_steps=0", "train.steps=2",
           "parallel.micro_batch_size=1", "resources.device=cpu"]
# 4 experts, top 2; capacity_factor = num_experts / top_k: Tenax drops nothing, so its forward
# is HF Mixtral's (dropless) one
MOE_TINY = ["model.moe={num_experts: 4, top_k: 2, capacity_factor: 2.0}"]
LLAMA31_SCALING = ("model.rope_scaling={factor: 8.0, low_freq_factor: 1.0, "
                   "high_freq_factor: 4.0, original_max_position_embeddings: 8}")


def hf_spec(extra: list[str] | None = None) -> Any:
    from tenax.workers.spec import load_spec

    return load_spec(overrides=HF_TINY + (extra or []))


def save_job(rank: int, world: int, uri: str, layout: dict[str, Any],
             extra: list[str]) -> dict[str, torch.Tensor] | None:
    """Train one step in `layout`, save step 1 synchronously; rank 0 returns the full params."""
    return save_one_step(rank, world, uri, layout, HF_TINY + extra, timeout_s=60)


def first_step_job(rank: int, world: int, layout: dict[str, Any],
                   extra: list[str]) -> dict[str, Any]:
    """Build a trainer (init_from in `extra`), take one step: its loss and the start params."""
    from tenax.parallel.layout import ParallelLayout
    from tenax.workers.trainer import Trainer

    spec = hf_spec(extra)
    trainer = Trainer(spec, ParallelLayout(**{"micro_batch_size": 1, **layout}))
    start = trainer.full_params()
    loss = trainer.run_step().loss
    return {"loss": loss, "params": start if rank == 0 else None}


def tenax_logits(spec: Any, params: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """The engine's single-process forward with `params` (canonical names)."""
    from tenax.parallel import Transformer, tie_output

    with torch.device("meta"):
        model = Transformer(spec.model.args())
    model.to_empty(device="cpu")
    tie_output(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
    with torch.no_grad():
        return model(tokens).float()


def hf_model(path: str | Path, model_class: str = "LlamaForCausalLM") -> Any:
    """`model_class`.from_pretrained(path) in float32; fails on any loading complaint."""
    import transformers
    from transformers.utils import logging as hf_logging

    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                records.append(record.getMessage())

    handler = Collect()
    hf_logger = hf_logging.get_logger("transformers")
    hf_logger.addHandler(handler)
    try:
        model, info = getattr(transformers, model_class).from_pretrained(
            str(path), dtype=torch.float32, output_loading_info=True,
            attn_implementation="eager")
    finally:
        hf_logger.removeHandler(handler)
    problems = {k: v for k, v in info.items() if v}
    if problems or records:
        raise AssertionError(f"from_pretrained complained: {problems} {records}")
    return model.eval()


def hf_logits(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits.float()


def tiny_llama_config(**overrides: Any) -> Any:
    """The LlamaConfig matching HF_TINY (built locally)."""
    from transformers import LlamaConfig

    fields = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                  max_position_embeddings=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                  tie_word_embeddings=False)
    fields.update(overrides)
    return LlamaConfig(**fields)


def save_random(model_class: Any, config: Any, path: Path, seed: int) -> Any:
    """`model_class(config)` randomly initialised from `seed`, saved with save_pretrained at
    `path`."""
    torch.manual_seed(seed)
    model = model_class(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # away from 1, so a skipped or swapped norm would show
                p.uniform_(0.5, 1.5)
            elif name.endswith("gate.weight"):  # a router sharp enough that a wrong expert
                p.normal_(0.0, 0.5)             # order or transpose changes the top_k
    model.save_pretrained(str(path))
    return model


def random_hf_model(path: Path, seed: int = 0, **overrides: Any) -> Any:
    """A randomly initialised tiny LlamaForCausalLM saved with save_pretrained at `path`."""
    from transformers import LlamaForCausalLM

    return save_random(LlamaForCausalLM, tiny_llama_config(**overrides), path, seed)


def tiny_mixtral_config(**overrides: Any) -> Any:
    """A MixtralConfig with HF_TINY's shape and MOE_TINY's experts (built locally)."""
    from transformers import MixtralConfig

    llama = tiny_llama_config().to_dict()
    fields = {k: llama[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                    "num_attention_heads", "num_key_value_heads", "vocab_size",
                                    "max_position_embeddings", "rms_norm_eps",
                                    "tie_word_embeddings")}
    fields.update(rope_theta=10000.0, num_local_experts=4, num_experts_per_tok=2,
                  sliding_window=None)
    fields.update(overrides)
    return MixtralConfig(**fields)


def random_hf_mixtral(path: Path, seed: int = 0, **overrides: Any) -> Any:
    """A randomly initialised tiny MixtralForCausalLM saved with save_pretrained at `path`."""
    from transformers import MixtralForCausalLM

    return save_random(MixtralForCausalLM, tiny_mixtral_config(**overrides), path, seed)


def save_checkpoints(root: Path, layouts: dict[str, dict[str, Any]], extra: list[str]
                     ) -> dict[str, tuple[str, dict[str, torch.Tensor]]]:
    """name -> (checkpoint URI, full params at the saved step) of a 2-rank job per layout."""
    from tests.distributed import run_ranks

    out = {}
    for name, layout in layouts.items():
        uri = f"file://{root}/{name}"
        out[name] = (uri, run_ranks(save_job, 2, uri, layout, extra)[0])
    return out


def tokens_for(vocab: int = 128, seq: int = 16, batch: int = 2, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=generator)
