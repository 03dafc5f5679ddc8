"""The retention rule: which checkpoint versions to delete, as a pure function.

Why "head": step numbers alone do not say which versions are this job's newest work. When the
newest version rots, the job resumes from an older one and commits new versions with LOWER
steps than the rotten one. Counting `keep_last` by step number would then delete each new commit
right after it is made and keep only the rotten version, so a later restart starts from scratch.
So the caller passes the step it just committed (the head of the job's lineage): only versions
at or below it count toward `keep_last`, the head itself is always kept, and versions above it
(skipped at load as damaged, or from a lineage this run left) are never deleted by retention:
that would destroy evidence an operator may want, and replacing them is a save's job.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Collection

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Retention:
    """What the save coordinator keeps after a commit: the newest `keep_last`, every
    `keep_every`th step (0 = off), and the steps in `protect` (e.g. the one the job resumed
    from, which may be all that is intact)."""

    keep_last: int
    keep_every: int = 0
    protect: tuple[int, ...] = ()


def _check_knobs(keep_last: int, keep_every: int) -> None:
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}")
    if isinstance(keep_every, bool) or not isinstance(keep_every, int) or keep_every < 0:
        raise ValueError(f"keep_every must be an int >= 0 (0 = off), got {keep_every!r}")


def retention_plan(committed: Collection[int], uncommitted: Collection[int], keep_last: int,
                   keep_every: int, in_progress: Collection[int] = (),
                   protect: Collection[int] = (), head: int | None = None) -> dict[int, str]:
    """Pure retention decision: {step to delete: reason}.

    Keeps the newest `keep_last` committed versions at or below `head` (all committed versions
    when `head` is None), every committed step divisible by `keep_every` (when > 0), the steps
    in `protect`, `head` itself, every committed version above `head`, and always the newest
    committed version. Deletes every uncommitted version that is not being written
    (`in_progress`) and not protected.
    """
    _check_knobs(keep_last, keep_every)
    ordered = sorted(set(committed))
    lineage = ordered if head is None else [s for s in ordered if s <= head]
    ahead = set(ordered) - set(lineage)
    if ahead:
        logger.info("retention keeps committed steps %s above the just-committed step %s: "
                    "they are not part of this run's lineage", sorted(ahead), head)
    keep = set(lineage[-keep_last:]) | (set(protect) & set(ordered)) | ahead
    keep |= {head} & set(ordered) if head is not None else set()
    if keep_every > 0:
        keep |= {s for s in ordered if s % keep_every == 0}
    plan = {s: f"committed, older than the last {keep_last}"
            + (f" and not a multiple of keep_every={keep_every}" if keep_every else "")
            for s in ordered if s not in keep}
    busy = set(in_progress)
    for s in sorted(set(uncommitted) - set(ordered)):
        if s not in busy and s not in protect and s != head:
            plan[s] = "uncommitted leftover (no manifest.json)"
    return plan
