"""Choose a ParallelLayout for the GPUs at hand, and say why.

The controller re-plans after every failure ("best layout for 6 GPUs"), so this is a fast search
over divisors of the GPU count, pruned with the closed-form cost model. The recipe:
1. fit: model states + activations + buffers <= gpu_mem * (1 - margin), with the pinned
   recompute or per layout the lightest that fits (none, then selective, then full);
2. meet the global batch: dp * micro_batch divides it, micro_batch <= 8, and with pp > 1 at
   least 4*pp micro-batches;
3. lowest estimated step time: compute + TP comm (critical path) + DP comm not hidden behind
   compute (DP_OVERLAP of it at most) + PP p2p + EP all-to-all + CP ring (exposed: conservative)
   + bubble; a dimension whose groups cross nodes is timed on the inter-node link.
Rules: tp stays in a node (tp <= gpus_per_node, dividing it). DP/ZeRO is preferred over PP:
pipelines are searched only when no pp=1 layout fits (stage imbalance and p2p jitter are not
modelled). Near-ties (4 significant digits) go to smaller pp/tp/cp/ep, then ZeRO-1, 2, 0, 3.
This module enumerates the candidates, checks the request and chooses; pricing.py prices each
candidate (steps 1 and 3: memory and step time), the same way for a layout given as is.
"""
from __future__ import annotations

import logging
import math
import re
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Iterator, Mapping

from tenax.parallel.config import ModelArgs
from tenax.parallel.cost_model import Network
from tenax.parallel.errors import LayoutError, PlanError
from tenax.parallel.estimate import ZERO_PREFERENCE, Estimate, PlanResult, choose_best
from tenax.parallel.pricing import PlanContext, estimate_candidate
from tenax.parallel.layout import ParallelLayout
from tenax.parallel.memory_model import FP32_ADAMW, MIXED_ADAMW, RECOMPUTE, StateBytes, gib

logger = logging.getLogger(__name__)

H100_BF16_PEAK = 989e12     # dense bf16 FLOP/s of one H100 SXM
MAX_MICRO_BATCH = 8
# The share of peak a step sustains while computing: eager engines reach about 0.33-0.40 of an
# H100/H200 (this engine 0.36 on an H200, 0.53 with train.compile); `tenax plan layout --mfu`.
DEFAULT_MFU = 0.4
MIN_CP_CHUNK = 1024         # free cp only when each rank keeps >= this many tokens of a sequence
MAX_VIRTUAL = 4             # interleaved stages tried: 2..4 (more mostly adds p2p)
FIXABLE = tuple(k for k in ParallelLayout.__dataclass_fields__ if not k.startswith("_"))


@dataclass(frozen=True)
class Cluster:
    """The GPUs a plan is for: how many, how many share a node, and what one GPU can do.

    `peak_flops` is one GPU's dense peak and `network` its intra- and inter-node links
    (`hardware.planner_options` gives both per GPU model); `hardware` is only reported with
    the plan."""

    gpus: int
    gpus_per_node: int
    gpu_mem_gib: float = 80.0
    network: Network = Network()
    peak_flops: float = H100_BF16_PEAK
    hardware: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class PlanOptions:
    """What a plan must honour and what its estimate assumes.

    `fixed` pins any of FIXABLE ("auto" = free), `recompute` the activation recompute level
    ("auto": per layout the lightest that fits). global_batch_size defaults to 4 sequences per
    GPU (8 -> 32, 512 -> 2048), seq_len to the model's. `margin` is the share of GPU memory
    left free, `mfu` the share of peak sustained; `state` and `dtype_bytes` are the bytes per
    parameter of weights, gradients and optimizer, and per activation (bf16 mixed precision
    by default)."""

    global_batch_size: int | None = None
    seq_len: int | None = None
    fixed: Mapping[str, Any] = field(default_factory=dict)
    mfu: float = DEFAULT_MFU
    margin: float = 0.1
    state: StateBytes = MIXED_ADAMW
    dtype_bytes: float = 2
    max_micro_batch: int = MAX_MICRO_BATCH
    recompute: str = "auto"


# ---- enumeration -------------------------------------------------------------------------------
@lru_cache(maxsize=1024)
def _divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def _template(problem: str) -> str:  # aggregate rejections that differ only in numbers
    return "invalid: " + re.sub(r"\d+", "N", problem)


