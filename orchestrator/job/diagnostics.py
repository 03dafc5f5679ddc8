"""Hang evidence, the controller's side: before a hung group is torn down, every rank's agent
dumps its training process's thread stacks (workers/diagnostics.py), and they are kept at
`<checkpoint.uri>/diagnostics/<UTC time>-<cause>/rank-N.txt` for `tenax diagnose LOCATION`.

Why before anything is killed: the stacks of a hang are only true while the hang lasts. Why
bounded: evidence must never delay a recovery by more than `timeout_s`; a rank whose agent does
not answer in time gets a file saying so, and any error here is a warning, not a failure.

Why the stacks name the failed rank: in a hang every rank stops stepping, so the policy (from
heartbeats) can only name the ranks whose step stalled, the lowest first. The stacks can tell:
the healthy ranks wait in the same collective and the hung one is elsewhere (`diagnose`). When
they name exactly one odd rank, the `failure` event's `rank` is that rank and its cause says
where it is and where the others wait.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from tenax.orchestrator.timeouts import Timeouts
from tenax.workers import Diagnosis, diagnose, diagnostics_location

if TYPE_CHECKING:
    from tenax.orchestrator.job.job_policy import JobDecision

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


def collect_stacks(ranks: list[Any], checkpoint_uri: str, cause: str, timeout_s: float
                   ) -> tuple[str | None, dict[int, str]]:
    """Dump and store every rank's stacks: (the location, or None when storing failed (logged);
    rank -> stack text as far as it was collected)."""
    import fsspec

    location = diagnostics_location(checkpoint_uri, cause)
    stacks: dict[int, str] = {}
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
        return None, stacks
    logger.info("stacks of %d rank(s) kept at %s (tenax diagnose %s)", len(stacks), location,
                location)
    return location, stacks


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]} waits" if len(ranks) == 1 else \
        f"ranks {', '.join(map(str, ranks))} wait"


def odd_rank(diagnosis: Diagnosis) -> tuple[int, str] | None:
    """(the one odd rank, where it is and where the others wait) when the stacks name exactly
    one rank out of place and both places have a stack; else None."""
    if len(diagnosis.odd) != 1:
        return None
    odd = diagnosis.odd[0]
    mine = next((frames for frames, ranks in diagnosis.groups if odd in ranks), ())
    others = [(frames, ranks) for frames, ranks in diagnosis.groups if odd not in ranks]
    if not mine or not others or not all(frames for frames, _ in others):
        return None  # a rank without a stack is no evidence of where anything is
    waits = "; ".join(f"{_ranks_text(ranks)} in {frames[0]}" for frames, ranks in others)
    return odd, f"rank {odd} hung in {mine[0]} while {waits}"


def named_by_stacks(decision: "JobDecision", stacks: dict[int, str]) -> "JobDecision":
    """`decision` with the rank the stacks single out as its root (first of `failed_ranks`)
    and a reason saying where each rank is; unchanged when they single out none."""
    found = odd_rank(diagnose(stacks)) if stacks else None
    if found is None:
        return decision
    odd, where = found
    detail = decision.reason.partition(" hung: ")[2] or decision.reason
    failed = (odd,) + tuple(r for r in decision.failed_ranks if r != odd)
    return replace(decision, failed_ranks=failed, reason=f"{where}; {detail}")


def hang_evidence(group: Any, spec: Any, decision: "JobDecision"
                  ) -> tuple["JobDecision", dict[str, Any]]:
    """For a hang whose ranks are still there: the decision as the stacks name it
    (`named_by_stacks`) and the `failure` event's extra fields {"diagnostics": LOCATION,
    "diagnostics_s": seconds the evidence took}; else `decision` and {}. Waits at most
    heartbeat_timeout_s (at least 3 s)."""
    if decision.cause_kind != "hang" or group is None or not group.ranks:
        return decision, {}
    start = time.monotonic()
    timeout_s = max(AGENT_DUMP_S + 1.0, Timeouts.from_spec(spec).probe_s)
    location, stacks = collect_stacks(list(group.ranks), spec.checkpoint.uri,
                                      decision.cause_kind, timeout_s)
    named = named_by_stacks(decision, stacks)
    seconds = round(time.monotonic() - start, 3)
    if location is None:
        return named, {}
    return named, {"diagnostics": location, "diagnostics_s": seconds}
