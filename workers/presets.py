"""Model presets for `--model-preset`: the DESIGN.md example and the public Llama 3 shapes."""
from __future__ import annotations

import logging
from typing import Any

from tenax.workers.errors import SpecError

logger = logging.getLogger(__name__)

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=512, seq_len=128,
                 ffn_hidden=688, moe=None),
    "llama3-8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                      seq_len=8192, ffn_hidden=14336, moe=None),
    "llama3-70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                       seq_len=8192, ffn_hidden=28672, moe=None),
    "llama3-405b": dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256,
                        seq_len=8192, ffn_hidden=53248, moe=None),
}


def preset_model(name: str) -> dict[str, Any]:
    if name not in PRESETS:
        raise SpecError(f"--model-preset: unknown preset {name!r} (known: {', '.join(PRESETS)})")
    return dict(PRESETS[name])