def _degree_tuples(ctx: PlanContext, rejected: Counter) -> Iterator[tuple[int, int, int, int]]:
    m, g = ctx.model, ctx.gpus
    in_node = {d for d in _divisors(g) if d <= ctx.gpn and (ctx.gpn % d == 0 or g <= ctx.gpn)}
    for tp in ctx.choices("tp", sorted(in_node)):
        if tp not in in_node:  # a tp group must not straddle nodes: it is the chattiest dim
            rejected[f"tp={tp} must divide {g} GPUs and stay inside a {ctx.gpn}-GPU node"] += 1
            continue
        for pp in ctx.choices("pp", [d for d in _divisors(g // tp) if d <= m.n_layers]):
            for cp in ctx.choices("cp", [d for d in _divisors(g // tp // pp) if d == 1 or (
                    m.seq_len % (2 * d) == 0 and m.seq_len // d >= MIN_CP_CHUNK)]):
                dp = g // (tp * pp * cp)
                if dp * tp * pp * cp == g and ctx.fixed.get("dp", dp) == dp:
                    yield tp, pp, cp, dp


def _variants(ctx: PlanContext, dp: int, pp: int, cp: int) -> Iterator[tuple[int, str, int]]:
    """(ep, schedule, virtual stages); ep only for MoE, schedules only when pipelined."""
    moe, fixed = ctx.model.moe, ctx.fixed
    eps = ctx.choices("ep", [1] if moe is None else _divisors(math.gcd(dp * cp, moe.num_experts)))
    schedules = [(fixed.get("pp_schedule", "1f1b"), fixed.get("pp_virtual_stages", 1))]
    if pp > 1 and "pp_schedule" not in fixed and "pp_virtual_stages" not in fixed:
        schedules = [("1f1b", 1), ("zero_bubble", 1)] + [("interleaved_1f1b", v) for v in range(
            2, MAX_VIRTUAL + 1) if pp * v <= ctx.model.n_layers]
    return ((ep, sched, v) for ep in eps for sched, v in schedules)


def _search(ctx: PlanContext) -> tuple[list[Estimate], Counter]:
    rejected, found = Counter(), []  # type: tuple[Counter, list[Estimate]]
    for pipelined in (False, True):  # pipelines only when no pp=1 layout fits: DP/ZeRO first
        if any(e.fits for e in found):
            break
        for tp, pp, cp, dp in _degree_tuples(ctx, rejected):
            if (pp > 1) != pipelined:
                continue
            for ep, schedule, v in _variants(ctx, dp, pp, cp):
                _expand(ctx, (dp, tp, pp, cp, ep), schedule, v, found, rejected)
    return found, rejected


def _expand(ctx: PlanContext, degrees: tuple[int, ...], schedule: str, v: int,
            found: list[Estimate], rejected: Counter) -> None:
    """Zero stages x micro-batches of one set of degrees. A larger micro-batch only needs more
    memory and leaves fewer micro-batches, so the first failure of either ends the sweep."""
    try:
        problems = ParallelLayout(*degrees, 1, 1, schedule, v).problems(ctx.model, ctx.gpus)
    except LayoutError as err:
        problems = [str(err)]
    if problems:
        rejected[_template(problems[0])] += 1
        return
    dp, pp = degrees[0], degrees[2]
    per_dp = ctx.gbs // dp if ctx.gbs % dp == 0 else 0
    free_mbs = [d for d in _divisors(per_dp) if d <= ctx.max_micro_batch] if per_dp else [1]
    for zero in ctx.choices("zero", ZERO_PREFERENCE):
        if zero != 1:  # a stage may rule itself out (zero 3 cannot shard ep-sharded experts)
            staged = ParallelLayout(*degrees, zero, 1, schedule, v).problems(ctx.model, ctx.gpus)
            if staged:
                rejected[_template(staged[0])] += 1
                continue
        for mbs in ctx.choices("micro_batch_size", free_mbs):
            lay = ParallelLayout(*degrees, zero, mbs, schedule, v)
            problems = lay.batch_problems(ctx.gbs)
            if problems:
                rejected[_template(problems[0])] += 1
                continue
            m = ctx.gbs // (dp * mbs)
            if pp > 1 and m < 4 * pp and not ctx.soft_ok:
                rejected["too few micro-batches: m < 4*pp"] += 1
                break
            if schedule == "interleaved_1f1b" and m % pp:
                rejected["interleaved_1f1b needs m divisible by pp"] += 1
                continue
            est = estimate_candidate(ctx, lay, m)
            found.append(est)
            if not est.fits:
                rejected["does not fit in memory"] += 1
                break


# ---- choice and explanation --------------------------------------------------------------------
def _no_fit_error(ctx: PlanContext, found: list[Estimate], rejected: Counter) -> PlanError:
    head = (f"no layout of {ctx.gpus} GPUs ({ctx.gpn} per node) fits a {ctx.params / 1e9:.3g}B-"
            f"parameter model in {gib(ctx.budget):.1f} GiB per GPU")
    why = ("; ".join(f"{k}: {v}" for k, v in rejected.most_common())
           or f"the pinned degrees cannot multiply to {ctx.gpus}")
    if not found:  # memory was never the problem: say what was
        return PlanError(f"no valid layout of {ctx.gpus} GPUs ({ctx.gpn} per node) for a "
                         f"{ctx.params / 1e9:.3g}B-parameter model: {why}; fixed: {ctx.fixed}")
    small = min(found, key=lambda e: e.memory.total)
    return PlanError(f"{head}: the smallest need found is {gib(small.memory.total):.1f} GiB "
                     f"({small.layout.describe()}, micro_batch {small.layout.micro_batch_size}, "
                     f"recompute={small.recompute}); add GPUs or memory. Rejected: {why}")


def _pinned_degrees(cluster: Cluster, options: PlanOptions) -> dict[str, Any]:
    """The request's pinned degrees, once every number in it was checked (PlanError if not)."""
    o = options
    pinned = {k: v for k, v in o.fixed.items() if v != "auto"}
    ints = {k: v for k, v in dict(pinned, gpus=cluster.gpus, gpus_per_node=cluster.gpus_per_node,
            seq_len=o.seq_len, global_batch_size=o.global_batch_size,
            max_micro_batch=o.max_micro_batch).items()
            if v is not None and k not in ("zero", "pp_schedule")}
    bad = {k: v for k, v in ints.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1}
    unknown = sorted(set(pinned) - set(FIXABLE))
    if bad or unknown or pinned.get("zero", 1) not in ZERO_PREFERENCE:
        raise PlanError(f"need positive integers (bad: {bad}), fixed keys among {FIXABLE} "
                        f"(unknown: {unknown}) and zero in 0..3 (got {pinned.get('zero', 1)!r})")
    if o.recompute not in ("auto",) + RECOMPUTE:
        raise PlanError(f"parallel.recompute: {o.recompute!r} must be one of "
                        f"{('auto',) + RECOMPUTE}")
    mem, peak = cluster.gpu_mem_gib, cluster.peak_flops
    if not (mem > 0 and 0 <= o.margin < 1 and 0 < o.mfu <= 1 and peak > 0):
        raise PlanError(f"need gpu_mem_gib > 0, 0 <= margin < 1, 0 < mfu <= 1, peak_flops > 0; "
                        f"got {mem}, {o.margin}, {o.mfu}, {peak}")
    return pinned


def _context(model: ModelArgs, cluster: Cluster, options: PlanOptions) -> PlanContext:
    pinned = _pinned_degrees(cluster, options)
    o, gpus, peak = options, cluster.gpus, cluster.peak_flops
    if o.seq_len is not None and o.seq_len != model.seq_len:
        model = replace(model, seq_len=o.seq_len)
    return PlanContext(model, gpus, cluster.gpus_per_node, o.global_batch_size or 4 * gpus,
                cluster.gpu_mem_gib * 2 ** 30 * (1 - o.margin), cluster.network,
                gpus * peak * o.mfu, o.state, o.dtype_bytes, o.max_micro_batch, pinned,
                model.num_params(), model.num_params(active=True), model.expert_params(),
                model.moe.top_k if model.moe else 1, gpus * peak, recompute=o.recompute,
                block_params=model.n_layers * model.layer_params(active=True))


def estimate_layout(model: ModelArgs, layout: ParallelLayout, cluster: Cluster,
                    options: PlanOptions = PlanOptions()) -> Estimate:
    """The planner's estimate of one given layout (no search): its memory per GPU with the
    recompute level `options.recompute` ("auto": the lightest that fits), step time and MFU.
    `cluster.gpus` must be the layout's world size; the global batch must split evenly."""
    if layout.world_size != cluster.gpus:
        raise PlanError(f"layout {layout.describe()} has {layout.world_size} ranks, "
                        f"the cluster {cluster.gpus}")
    ctx = _context(model, cluster, options)
    problems = layout.batch_problems(ctx.gbs)
    if problems:
        raise PlanError(problems[0])
    return estimate_candidate(ctx, layout, ctx.gbs // (layout.dp * layout.micro_batch_size))


def plan_layout(model: ModelArgs, cluster: Cluster,
                options: PlanOptions = PlanOptions()) -> PlanResult:
    """The fastest layout of `cluster`'s GPUs that fits, honouring `options` (see PlanOptions).
    Raises PlanError when nothing fits, naming the smallest memory need found."""
    ctx = _context(model, cluster, options)
    found, rejected = _search(ctx)
    if not any(e.fits for e in found) and "pp" in ctx.fixed:
        # The user pinned a pipeline: the m >= 4*pp rule of thumb becomes a warning.
        logger.info("no pinned-pp layout keeps m >= 4*pp; searching again with it as a warning")
        found, rejected = _search(replace(ctx, soft_ok=True))
    if not any(e.fits for e in found):
        err = _no_fit_error(ctx, found, rejected)
        logger.warning("plan failed: %s", err)
        raise err
    best, runners_up = choose_best(found)
    how = "pinned" if ctx.recompute != "auto" else "the lightest that fits"
    best = replace(best, reason=f"fastest that fits: {best.time.total_s:.4g} s/step, "
                   f"{gib(best.memory.total):.1f} of {gib(ctx.budget):.1f} GiB, recompute="
                   f"{best.recompute} ({how}; {sum(e.fits for e in found)} of {len(found)} fit)")
    logger.info("plan for %d GPUs (%d/node): %s %s; %s", ctx.gpus, ctx.gpn,
                best.layout.describe(), best.layout.to_dict(), best.reason)
    for warning in best.warnings:
        logger.warning("plan %s runs, but: %s", best.layout.describe(), warning)
    request = {"gpus": ctx.gpus, "gpus_per_node": ctx.gpn, "global_batch_size": ctx.gbs,
               "seq_len": ctx.model.seq_len, "fixed": ctx.fixed}
    hardware = dict(cluster.hardware or {}, peak_flops_per_gpu=cluster.peak_flops,
                    mfu_assumed=options.mfu)
    return PlanResult(best, runners_up, dict(rejected), len(found), request, hardware)


def plan_pinned(model: ModelArgs, parallel: Mapping[str, Any], global_batch_size: int, dtype: str,
                cluster: Cluster, pin_zero: bool = False, mfu: float = DEFAULT_MFU
                ) -> PlanResult:
    """plan_layout honoring the spec's `parallel` section (a plain mapping, "auto" = free), its
    global batch and train.dtype (`precision`): every degree that is not "auto" is pinned, and
    so are micro_batch_size, recompute, seq_len and the global batch. The ZeRO stage is free
    only while dp is "auto" (a user who fixes dp has sized the replicas, so their zero stays);
    the schedule and virtual stages are free only while pp is "auto". `mfu`: PlanOptions'."""
    p = parallel
    fixed: dict[str, Any] = {k: p[k] for k in ("dp", "tp", "pp", "cp", "ep") if p[k] != "auto"}
    if p["dp"] != "auto" or pin_zero:  # the controller keeps a running job's zero stage
        fixed["zero"] = p["zero"]
    if p["pp"] != "auto":
        fixed.update(pp_schedule=p["pp_schedule"], pp_virtual_stages=p["pp_virtual_stages"])
    fixed["micro_batch_size"] = p["micro_batch_size"]
    return plan_layout(model, cluster, PlanOptions(
        global_batch_size, model.seq_len, fixed, mfu=mfu, recompute=p.get("recompute", "auto"),
        **precision(dtype)))


def precision(dtype: str) -> dict[str, Any]:
    """PlanOptions' state and activation bytes for train.dtype: float32 plans fp32 AdamW
    (4+4+8 B/param, 4-byte activations), anything else bf16 mixed precision."""
    fp32 = dtype == "float32"
    return {"state": FP32_ADAMW if fp32 else MIXED_ADAMW, "dtype_bytes": 4 if fp32 else 2}
