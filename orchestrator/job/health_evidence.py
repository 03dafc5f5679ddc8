"""Straggler evidence: when the detector (orchestrator/job/health.py) flags a rank, sample the
thread stacks of its training process and of one healthy rank's, so `tenax diagnose` can say
what the slow rank spends its time on that the healthy one does not.

Why several samples: a straggler is not stuck; one stack is one instant of a step. `SAMPLES`
dumps `SAMPLE_GAP_S` apart from each rank at the same moments make a poor man's sampling
profile (the share of samples in each place). Why a healthy rank beside it: in synchronous
training the healthy ranks spend the straggler's extra time waiting in a collective, so the
place the two differ most is the answer.

Why in a thread: the job must not pause for evidence. The `straggler` event names the
location at once (`diagnostics`); the files land there within `deadline_s`. Everything runs
under a deadline and any error is a warning: evidence is a courtesy, never a failure.
Files: `<checkpoint.uri>/diagnostics/<time>-straggler/rank-N.txt` (samples separated by
`SAMPLE_MARK` lines) and `evidence.json` ({"cause", "roles": {rank: straggler | healthy},
"scores", "seconds"}).
"""
from __future__ import annotations

import json
import logging
import math
import threading
import time
from typing import Any, Callable, Mapping, Sequence

from tenax.orchestrator.job.diagnostics import ask_agents
from tenax.orchestrator.timeouts import Timeouts
from tenax.workers import EVIDENCE_FILE, diagnostics_location, join_samples

logger = logging.getLogger(__name__)

SAMPLES = 8
SAMPLE_GAP_S = 0.1
MIN_DEADLINE_S = 5.0  # the whole sampling, however short the heartbeat timeout


def healthy_rank(world: int, flagged: set[int], scores: Mapping[int, float]) -> int | None:
    """The unflagged rank whose score is nearest the median (1.0); the lowest if unscored."""
    candidates = [r for r in range(world) if r not in flagged]
    if not candidates:
        return None
    return min(candidates, key=lambda r: (abs(math.log(scores.get(r, 1.0) or 1.0)), r))


def straggler_evidence(group: Any, spec: Any, flags: Sequence[Any],
                       scores: Mapping[int, float], flagged: set[int] | None = None
                       ) -> dict[str, Any]:
    """Start sampling the flagged ranks and one healthy rank in the background; the `straggler`
    events' extra fields ({"diagnostics": LOCATION}, or {} when there is nothing to sample)."""
    if not flags or group is None or not group.ranks:
        return {}
    world = len(group.ranks)
    slow = {f.rank for f in flags if 0 <= f.rank < world}
    healthy = healthy_rank(world, slow | set(flagged or ()), scores)
    roles = {rank: "straggler" for rank in sorted(slow)}
    if healthy is not None:
        roles[healthy] = "healthy"
    handles = [h for h in group.ranks if h.rank in roles]
    location = diagnostics_location(spec.checkpoint.uri, "straggler")
    deadline_s = max(MIN_DEADLINE_S, Timeouts.from_spec(spec).probe_s)
    meta = {"cause": "straggler", "roles": {str(r): role for r, role in roles.items()},
            "scores": {str(f.rank): f.score for f in flags}}
    threading.Thread(target=keep_samples, args=(handles, location, meta, deadline_s),
                     name="straggler-evidence", daemon=True).start()
    return {"diagnostics": location}


def publish_stragglers(group: Any, spec: Any, flags: Sequence[Any], tracker: Any,
                       publish: Callable[..., None]) -> None:
    """A `straggler` event per new flag, each naming the evidence sampled in the background."""
    evidence = straggler_evidence(group, spec, flags, tracker.scores, tracker.flagged)
    for flag in flags:
        publish("straggler", rank=flag.rank, score=flag.score, action=flag.action,
                node=group.ranks[flag.rank].node_id, **evidence)


def sample_agents(handles: Sequence[Any], deadline_s: float, samples: int = SAMPLES,
                  gap_s: float = SAMPLE_GAP_S) -> dict[int, list[tuple[float, str]]]:
    """rank -> (seconds since the start, stack text) per sample: the hang evidence's one round
    of asking every agent at once (`ask_agents`), repeated `gap_s` apart until `samples`
    rounds or the deadline."""
    start = time.monotonic()
    out: dict[int, list[tuple[float, str]]] = {h.rank: [] for h in handles}
    for _ in range(samples):
        left = deadline_s - (time.monotonic() - start)
        if left <= 0:
            break
        at = time.monotonic() - start
        for rank, text in ask_agents(list(handles), left).items():
            out[rank].append((at, text))
        time.sleep(gap_s)
    return out


def keep_samples(handles: Sequence[Any], location: str, meta: dict[str, Any],
                 deadline_s: float) -> None:
    """Sample, then write `rank-N.txt` and `evidence.json` at `location` (errors: a warning)."""
    import fsspec

    start = time.monotonic()
    try:
        samples = sample_agents(handles, deadline_s)
        seconds = round(time.monotonic() - start, 3)
        fs, root = fsspec.core.url_to_fs(location)
        fs.makedirs(root, exist_ok=True)
        for rank, taken in sorted(samples.items()):
            with fs.open(f"{root}/rank-{rank}.txt", "w") as f:
                f.write(join_samples(taken))
        with fs.open(f"{root}/{EVIDENCE_FILE}", "w") as f:  # last: the location is complete
            json.dump({**meta, "samples": SAMPLES, "seconds": seconds}, f)
    except Exception as err:  # the job goes on without evidence
        logger.warning("could not keep straggler evidence at %s: %s: %s", location,
                       type(err).__name__, err)
        return
    logger.info("straggler evidence of ranks %s kept at %s in %.2f s (tenax diagnose %s)",
                sorted(samples), location, seconds, location)
