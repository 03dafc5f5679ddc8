"""`model.init_from`: an HF Llama directory's weights into this rank's parameters, any layout.

The path is `init_weights`'s: for each parameter this rank holds, the full tensor (here read
from the safetensors file with one ranged read instead of generated from the seed), then either
copied in place or, for a DTensor (TP, FSDP2), cut to this rank's shard by `distribute_tensor`
with `src_data_rank=None` (no communication). A pipeline stage reads only its own layers. ZeRO-1/2
shard views and FSDP2 shards see the in-place writes. Every tensor the whole model needs is
checked (present, right shape, file not truncated) before any parameter is written, on every
rank, so all ranks fail the same way and no job trains on half-loaded weights.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from tenax.parallel import ModelArgs, Transformer, canonical_param_name
from tenax.workers.hf.names import NameMapError, hf_name
from tenax.workers.hf.safetensors_io import (SafetensorsError, TensorEntry, read_index,
                                             read_tensor)

logger = logging.getLogger(__name__)


class HFLoadError(ValueError):
    """The HF weights of `model.init_from` cannot initialise this model (says which and why)."""


def model_names(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Canonical name -> full shape of every parameter of the whole model."""
    with torch.device("meta"):
        built = Transformer(args)
    return {n: tuple(p.shape) for n, p in built.named_parameters()}


def check_hf_weights(root: str, args: ModelArgs) -> dict[str, TensorEntry]:
    """Canonical name -> where its HF tensor is; HFLoadError naming every problem found."""
    if args.moe is not None:
        raise HFLoadError("model.init_from: MoE models cannot start from HF Llama weights")
    try:
        entries = read_index(root)
    except SafetensorsError as exc:
        raise HFLoadError(f"model.init_from: {exc}") from None
    found, problems = {}, []
    for name, shape in model_names(args).items():
        try:
            key = hf_name(name)
        except NameMapError as exc:
            raise HFLoadError(f"model.init_from: {exc}") from None
        entry = entries.get(key)
        if entry is None:
            problems.append(f"tensor {key!r} (Tenax {name!r}) is missing")
        elif entry.shape != shape:
            problems.append(f"tensor {key!r} has shape {list(entry.shape)}, the model needs "
                            f"{list(shape)}")
        else:
            found[name] = entry
    if problems:
        raise HFLoadError(f"model.init_from: {root} cannot initialise this model: "
                          + "; ".join(problems[:10])
                          + (f"; and {len(problems) - 10} more" if len(problems) > 10 else ""))
    return found


@torch.no_grad()
def _install(param: torch.Tensor, full: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        local = param.to_local()
        shard = distribute_tensor(full.to(local.device, local.dtype), param.device_mesh,
                                  param.placements, src_data_rank=None)
        local.copy_(shard.to_local())
    else:
        param.copy_(full)


def load_hf_into(parts: list[nn.Module], args: ModelArgs, root: str) -> int:
    """Write the HF weights into `parts` (this rank's model chunks); the tensors read."""
    from fsspec.core import url_to_fs

    entries = check_hf_weights(root, args)
    handles: dict[str, Any] = {}
    count = 0
    try:
        for part in parts:
            for name, param in part.named_parameters():
                entry = entries[canonical_param_name(name)]
                if entry.file not in handles:
                    fs, path = url_to_fs(entry.file)
                    handles[entry.file] = fs.open(path, "rb")
                try:
                    full = read_tensor(entry, handles[entry.file])
                except SafetensorsError as exc:
                    raise HFLoadError(f"model.init_from: {exc}") from None
                _install(param, full.float())
                count += 1
    finally:
        for handle in handles.values():
            handle.close()
    logger.info("initialised %d parameters from %s", count, root)
    return count
