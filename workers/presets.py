"""Model presets for `--model-preset`: the DESIGN.md example and the public Llama 3 shapes."""
from __future__ import annotations

import copy
import logging
from typing import Any

from tenax.workers.errors import SpecError

logger = logging.getLogger(__name__)

# Llama 3 and 3.1 (config.json of the published models): rotary base 500000, RMSNorm eps 1e-5;
# 3.1 adds the llama3 rope scaling that stretches the 8192-token context to 128K.
LLAMA3 = dict(rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=False, moe=None)
LLAMA31_SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=8192)

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=512, seq_len=128,
                 ffn_hidden=688, moe=None),
    "llama3-8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                      seq_len=8192, ffn_hidden=14336, **LLAMA3),
    "llama3-70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                       seq_len=8192, ffn_hidden=28672, **LLAMA3),
    "llama3-405b": dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256,
                        seq_len=8192, ffn_hidden=53248, **LLAMA3),
}
for _size in ("8b", "70b", "405b"):
    PRESETS[f"llama3.1-{_size}"] = dict(PRESETS[f"llama3-{_size}"],
                                        rope_scaling=dict(LLAMA31_SCALING))


def preset_model(name: str) -> dict[str, Any]:
    if name not in PRESETS:
        raise SpecError(f"--model-preset: unknown preset {name!r} (known: {', '.join(PRESETS)})")
    return copy.deepcopy(PRESETS[name])
