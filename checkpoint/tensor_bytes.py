"""Tensors as raw bytes: what a shard file or a snapshot buffer holds of a CPU tensor."""
from __future__ import annotations

import numpy as np
import torch

from tenax.checkpoint.errors import ShardError


def byte_view(tensor: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a CPU tensor's bytes (a copy only if it is not contiguous)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        raise ShardError(f"byte_view needs a CPU tensor, got one on {t.device}; stage it first")
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()
