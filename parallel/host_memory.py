"""Host (CPU) memory the in-memory snapshots need, per rank and per node.

Every rank with `checkpoint.memory_every_steps > 0` keeps 2 local snapshot buffers of its full
training state in its current layout (double buffered, so a process killed mid-copy never
leaves a torn "latest"), and its agent holds 2 replica buffers of one rank of the previous node
block (ring: block k's ranks live on block k+1's agents; two, because the ranks of a node that
is lost mid-send may have delivered different steps, and the older one must still be whole).
Buffers are rewritten in place, never allocated beside the old ones
(checkpoint/memory/snapshot_store.py), so there is no transient extra.
Per rank on a node:

    steady = peak = 4 x S        (S = one rank's snapshot state bytes)
    single node (world <= gpus_per_node): no peer, no replica: steady = peak = 2 x S

and per node, the ranks on it (min(gpus_per_node, world)) times that. A rank whose state is
in device memory (`device=True`: resources.device cuda) also keeps one pinned host buffer of S
that its device copies land in before they are written to tmpfs
(checkpoint/memory/device_staging.py): 1 x S more per rank, in host memory but not in tmpfs.

S = model shard + optimizer state shard + a small cursor/RNG record, from the same ledger the
planner uses (`memory_model.model_state_memory`): tp*pp split the parameters, ZeRO stage >= 1
shards the optimizer over dp*cp, stage 3 the weights too, ep the experts. Gradients are not
snapshotted (they are rebuilt by the next step). The engine keeps its parameters in fp32
whatever `train.dtype` says (low precision comes from autocast, workers/trainer.py), so its
state is fp32 weights + AdamW's two fp32 moments = 4 + 8 = 12 B/param; an engine that kept
bf16 weights would snapshot bf16 weights + fp32 master + moments = 2 + 12 = 14 B/param
(`fp32_params=False`). Like the ledger, pipeline stages are split evenly (the embedding/head
imbalance is ignored): the safety fraction of the orchestrator's check absorbs it.

Pure functions of a few numbers: no torch, no Ray. 1 GiB = 2**30 bytes.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tenax.parallel.config import ModelArgs
from tenax.parallel.cost_model import (FP32_ADAMW, MIXED_ADAMW, MemoryLedger, StateBytes,
                                       model_state_memory)
from tenax.parallel.layout import ParallelLayout

logger = logging.getLogger(__name__)

ENGINE_FP32_PARAMS = True       # workers/trainer.py: params stay fp32 (autocast on GPUs)
CURSOR_RNG_BYTES = 64 * 1024    # step, data cursor, CPU/CUDA RNG states: a generous constant
LOCAL_BUFFERS = 2               # double buffered
STAGING_BUFFERS = 1             # a device state's pinned host buffer (not in tmpfs)
REPLICAS_STEADY = 2             # one rank of the previous node block, double buffered
REPLICAS_PEAK = 2               # the older one rewritten in place once the new one's bytes arrived
DTYPES = ("float32", "bfloat16", "float16")
DESCRIPTION = "in-memory snapshots: 2 local buffers + 2 peer replica buffers"
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(nbytes: float) -> str:
    """1536 -> '1.5 KiB'; 3 * 2**30 -> '3.0 GiB' (binary units, one decimal)."""
    value, unit = float(nbytes), _UNITS[0]
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            break
        value /= 1024
    return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"


def snapshot_state(dtype: str, fp32_params: bool = ENGINE_FP32_PARAMS) -> StateBytes:
    """Bytes per parameter of the state a snapshot holds (`grads` is unused here).

    fp32 params (this engine, any dtype) or dtype float32: weights 4 + moments 8 (FP32_ADAMW).
    Otherwise bf16/fp16 weights 2 + fp32 master weights and moments 12 (MIXED_ADAMW)."""
    if dtype not in DTYPES:
        raise ValueError(f"train.dtype: {dtype!r} must be one of {DTYPES}")
    return FP32_ADAMW if fp32_params or dtype == "float32" else MIXED_ADAMW


def rank_snapshot_bytes(model: ModelArgs, layout: ParallelLayout, dtype: str = "float32", *,
                        fp32_params: bool = ENGINE_FP32_PARAMS) -> int:
    """One rank's snapshot: its params + optimizer state (the ledger's per-rank figures for
    this layout) + CURSOR_RNG_BYTES. The same for every rank (even pipeline split)."""
    ledger = model_state_memory(model.num_params(), layout.dp, layout.zero,
                                snapshot_state(dtype, fp32_params), tp=layout.tp, pp=layout.pp,
                                cp=layout.cp, ep=layout.ep, expert_params=model.expert_params())
    return ledger_snapshot_bytes(ledger)


def ledger_snapshot_bytes(ledger: MemoryLedger) -> int:
    """A rank's snapshot from its memory ledger: params + optimizer + CURSOR_RNG_BYTES (no
    grads, activations or buffers). `tenax plan memory` uses it per ZeRO stage."""
    return int(round(ledger.params + ledger.optimizer)) + CURSOR_RNG_BYTES


@dataclass(frozen=True)
class SnapshotFootprint:
    """Host bytes of in-memory snapshots for one layout on nodes of `gpus_per_node` ranks."""
    memory_every_steps: int
    rank_state_bytes: int       # S: one rank's state (0 when snapshots are off)
    ranks_per_node: int
    replica: bool               # False on a single node: no peer to hold one
    per_rank_steady_bytes: int
    per_rank_peak_bytes: int
    per_node_steady_bytes: int
    per_node_peak_bytes: int
    staging_bytes: int = 0      # per rank: the pinned buffer of a device state (not in tmpfs)

    @property
    def enabled(self) -> bool:
        return self.memory_every_steps > 0

    @property
    def per_node_tmpfs_bytes(self) -> int:
        """What the node's snapshot tmpfs must hold at peak (the staging buffers are not in it)."""
        return self.per_node_peak_bytes - self.ranks_per_node * self.staging_bytes

    def what(self) -> str:
        if not self.enabled:
            return "in-memory snapshots: off (checkpoint.memory_every_steps=0)"
        staging = " + 1 pinned staging buffer (device state)" if self.staging_bytes else ""
        if not self.replica:
            return (f"in-memory snapshots: 2 local buffers{staging} (single node: no peer "
                    f"replica)")
        return DESCRIPTION + staging

    def summary(self) -> str:
        """One line for people: what it is, then per rank and per node, steady and peak."""
        if not self.enabled:
            return self.what()
        h = human_bytes
        return (f"{self.what()}, every {self.memory_every_steps} step(s): rank state "
                f"{h(self.rank_state_bytes)}; per rank {h(self.per_rank_steady_bytes)} steady, "
                f"{h(self.per_rank_peak_bytes)} peak; per node ({self.ranks_per_node} ranks) "
                f"{h(self.per_node_steady_bytes)} steady, {h(self.per_node_peak_bytes)} peak")

    def to_dict(self) -> dict[str, Any]:
        return {"what": self.what(), "memory_every_steps": self.memory_every_steps,
                "replica": self.replica, "ranks_per_node": self.ranks_per_node,
                "rank_state_bytes": self.rank_state_bytes,
                "per_rank_steady_bytes": self.per_rank_steady_bytes,
                "per_rank_peak_bytes": self.per_rank_peak_bytes,
                "per_node_steady_bytes": self.per_node_steady_bytes,
                "per_node_peak_bytes": self.per_node_peak_bytes,
                "staging_bytes": self.staging_bytes,
                "per_rank": {"steady": human_bytes(self.per_rank_steady_bytes),
                             "peak": human_bytes(self.per_rank_peak_bytes)},
                "per_node": {"steady": human_bytes(self.per_node_steady_bytes),
                             "peak": human_bytes(self.per_node_peak_bytes)},
                "summary": self.summary()}


