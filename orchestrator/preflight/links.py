"""The links row: each parallel dimension's collective, timed in each of its process groups at
the size the planner charges, against the bandwidth the planner assumes for that group.

The rules here are pure (sizes, figures, verdict); `links_probe.py` places the probes and runs
them. Which collective per dimension follows the engine: all-reduce for DP (gradients) and TP
(activations), all-to-all for EP (token dispatch), send/recv to the next rank of the group for
PP (stage boundaries) and the CP ring (K/V blocks). On `device: cpu` the planner has no figure
of its own (its defaults are an H100's NVLink and InfiniBand), so there each group is compared
with the median group of its dimension, and the row says so.
"""
from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass
from typing import Any, Sequence

from tenax.orchestrator.preflight.rows import Row
from tenax.workers import LinkTask

logger = logging.getLogger(__name__)

KIND_OF = {"dp": "all_reduce", "tp": "all_reduce", "ep": "all_to_all", "pp": "ring",
           "cp": "ring"}
# A probe message below MIN is all latency (no bandwidth figure); above MAX it only costs time.
MIN_PROBE_BYTES = 1 << 20
MAX_PROBE_BYTES = 64 << 20
SLOW_GROUP_SHARE = 0.5  # a group below this share of its reference warns


def planner_sizes(model: Any, layout: Any, global_batch_size: int,
                  dtype: str) -> dict[str, int]:
    """Bytes of one collective per dimension, as the planner charges it (cost_model's
    dp_comm, tp_comm, pp_comm, ep_comm, cp_comm): dims of degree 1 are left out."""
    from tenax.parallel import precision

    prec = precision(dtype)
    dt, grad_b = prec["dtype_bytes"], prec["state"].grads
    lay = layout
    b, s_local = global_batch_size // lay.dp, model.seq_len / lay.cp
    experts = model.expert_params()
    top_k = model.moe.top_k if model.moe else 1
    sizes = {
        "dp": (model.num_params() - experts) / (lay.tp * lay.pp) * grad_b,
        "tp": b * s_local * model.dim * dt,
        "pp": lay.micro_batch_size * s_local * model.dim * dt / lay.tp,
        "ep": b * s_local * top_k * model.dim * dt,
        "cp": 2 * b * s_local * (model.n_kv_heads // lay.tp) * model.head_dim * dt,
    }
    degrees = layout.degrees()
    return {dim: int(n) for dim, n in sizes.items() if degrees.get(dim, 1) > 1}


def probe_bytes(planned: int) -> int:
    return int(min(max(planned, MIN_PROBE_BYTES), MAX_PROBE_BYTES))


def link_tasks(model: Any, layout: Any, global_batch_size: int, dtype: str) -> list[LinkTask]:
    """One task per dimension of degree > 1, its groups from the layout."""
    sizes = planner_sizes(model, layout, global_batch_size, dtype)
    return [LinkTask(dim, KIND_OF[dim], tuple(tuple(g) for g in layout.groups(dim)),
                     probe_bytes(n)) for dim, n in sizes.items()]


def moved_bytes(kind: str, nbytes: int, n: int) -> float:
    """Bytes one rank sends in one collective (cost_model's ring and pairwise figures)."""
    if kind == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    if kind == "all_to_all":
        return (n - 1) / n * nbytes
    return float(nbytes)


def assumed_Bps(cuda: bool, layout: Any, dim: str, gpus_per_node: int) -> float | None:
    """The planner's per-GPU bandwidth for a group of `dim` (inter-node when the dim's groups
    leave the node); None for CPU slots, where the planner has no figure."""
    if not cuda:
        return None
    from tenax.parallel import Network

    return Network().link(layout.crosses_nodes(dim, gpus_per_node)).bandwidth_Bps


@dataclass
class GroupFigure:
    """One group's measurement: the slowest member's time sets the group's bandwidth."""
    dim: str
    ranks: tuple[int, ...]
    nodes: tuple[str, ...]
    seconds: float
    Bps: float
    ratio: float = 0.0  # Bps / the reference (the planner's figure or the median group)


def group_figures(tasks: Sequence[LinkTask], seconds: dict[int, dict[str, float]],
                  node_names: Sequence[str]) -> list[GroupFigure]:
    out = []
    for task in tasks:
        for group in task.groups:
            t = max(seconds[r][task.dim] for r in group)
            nodes = tuple(dict.fromkeys(node_names[r] for r in group))
            moved = moved_bytes(task.kind, task.nbytes, len(group))
            out.append(GroupFigure(task.dim, group, nodes, t, moved / max(t, 1e-9)))
    return out


def links_row(figures: list[GroupFigure], assumed: dict[str, float | None],
              sizes: dict[str, int]) -> Row:
    """Slowest group vs its reference; every group below SLOW_GROUP_SHARE warns with its
    nodes. `assumed` per dim: the planner's bandwidth, or None (compare with the median)."""
    if not figures:
        return Row("links", "no process groups", "-", "pass", "every parallel degree is 1")
    planner = all(v is not None for v in assumed.values())
    for dim in dict.fromkeys(f.dim for f in figures):
        mine = [f for f in figures if f.dim == dim]
        ref = assumed[dim] or statistics.median(f.Bps for f in mine)
        for f in mine:
            f.ratio = f.Bps / ref
    worst = min(figures, key=lambda f: f.ratio)
    measured = (f"slowest: {worst.dim} group {list(worst.ranks)} on {', '.join(worst.nodes)}, "
                f"{worst.Bps / 1e9:.3g} GB/s = {worst.ratio:.2f}x")
    expected = ("the planner's link bandwidth per group" if planner else
                "each group vs the median group of its dimension (no planner figure for cpu)")
    per_dim = "; ".join(_dim_summary(dim, figures, sizes[dim]) for dim in sizes)
    slow = [f for f in figures if f.ratio < SLOW_GROUP_SHARE]
    if slow:
        names = sorted({n for f in slow for n in f.nodes})
        return Row("links", measured, expected, "warn",
                   f"slow links on {', '.join(names)}: " + ", ".join(
                       f"{f.dim} {list(f.ranks)} {f.ratio:.2f}x" for f in slow) + f"; {per_dim}")
    return Row("links", measured, expected, "pass", per_dim)


def _dim_summary(dim: str, figures: list[GroupFigure], planned: int) -> str:
    mine = sorted(f.Bps for f in figures if f.dim == dim)
    probed = probe_bytes(planned)
    size = f"{planned / 2 ** 20:.3g} MiB" + ("" if probed == planned
                                             else f" (probed {probed / 2 ** 20:.3g} MiB)")
    return (f"{dim} {KIND_OF[dim]} {size}: {len(mine)} groups, median "
            f"{statistics.median(mine) / 1e9:.3g} GB/s")


def node_names(node_ids: Sequence[str], gpus_per_node: int) -> list[str]:
    """Per rank: its node in placement order (as chaos `node=k` counts) and its Ray id."""
    return [f"node {r // gpus_per_node} ({nid[:8]})" for r, nid in enumerate(node_ids)]
