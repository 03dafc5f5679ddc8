"""MemoryOptions: what a rank's agent gives its training process for in-memory snapshots, and
how the process begins from them.

The agent (workers/worker.py) owns the snapshot directory, the newest save plan of the rank's
previous process and the snapshot assembled for a restore; the rank (workers/rank.py) takes
the plan over, resumes from the assembled snapshot when every rank can read it (from storage
otherwise), and takes the snapshots (checkpoint/memory/snapshot.py) its placement decided on:
whether and every how many steps is decided once, where host memory is planned
(orchestrator/placement/host_memory.py), and arrives here as `every_steps`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

logger = logging.getLogger(__name__)


@dataclass
class MemoryOptions:
    """In-memory snapshots of one rank (set by its agent; picklable)."""
    snapshot_dir: str | None = None  # where this rank's snapshots go (None: off)
    every_steps: int = 0  # the placement's decision: a snapshot every N steps (0: none)
    generation: int = 0  # the controller's placement counter: pieces of one generation combine
    restore_uri: str | None = None  # an assembled snapshot to resume from instead of storage
    on_snapshot: Callable[[dict[str, Any]], None] | None = None  # told when one is complete
    replicated: bool = False  # the agent sends each snapshot to a peer node: pace to it
    plan: str | None = None  # this rank's save plan from its previous process (plan_codec)
    on_plan: Callable[[str], None] | None = None  # told each new save plan (the agent keeps it)
    unusable: str = ""  # why no snapshot can go to snapshot_dir ("": it can); every rank stops

    def snapshot_due(self, step: int) -> bool:
        return self.every_steps > 0 and step % self.every_steps == 0


def begin_rank(mgr: Any, trainer: Any, memory: MemoryOptions | None, resume: bool, rank: int,
               world: int) -> tuple[int | None, str | None]:
    """Take over the previous process's save plan, then resume; with nothing to resume from,
    initialise the weights (a trainer built to resume is built without)."""
    if memory is not None:
        hand_over_plans(mgr.plans, memory, rank, world)
    resumed, source = resume_rank(mgr, memory) if resume else (None, None)
    if resume and resumed is None:  # a fresh start
        trainer.initialise_weights()
    return resumed, source


def hand_over_plans(plans: Any, memory: MemoryOptions, rank: int, world: int) -> None:
    """Adopt the save plan this rank's previous process left with the agent, and hand each new
    one over for the next (checkpoint/save/plan_codec.py: a restart then skips ~0.1 s of
    planning)."""
    from tenax.checkpoint import PlanFormatError
    from tenax.checkpoint.save import decode_plan, encode_plan

    if memory.plan is not None:
        try:
            plans.adopt(decode_plan(memory.plan, rank, world))
        except PlanFormatError as exc:
            logger.info("rank %d: the previous process's save plan is not used: %s", rank, exc)
    if memory.on_plan is not None:
        on_plan = memory.on_plan
        plans.on_new_plan = lambda cache: on_plan(encode_plan(cache, rank, world))


def snapshotter(spec: Any, mgr: Any, rank: int, world: int,
                memory: MemoryOptions | None) -> Any:
    """This rank's MemorySnapshotter when its placement decided on snapshots; None otherwise."""
    if memory is None or memory.snapshot_dir is None or memory.every_steps <= 0:
        return None
    from tenax.checkpoint import MemorySnapshotter, all_ranks_agree

    return MemorySnapshotter(mgr.config, mgr.state, rank, world, memory.snapshot_dir,
                             memory.generation, all_ranks_agree, memory.on_snapshot,
                             memory.replicated, plans=mgr.plans, off=memory.unusable or None)


def resume_rank(mgr: Any, memory: MemoryOptions | None) -> tuple[int | None, str | None]:
    """Load the assembled snapshot when every rank can read it; storage otherwise.

    A snapshot is checked while it loads (every rank fails together when any share of it is
    damaged), so a failed one may have overwritten part of the state: storage must then
    replace all of it, and with nothing in storage the rank stops rather than train on it."""
    from tenax.checkpoint import CheckpointError, all_ranks_agree

    uri = memory.restore_uri if memory is not None else None
    failed = False
    if uri is not None and all_ranks_agree(readable(uri)):
        try:
            step = mgr.load(source_uri=uri)
        except CheckpointError as exc:
            failed = True
            logger.warning("the in-memory snapshot at %s did not load (%s); resuming from "
                           "storage", uri, exc)
        else:
            if step is not None:
                return step, "memory"
            logger.warning("the in-memory snapshot at %s holds no committed version; resuming "
                           "from storage", uri)
    elif uri is not None:
        logger.warning("the in-memory snapshot at %s is not readable on every rank; "
                       "resuming from storage", uri)
    step = mgr.load()
    if step is None and failed:
        raise CheckpointError(f"the in-memory snapshot at {uri} failed while it was loaded and "
                              f"storage holds no checkpoint to load instead; not training on "
                              f"a partly loaded state")
    return step, ("storage" if step is not None else None)


def readable(uri: str) -> bool:
    from tenax.checkpoint import Catalog, Storage, StorageError

    try:
        return bool(Catalog(Storage(uri, timeout_s=10.0)).committed_steps())
    except (StorageError, OSError, ValueError) as exc:
        logger.warning("cannot read %s: %s", uri, exc)
        return False
