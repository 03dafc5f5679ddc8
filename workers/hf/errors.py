"""The Hugging Face interop's exceptions, in one module that imports nothing of the project.

Every constructor takes its message only, so each survives a pickle round trip (a rank's error
crosses process and Ray actor boundaries).
"""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

__all__ = ["ExportError", "HFConfigError", "HFLoadError", "NameMapError", "SafetensorsError"]


class ExportError(ValueError):
    """Why a checkpoint cannot be exported (names the checkpoint, the step or the key)."""


class HFConfigError(ValueError):
    """A config.json that Tenax cannot map, or one that disagrees with the job spec."""


class HFLoadError(ValueError):
    """The HF weights of `model.init_from` cannot initialise this model (says which and why)."""


class NameMapError(KeyError):
    """A parameter name with no counterpart (or a stacked expert asked for one name)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class SafetensorsError(ValueError):
    """A safetensors file or index that cannot be used (names the file and the problem)."""