def node_snapshot_footprint(rank_state_bytes: int, gpus_per_node: int, world_size: int,
                            memory_every_steps: int, device: bool = False) -> SnapshotFootprint:
    """Per rank 4x S (steady = peak) with a peer replica, 2x on a single node, 1x S more for
    a device state's staging buffer; per node the ranks on it times that;
    memory_every_steps=0 -> all zeros."""
    for name, value in (("resources.gpus_per_node", gpus_per_node), ("world_size", world_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: {value!r} must be a positive integer")
    if not isinstance(memory_every_steps, int) or memory_every_steps < 0:
        raise ValueError(f"checkpoint.memory_every_steps: {memory_every_steps!r} must be an "
                         f"integer >= 0")
    if rank_state_bytes < 0:
        raise ValueError(f"rank_state_bytes: {rank_state_bytes!r} must be >= 0")
    ranks = min(gpus_per_node, world_size)
    replica = world_size > gpus_per_node
    on = memory_every_steps > 0
    state = int(rank_state_bytes) if on else 0
    staging = STAGING_BUFFERS * state if device else 0
    steady = (LOCAL_BUFFERS + (REPLICAS_STEADY if replica else 0)) * state + staging
    peak = (LOCAL_BUFFERS + (REPLICAS_PEAK if replica else 0)) * state + staging
    return SnapshotFootprint(memory_every_steps, state, ranks, replica, steady, peak,
                             ranks * steady, ranks * peak, staging)


def snapshot_footprint(model: ModelArgs, layout: ParallelLayout, gpus_per_node: int,
                       memory_every_steps: int = 1, dtype: str = "float32", *,
                       fp32_params: bool = ENGINE_FP32_PARAMS,
                       device: bool = False) -> SnapshotFootprint:
    """The footprint of `layout` (world = layout.world_size) for this model and dtype;
    `device`: the ranks' state is in device memory (a staging buffer each)."""
    state = rank_snapshot_bytes(model, layout, dtype, fp32_params=fp32_params)
    return node_snapshot_footprint(state, gpus_per_node, layout.world_size, memory_every_steps,
                                   device)
