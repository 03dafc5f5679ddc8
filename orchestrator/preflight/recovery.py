"""The preflight's recovery row: a storage checkpoint loaded into another layout, and one
in-memory snapshot restored, both training on as the uninterrupted smoke job did.

Storage: the catalog verifies step N-1 of the smoke job, step N is deleted and the job runs
again, resharded where the cluster allows it (`other_layout`: dp and tp swapped for the same
ranks, else another ZeRO stage), so the loaded state is the resharding path a rescale takes;
step N must repeat the smoke job's loss (LOSS_RTOL). Memory: a fresh job of
min(N, MEMORY_STEPS) steps, with no storage checkpoint before its end, has its last rank killed
as it is about to run its last step; it must resume from the agents' in-memory snapshots
(`recovered.source == "memory"`) and every step it trains must have the smoke job's loss.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from tenax.orchestrator.preflight.rows import (Row, memory_restore, recovery_row,
                                               with_memory)

logger = logging.getLogger(__name__)

MEMORY_STEPS = 4  # the memory check's job: enough for a snapshot before the kill, no more
MIN_MEMORY_STEPS = 3  # a kill at step 3 finds step 1 or 2 in memory (snapshots lag <= 2)
# (spec, faults) -> the scratch job's Watch; faults None: the drill's (the smoke job's) faults
Run = Callable[[Any, "tuple[Any, ...] | None"], Any]


def with_layout(spec: Any, layout: Any, **raw_changes: Any) -> Any:
    """`spec` pinned to `layout`'s degrees, with top-level sections updated by `raw_changes`
    (SpecError when the spec rejects that layout)."""
    from tenax.orchestrator.spec import spec_from_dict

    raw = spec.to_dict()
    raw["parallel"].update(dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp,
                           ep=layout.ep, zero=layout.zero,
                           micro_batch_size=layout.micro_batch_size)
    for section, fields in raw_changes.items():
        raw[section].update(fields)
    return spec_from_dict(raw)


def other_layout(spec: Any, ran: Any) -> tuple[Any, Any] | None:
    """(spec, layout) for resuming `ran`'s checkpoint differently on the same ranks: dp and
    tp swapped, else another ZeRO stage over dp > 1; None when no such layout is valid and
    fits the planner's memory budget."""
    from dataclasses import replace

    from tenax.orchestrator.spec import SpecError, plan_for_spec
    from tenax.parallel import LayoutError, PlanError

    candidates = []
    if ran.tp == 1 and ran.dp > 1:
        candidates.append(replace(ran, dp=1, tp=ran.dp))
    if ran.dp == 1 and ran.tp > 1:
        candidates.append(replace(ran, dp=ran.tp, tp=1))
    if ran.dp > 1:
        candidates.append(replace(ran, zero=0 if ran.zero else 1))
    from tenax.orchestrator.placement import cluster_gpus

    r = spec.resources
    detected = cluster_gpus(r.gpus_per_node) if candidates else None
    for layout in candidates:
        try:
            moved = with_layout(spec, layout)
            plan = plan_for_spec(moved, layout.world_size, r.gpus_per_node, pin_zero=True,
                                 detected=detected)
        except (SpecError, LayoutError, PlanError, ValueError) as err:
            logger.info("preflight: %s is no layout to reshard into: %s", layout.describe(),
                        str(err).splitlines()[0])
            continue
        if plan.layout.degrees() == layout.degrees():
            return moved, layout
    return None


def recovery_check(spec: Any, steps: int, losses: dict[int, float], ran: Any,
                   run: Run) -> Row:
    """The recovery row (see the module doc): storage into another layout, then memory."""
    row = storage_check(spec, steps, losses.get(steps), ran, run)
    if row.verdict == "fail":
        return row
    if steps < MIN_MEMORY_STEPS:
        return with_memory(row, "warn", f"in-memory restore not checked: it needs --steps >= "
                                        f"{MIN_MEMORY_STEPS}", checked=False)
    if spec.checkpoint.memory_every_steps == 0:
        return with_memory(row, "pass", "in-memory restore not checked: the job keeps no "
                                        "snapshots (checkpoint.memory_every_steps=0)",
                           checked=False)
    return with_memory(row, *memory_check(spec, losses, ran, run))


def storage_check(spec: Any, steps: int, reference: float | None, ran: Any, run: Run) -> Row:
    """Verify step steps-1, delete step `steps`, resume from steps-1 (resharded where the
    cluster allows) and train step `steps`."""
    from tenax.checkpoint import Catalog, Storage

    saved = steps - 1
    catalog = Catalog(Storage(spec.checkpoint.uri))
    problems = catalog.verify(saved)
    if problems:
        return recovery_row(saved, problems, None, None, reference)
    catalog.delete(steps)
    other = other_layout(spec, ran)
    if other is None:
        into = f"{ran.describe()} (no other layout of {ran.world_size} ranks fits)"
        watch = run(spec, None)
    else:
        into = f"{other[1].describe()} (saved from {ran.describe()})"
        watch = run(other[0], None)
    return recovery_row(saved, [], watch.resumed_from, watch.losses.get(steps), reference, into)


def memory_check(spec: Any, losses: dict[int, float], ran: Any, run: Run) -> tuple[str, str]:
    """Kill the last rank at the last step of a short fresh job that keeps a snapshot every
    step and no storage checkpoint before its end; (verdict, words)."""
    from tenax.orchestrator.chaos.faults import ChaosEvent

    n = min(max(losses, default=0), MEMORY_STEPS)
    reference = {s: losses[s] for s in range(1, n + 1) if s in losses}
    job = with_layout(spec, ran, train={"steps": n},
                      checkpoint={"uri": spec.checkpoint.uri.rstrip("/") + "/memory-restore",
                                  "every_steps": n, "memory_every_steps": 1},
                      fault_tolerance={"max_restarts": 1})
    kill = ChaosEvent("kill", at=n, rank=ran.world_size - 1)
    watch = run(job, (kill,))
    recovered = watch.recovered[0] if watch.recovered else {}
    return memory_restore(recovered.get("source"), recovered.get("step"), watch.losses,
                          reference, watch.snapshots_off)
