"""The load path: choose a version once for all ranks, refuse the wrong one, reshard it in.

Why the ranks choose together: skipping a damaged version must lead every rank to the same
older one, and re-reading every checksum is as slow as the checkpoint is large. So rank 0 lists
the versions, each rank re-reads its share of a candidate's bytes, and all agree on the worst
verdict (one all-reduce); no rank waits in a collective while one reader checks everything,
whatever the checkpoint's size (the collective timeouts do not grow with it).
"""
from __future__ import annotations

import logging
import threading
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException

from tenax.checkpoint.collectives import (all_ranks_agree, dist_on, max_across_ranks,
                                          single_process_quiet)
from tenax.checkpoint.errors import (CatalogError, CheckpointError, ModelMismatchError, ShardError,
                                     StorageError, describe_error)
from tenax.checkpoint.format.catalog import Catalog, Manifest, version_name
from tenax.checkpoint.format.manifest import VersionHealth
from tenax.checkpoint.format.metadata_codec import FORMAT, LEGACY_FORMAT, legacy_refusal
from tenax.checkpoint.load.raw_reader import RawReader

logger = logging.getLogger(__name__)

INTACT, DAMAGED, UNREACHABLE = 0, 1, 2  # verdicts on a version; ranks agree on the worst


def check_layout(asked: Any, built: dict[str, Any]) -> None:
    """`load(layout)` is a reminder, not a conversion: it must be the trainer's own layout."""
    if asked is None:
        return
    want = asked.to_dict() if hasattr(asked, "to_dict") else dict(asked)
    diff = {k: (v, built.get(k)) for k, v in want.items() if k in built and built[k] != v}
    if diff:
        raise CheckpointError(f"load(layout=...) differs from the trainer's layout in {diff} "
                              f"(asked, built); build the trainer for the new layout first")


def choose_version(catalog: Catalog, rank: int, world: int) -> Manifest | None:
    """Newest intact committed manifest, identical on every rank (collective when world > 1).

    With several ranks each re-reads its own share of every candidate's bytes (Catalog.share_of)
    and the ranks agree on the worst verdict, so verifying a large checkpoint takes 1/world of
    the time one reader would, and no rank idles in a collective while another reads it all.
    """
    if not (dist_on() and world > 1):
        return _from_rank0(rank, world, lambda: _newest_intact(catalog))
    steps = _from_rank0(rank, world, catalog.committed_steps)
    for step in reversed(steps):
        health = catalog.check_patiently(step, share=(rank, world))
        verdict = max_across_ranks(UNREACHABLE if health.unreachable and not health.damaged
                                   else DAMAGED if health.damaged else INTACT)
        if verdict == UNREACHABLE:
            raise CheckpointError(f"checkpoint step {step} under {catalog.storage.uri} stayed "
                                  f"unreadable on some rank (this rank: "
                                  f"{'; '.join(health.unreachable) or 'ok'}); not falling "
                                  f"back to an older version")
        if verdict == DAMAGED:
            if health.damaged or rank == 0:
                logger.warning("skipping damaged checkpoint step %d: %s", step,
                               "; ".join(health.damaged) or "damaged on another rank's share")
            continue
        return _from_rank0(rank, world, lambda: catalog.manifest(step))
    _from_rank0(rank, world, lambda: _none_usable(catalog))
    return None


def newest_unverified(catalog: Catalog, rank: int, world: int) -> Manifest | None:
    """Newest committed manifest that reads, its files not re-read (collective when world > 1):
    for a version with one candidate whose check runs beside the load (`load_while_checking`)."""
    return _from_rank0(rank, world, lambda: catalog.latest_committed(verify=False))


def load_while_checking(catalog: Catalog, manifest: Manifest, state: Any, rank: int,
                        world: int) -> None:
    """`load_into`, while this rank re-reads its share of the version's bytes on another
    thread; every rank fails when any share is damaged or unreadable.

    Why beside, not before: an assembled in-memory snapshot is the only candidate (its
    fallback is storage, not an older version), so nothing is chosen by the check and the two
    passes over the bytes can overlap. A failed check leaves `state` partly overwritten: the
    caller must load another version into it (or fail), never train on it."""
    share = (rank, world) if dist_on() and world > 1 else None
    found: list[VersionHealth] = []
    checker = threading.Thread(target=lambda: found.append(
        catalog.check_patiently(manifest.step, share=share)), name="tenax-verify", daemon=True)
    checker.start()
    try:
        load_into(catalog, manifest, state)
    finally:
        checker.join()
    health = found[0] if found else VersionHealth(unreachable=("the check itself failed",))
    problems = [*health.damaged, *health.unreachable]
    if all_ranks_agree(not problems):
        return
    url = catalog.storage.url(version_name(manifest.step))
    raise CheckpointError(f"{url} failed its check while it was loaded: "
                          f"{'; '.join(problems)[:500] or 'on another rank (its log says)'}")


