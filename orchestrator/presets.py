"""Model presets for `--model-preset`; they live with the spec in `workers/presets.py`."""
from __future__ import annotations

from workers.presets import PRESETS, preset_model

__all__ = ["PRESETS", "preset_model"]
