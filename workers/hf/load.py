"""`model.init_from`: an HF Llama or Mixtral directory's weights into this rank's parameters.

The path is `init_weights`'s: for each parameter this rank holds, the full tensor (here read
from the safetensors file with one ranged read instead of generated from the seed), then either
copied in place or, for a DTensor (TP, FSDP2), cut to this rank's shard by `distribute_tensor`
with `src_data_rank=None` (no communication). A pipeline stage reads only its own layers. ZeRO-1/2
shard views and FSDP2 shards see the in-place writes. Every tensor the whole model needs is
checked (present, right shape, file not truncated) before any parameter is written, on every
rank, so all ranks fail the same way and no job trains on half-loaded weights. The same check
runs before the job is placed (`check_init_from`: `tenax run`, a service submission), so bad
weights refuse the job instead of failing its ranks.

A stacked expert weight [E, d_in, d_out] is built from Mixtral's E per-expert Linear weights
(each [d_out, d_in], transposed); under expert parallelism (a Shard(0) DTensor over the ep group)
a rank reads only its own experts' tensors.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tenax.parallel import ModelArgs, Transformer, canonical_param_name
from tenax.workers.hf.errors import HFLoadError
from tenax.workers.hf.names import NameMapError, hf_parts, is_stacked_expert
from tenax.workers.hf.safetensors_io import (SafetensorsError, TensorEntry, read_index,
                                             read_tensor)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExpertStack:
    """Where the E per-expert HF tensors of one stacked Tenax expert weight are, in order."""
    parts: tuple[TensorEntry, ...]


Located = TensorEntry | ExpertStack


def model_names(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Canonical name -> full shape of every parameter of the whole model."""
    with torch.device("meta"):
        built = Transformer(args)
    return {n: tuple(p.shape) for n, p in built.named_parameters()}


def check_hf_weights(root: str, args: ModelArgs) -> dict[str, Located]:
    """Canonical name -> where its HF tensor (or, for stacked experts, tensors) are;
    HFLoadError naming every problem found."""
    try:
        entries = read_index(root)
    except SafetensorsError as exc:
        raise HFLoadError(f"model.init_from: {exc}") from None
    found: dict[str, Located] = {}
    problems: list[str] = []
    used: set[str] = set()
    for name, shape in model_names(args).items():
        try:
            parts = hf_parts(name, shape)
        except NameMapError as exc:
            raise HFLoadError(f"model.init_from: {exc}") from None
        used.update(key for key, _ in parts)
        located = [_locate(entries, key, want, name, problems) for key, want in parts]
        if all(e is not None for e in located):
            found[name] = ExpertStack(tuple(located)) if is_stacked_expert(name) \
                else located[0]
    if problems:
        raise HFLoadError(f"model.init_from: {root} cannot initialise this model: "
                          + "; ".join(problems[:10])
                          + (f"; and {len(problems) - 10} more" if len(problems) > 10 else ""))
    unused = sorted(set(entries) - used)
    if unused:  # e.g. more layers than config.json says: HF would report them as unexpected
        logger.warning("model.init_from: %s holds %d tensor(s) this model does not use, ignored "
                       "(config.json may not describe the files): %s", root, len(unused),
                       unused[:5])
    return found


def will_resume(checkpoint_uri: str) -> bool:
    """Whether a job with this checkpoint.uri resumes (a committed version exists) and so
    ignores `init_from`; False when the storage cannot be read (the weights are checked then)."""
    from tenax.checkpoint import Catalog, CatalogError, Storage, StorageError

    try:
        return bool(Catalog(Storage(checkpoint_uri)).committed_steps())
    except (CatalogError, StorageError, OSError, ValueError) as exc:
        logger.info("cannot list %s (%s): checking model.init_from's weights", checkpoint_uri,
                    exc)
        return False


def check_init_from(spec: Any) -> bool:
    """Before any rank starts: `model.init_from`'s tensors fit the model (present, right
    shape, files whole; headers only), unless the job resumes from its own checkpoint.
    HFLoadError naming the tensor and the file; True when the weights were checked."""
    source = spec.model.init_from
    if source is None or will_resume(spec.checkpoint.uri):
        return False
    check_hf_weights(source, spec.model.args())
    return True


def _locate(entries: dict[str, TensorEntry], key: str, shape: tuple[int, ...], name: str,
            problems: list[str]) -> TensorEntry | None:
    entry = entries.get(key)
    if entry is None:
        problems.append(f"tensor {key!r} (Tenax {name!r}) is missing")
    elif entry.shape != shape:
        problems.append(f"tensor {key!r} has shape {list(entry.shape)}, the model needs "
                        f"{list(shape)}")
    else:
        return entry
    return None


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


class OpenFiles:
    """One open handle per safetensors file, for the many ranged reads of one load."""

    def __init__(self) -> None:
        self.handles: dict[str, Any] = {}

    def read(self, entry: TensorEntry) -> torch.Tensor:
        from fsspec.core import url_to_fs

        if entry.file not in self.handles:
            fs, path = url_to_fs(entry.file)
            self.handles[entry.file] = fs.open(path, "rb")
        try:
            return read_tensor(entry, self.handles[entry.file])
        except SafetensorsError as exc:
            raise HFLoadError(f"model.init_from: {exc}") from None

    def close(self) -> None:
        for handle in self.handles.values():
            handle.close()


def expert_rows(param: torch.Tensor) -> tuple[int, int] | None:
    """The experts [start, stop) this rank holds when `param` is split along experts only
    (expert parallelism's Shard(0)); None when the rank needs the whole tensor."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor) or tuple(param.placements) != (Shard(0),):
        return None
    rows = param.to_local().shape[0]
    if rows * param.device_mesh.size() != param.shape[0]:
        return None
    start = param.device_mesh.get_local_rank() * rows
    return start, start + rows


@torch.no_grad()
def _load_one(param: torch.Tensor, located: Located, files: OpenFiles) -> None:
    if isinstance(located, TensorEntry):
        _install(param, files.read(located).float())
        return
    rows = expert_rows(param)
    start, stop = rows if rows is not None else (0, len(located.parts))
    # Mixtral's per-expert Linear weight is [out, in]; Tenax's stacked slice is [in, out].
    block = torch.stack([files.read(e).float().t() for e in located.parts[start:stop]])
    if rows is not None:  # this rank's experts only: its local shard, no redistribution
        param.to_local().copy_(block)
    else:
        _install(param, block)


def load_hf_into(parts: list[nn.Module], args: ModelArgs, root: str) -> int:
    """Write the HF weights into `parts` (this rank's model chunks); the parameters written."""
    entries = check_hf_weights(root, args)
    files = OpenFiles()
    count = 0
    try:
        for part in parts:
            for name, param in part.named_parameters():
                _load_one(param, entries[canonical_param_name(name)], files)
                count += 1
    finally:
        files.close()
    logger.info("initialised %d parameters from %s", count, root)
    return count
