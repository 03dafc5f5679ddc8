"""A profile of a running job on request (`tenax profile JOB_ID --steps N`): every rank's agent
passes the request to its training process, the ranks agree at a step boundary to record the
next N steps with torch.profiler (workers/profiling.py), and rank 0's `profile` event says when
the traces are at the location this returns.

Why not through the controller's inbox: the request changes none of the controller's state
and decides nothing; it is a message to the ranks of the group now running, like a heartbeat
poll. A group replaced meanwhile (a recovery) simply never runs the window: the caller sees no
`profile` event and may ask again.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from tenax.orchestrator.errors import ProfileUnavailable
from tenax.workers import diagnostics_location

logger = logging.getLogger(__name__)

MAX_PROFILE_STEPS = 1000  # a trace per step grows large: a window is a few steps, not a run


def request_profile(controller: Any, steps: int, timeout_s: float = 10.0) -> dict[str, Any]:
    """Ask every rank of `controller`'s running group to profile its next `steps` steps;
    {"request", "location", "step", "ranks"}. ValueError for a bad `steps`,
    ProfileUnavailable when the job is not RUNNING."""
    import ray

    if isinstance(steps, bool) or not isinstance(steps, int) or \
            not 1 <= steps <= MAX_PROFILE_STEPS:
        raise ValueError(f"steps: {steps!r} must be an integer in [1, {MAX_PROFILE_STEPS}]")
    group, state = controller.group, controller.state.value
    if state != "RUNNING" or group is None or not group.ranks:
        raise ProfileUnavailable(f"job {controller.job_id} is {state}: only a RUNNING job's "
                                 "ranks can be profiled; ask again once it runs")
    request = int(time.time() * 1000)
    handles = [h for h in group.ranks if h.dead is None]
    refs = [h.actor.request_profile.remote(request, steps) for h in handles]
    try:
        answered = ray.get(refs, timeout=timeout_s)
    except (ray.exceptions.RayError, TimeoutError) as err:  # an agent gone or stuck
        raise ProfileUnavailable(f"job {controller.job_id}: a rank's agent did not take the "
                                 f"request: {type(err).__name__}") from None
    if len(handles) < len(group.ranks) or not all(answered):
        raise ProfileUnavailable(f"job {controller.job_id}: not every rank's training process "
                                 "is running; ask again once it runs")
    location = diagnostics_location(controller.spec.checkpoint.uri, "profile", request / 1000)
    logger.info("job %s: profiling the next %d step(s) from step %d into %s",
                controller.job_id, steps, controller.step, location)
    return {"request": request, "location": location, "step": controller.step,
            "ranks": len(handles)}
