"""Count the collectives (and their bytes) that one step really runs.

The cost model predicts per-layer TP and per-step DP traffic; this counter measures it so tests
can compare the two. It is a TorchDispatchMode: DTensor's functional collectives
(`_c10d_functional.*`) and explicit `torch.distributed` calls (`c10d.*`) both pass through the
dispatcher, so one hook sees TP, SP, DP, FSDP and EP traffic alike without patching torch.
`wait_tensor` and other bookkeeping ops are ignored.
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

logger = logging.getLogger(__name__)

_NAMESPACES = ("_c10d_functional", "c10d")
_IGNORED = {"wait_tensor", "barrier", "monitored_barrier", "_wrap_tensor_autograd"}
# Canonical names so functional and c10d spellings of one collective count together.
_CANONICAL = {
    "allreduce_": "all_reduce", "all_reduce": "all_reduce", "all_reduce_": "all_reduce",
    "allgather_": "all_gather", "_allgather_base_": "all_gather",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_out": "all_gather",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all",
    "send": "send", "recv_": "recv", "broadcast_": "broadcast", "broadcast": "broadcast",
}


def collective_kind(func: Any) -> str | None:
    """The canonical collective an aten op runs ("all_reduce", ...), None when it is not one
    that moves data (bookkeeping such as wait_tensor, or not a collective at all)."""
    name = func._schema.name.split("::")[-1]
    if func.namespace not in _NAMESPACES or name in _IGNORED:
        return None
    return _CANONICAL.get(name, name)


def _input_bytes(func: Any, args: tuple, kwargs: dict) -> int:
    """Bytes this rank contributes: the op's input tensor(s).

    c10d ops put the output first (`_allgather_base_(output, input, ...)`), so the input is
    found by its schema name, falling back to the first tensor argument.
    """
    schema = func._schema.arguments
    named = dict(zip((a.name for a in schema), args))
    named.update(kwargs)
    for name, value in named.items():
        if name.startswith("input"):
            return sum(t.numel() * t.element_size() for t in tree_flatten(value)[0]
                       if isinstance(t, torch.Tensor))
    for leaf in tree_flatten(args)[0]:
        if isinstance(leaf, torch.Tensor):
            return leaf.numel() * leaf.element_size()
    return 0


@dataclass
class CommCounter(TorchDispatchMode):
    counts: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kind = collective_kind(func)
        if kind is not None:
            self.counts[kind] += 1
            self.bytes[kind] += _input_bytes(func, args, kwargs or {})
        return func(*args, **(kwargs or {}))

    def summary(self) -> dict[str, dict[str, int]]:
        return {k: {"count": self.counts[k], "bytes": self.bytes[k]} for k in sorted(self.counts)}
