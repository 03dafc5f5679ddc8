"""Hang evidence, the controller's side: before a hung group is torn down, every rank's agent
dumps its training process's thread stacks (workers/diagnostics.py), and they are kept at
`<checkpoint.uri>/diagnostics/<UTC time>-<cause>/rank-N.txt` for `tenax diagnose LOCATION`.

Why before anything is killed: the stacks of a hang are only true while the hang lasts. Why
bounded: evidence must never delay a recovery by more than `timeout_s`; a rank whose agent does
not answer in time gets a file saying so, and any error here is a warning, not a failure.
"""
from __future__ import annotations

import logging
from typing import Any

from tenax.workers import diagnostics_location

logger = logging.getLogger(__name__)

AGENT_DUMP_S = 2.0  # what each agent waits for its training process to finish the dump
NO_ANSWER = "(no stacks: the rank's agent did not answer within {:.0f} s)\n"
NOT_DUMPED = "(no stacks: the training process wrote none; it may have exited)\n"


def ask_agents(ranks: list[Any], timeout_s: float) -> dict[int, str]:
    """rank -> stack text from every live rank's agent, all asked at once, within timeout_s."""
    import ray

    refs = {h.rank: h.actor.dump_stacks.remote(min(AGENT_DUMP_S, timeout_s))
            for h in ranks if h.dead is None}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    out = {}
    for rank, ref in refs.items():
        if ref not in ready:
            out[rank] = NO_ANSWER.format(timeout_s)
            continue
        try:
            out[rank] = ray.get(ref, timeout=0)["text"] or NOT_DUMPED
        except Exception as err:  # a dead agent answers with its error: that is the evidence
            out[rank] = f"(no stacks: {type(err).__name__}: {err})\n"
    for h in ranks:
        if h.dead is not None:
            out[h.rank] = f"(no stacks: the rank's agent is gone: {h.dead})\n"
    return out


def collect_stacks(ranks: list[Any], checkpoint_uri: str, cause: str,
                   timeout_s: float) -> str | None:
    """Dump and store every rank's stacks; the location, or None when that failed (logged)."""
    import fsspec

    location = diagnostics_location(checkpoint_uri, cause)
    try:
        stacks = ask_agents(ranks, timeout_s)
        fs, root = fsspec.core.url_to_fs(location)
        fs.makedirs(root, exist_ok=True)
        for rank, text in sorted(stacks.items()):
            with fs.open(f"{root}/rank-{rank}.txt", "w") as f:
                f.write(text)
    except Exception as err:  # evidence is a courtesy; the recovery goes on without it
        logger.warning("could not keep the ranks' stacks at %s: %s: %s", location,
                       type(err).__name__, err)
        return None
    logger.info("stacks of %d rank(s) kept at %s (tenax diagnose %s)", len(stacks), location,
                location)
    return location


def hang_evidence(group: Any, spec: Any, cause_kind: str) -> dict[str, Any]:
    """The `failure` event's extra fields: {"diagnostics": LOCATION} for a hang whose ranks
    are still there, else {}. Waits at most heartbeat_timeout_s (at least 3 s)."""
    if cause_kind != "hang" or group is None or not group.ranks:
        return {}
    timeout_s = max(AGENT_DUMP_S + 1.0, spec.fault_tolerance.heartbeat_timeout_s)
    location = collect_stacks(list(group.ranks), spec.checkpoint.uri, cause_kind, timeout_s)
    return {"diagnostics": location} if location else {}
