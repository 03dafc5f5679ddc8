"""Model presets for `--model-preset`; they live with the spec in `workers/presets.py`."""
from __future__ import annotations

import logging

from tenax.workers import PRESETS, preset_model

logger = logging.getLogger(__name__)

__all__ = ["PRESETS", "preset_model"]