def _from_rank0(rank: int, world: int, read: Any) -> Any:
    """Rank 0's `read()` on every rank; a storage/catalog error (or a str) raises on all."""
    payload: list[Any] = [None]
    if rank == 0:
        try:
            payload[0] = read()
        except (StorageError, CatalogError) as exc:
            payload[0] = f"cannot read checkpoints: {type(exc).__name__}: {exc}"
    if dist_on() and world > 1:
        dist.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], str):
        raise CheckpointError(payload[0])
    return payload[0]


def _newest_intact(catalog: Catalog) -> Manifest | str | None:
    manifest = catalog.latest_committed(verify=True)
    return manifest if manifest is not None else _none_usable(catalog)


def _none_usable(catalog: Catalog) -> str | None:
    """None when nothing is committed (a fresh start); else why the job must not start over.

    Why refuse: committed versions that all fail verification mean the job's work is on
    storage but damaged; starting from step 0 would silently discard it (and the next saves
    would bury it). The operator decides: repair, or point checkpoint.uri somewhere new.
    """
    steps = catalog.committed_steps()
    if not steps:
        return None
    logger.error("every committed checkpoint under %s is damaged (steps %s); refusing to start "
                 "over from step 0", catalog.storage.uri, steps)
    return (f"no usable checkpoint under {catalog.storage.uri}: committed steps {steps} all "
            f"failed verification (run `tenax ckpt verify {catalog.storage.uri}` for details); "
            f"refusing to silently start from step 0 - repair them, or set checkpoint.uri to a "
            f"new location to start over")


def check_manifest(manifest: Manifest, url: str, model_hash: str, seed: int) -> None:
    if manifest.model_hash != model_hash:
        raise ModelMismatchError(
            f"checkpoint {url} (step {manifest.step}) was saved for another model: manifest "
            f"model_hash {manifest.model_hash[:16]}..., this job's model spec hashes to "
            f"{model_hash[:16]}...; refusing to load (check the job's model section or "
            f"checkpoint.uri)")
    if manifest.extra.get("format") == LEGACY_FORMAT:
        raise CheckpointError(legacy_refusal(url))
    if manifest.extra.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {url} has format {manifest.extra.get('format')!r}, "
                              f"this Tenax reads {FORMAT!r}")
    if manifest.seed != seed:
        logger.warning("checkpoint %s was trained with seed %d, this job uses %d: the data "
                       "order will differ from the original run", url, manifest.seed, seed)


def load_into(catalog: Catalog, manifest: Manifest, state: Any) -> None:
    """dcp.load the version into `state` (this rank's tensors, any layout): DCP reshards.

    Each rank plans and reads on its own (DCP's default load plans need no coordination; its
    distributed mode only gathers every rank's plan and outcome as pickled objects, three
    object collectives, ~35 ms of a restart); one tiny all-reduce afterwards still makes every
    rank fail when any did, so no rank trains on while another has no state.
    """
    version = version_name(manifest.step)
    error: BaseException | None = None
    try:
        with single_process_quiet():
            dcp.load(state, storage_reader=RawReader(catalog.storage, version),
                     planner=DefaultLoadPlanner(), no_dist=True)
    # Every rank must reach the agreement below, whatever failed (CheckpointException is a
    # BaseException: DCP wraps each rank's failure in one).
    except (Exception, CheckpointException) as exc:
        error = exc
    if all_ranks_agree(error is None):
        return
    if error is None:
        raise CheckpointError(f"loading {catalog.storage.url(version)} failed on another rank "
                              f"(this rank's part loaded; that rank's log says why)")
    if isinstance(error, (CheckpointException, ShardError, StorageError)):
        raise CheckpointError(f"loading {catalog.storage.url(version)} failed: "
                              f"{describe_error(error)}") from None
    raise error
