"""The service's scheduling policy: a pure function of one snapshot of jobs and cluster.

Why pure: which job runs, waits, shrinks or is preempted is the decision users argue about, so
it lives in one place, is table-testable without Ray, and every decision carries its reason
(logged, stored as an event, shown by `tenax watch`/`tenax status`). The service
(orchestrator/service/scheduler.py) gathers the snapshot and executes the decisions. Same shape
as the job's policy (orchestrator/job/job_policy.py): an action enum (`SchedulingAction`), a
frozen `SchedulingDecision` with its action and reason, a pure `decide(snapshot)`.

Rules, in order:
- GPU accounting: free GPUs = the cluster's GPU slots minus what admitted jobs hold; a job
  holds the larger of its allotment and its current placement (a shrinking job still holds its
  old nodes until the boundary checkpoint is written; a growing one already holds its new ones).
- The queue: higher `priority` first, then submission time. The head of the queue reserves
  what it needs, so a smaller job behind it cannot starve it (no backfill).
- A queued job is admitted with min(target, free) nodes when that is at least `min_nodes`.
- A job that could never fit the cluster's largest shape is refused (`never_fits`); a job that
  waited longer than `resources.queue_timeout_s` expires.
- A queued job that does not fit may take room from running jobs of strictly lower priority:
  first by shrinking elastic ones toward their `min_nodes` (the planned scale-down path), then
  by preempting `resources.preemptible` ones (a planned stop at a checkpoint boundary, then a
  requeue). Nothing else is ever taken away from a running job.
- GPUs nobody waits for go to running jobs below their target (grow back), higher priority first.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from enum import Enum

logger = logging.getLogger(__name__)


class SchedulingAction(str, Enum):
    """What the scheduler does with one job this pass."""
    ADMIT = "admit"
    REFUSE = "refuse"
    EXPIRE = "expire"
    WAIT = "wait"
    SHRINK = "shrink"
    GROW = "grow"
    PREEMPT = "preempt"


A = SchedulingAction


@dataclass(frozen=True)
class JobView:
    """One job as the scheduler sees it. `running` means admitted (a controller exists)."""
    job_id: str
    priority: int
    order: float  # submission time; ties broken by job_id
    gpus_per_node: int
    min_nodes: int
    target_nodes: int  # spec nodes or the newest ScaleJob target, within [min, max]
    running: bool = False
    allotted: int = 0  # nodes the scheduler lets it use
    holds: int = 0  # nodes its current placement holds
    preemptible: bool = False
    preempting: bool = False  # a planned stop for a requeue is in flight
    queued_s: float = 0.0
    queue_timeout_s: float | None = None

    @property
    def held_gpus(self) -> int:
        return max(self.allotted, self.holds) * self.gpus_per_node if self.running else 0

    @property
    def need_gpus(self) -> int:
        return self.min_nodes * self.gpus_per_node

    def key(self) -> tuple[int, float, str]:
        return (-self.priority, self.order, self.job_id)


@dataclass(frozen=True)
class Cluster:
    """GPU slots per Ray node now, and per node of the largest shape it may grow to."""
    node_gpus: tuple[int, ...]
    largest: tuple[int, ...] | None = None  # None: the cluster cannot grow (no autoscaler)

    @property
    def gpus(self) -> int:
        return sum(self.node_gpus)


@dataclass(frozen=True)
class SchedulingSnapshot:
    """Every job the service knows (queued and admitted) and the cluster, at one moment."""
    jobs: tuple[JobView, ...]
    cluster: Cluster


@dataclass(frozen=True)
class SchedulingDecision:
    action: SchedulingAction
    reason: str
    job_id: str
    nodes: int = 0  # admit/shrink/grow: the new allotment
    position: int = 0  # wait: 1-based place in the queue
    missing_gpus: int = 0  # wait: GPUs it still lacks (what the autoscaler is asked for)


def never_fits(job: JobView, cluster: Cluster) -> str | None:
    """Why `job` can never run on `cluster` (whole job-nodes packed on one Ray node), or None."""
    g = job.gpus_per_node
    shapes = [cluster.node_gpus] + ([cluster.largest] if cluster.largest is not None else [])
    fits = max(sum(n // g for n in shape) for shape in shapes)
    if fits >= job.min_nodes:
        return None
    shape = max(shapes, key=sum)
    kind = "largest shape" if cluster.largest is not None else "nodes"
    return (f"resources.min_nodes={job.min_nodes} node(s) of resources.gpus_per_node={g} GPUs "
            f"can never fit: the cluster's {kind} ({', '.join(map(str, shape)) or 'none'} GPUs "
            f"per node) hold at most {fits} such node(s)")


def queue_order(jobs: tuple[JobView, ...]) -> list[JobView]:
    return sorted((j for j in jobs if not j.running), key=JobView.key)


def decide(snap: SchedulingSnapshot) -> list[SchedulingDecision]:
    """Every decision for this snapshot; jobs without a decision keep what they have."""
    running = {j.job_id: j for j in snap.jobs if j.running}
    free = snap.cluster.gpus - sum(j.held_gpus for j in running.values())
    out: list[SchedulingDecision] = []
    position = 0
    for job in queue_order(snap.jobs):
        why = never_fits(job, snap.cluster)
        if why is not None:
            out.append(SchedulingDecision(A.REFUSE, why, job.job_id))
            continue
        if job.queue_timeout_s is not None and job.queued_s > job.queue_timeout_s:
            out.append(SchedulingDecision(
                A.EXPIRE, f"waited {job.queued_s:.0f} s in the queue, more than "
                f"resources.queue_timeout_s={job.queue_timeout_s:g}", job.job_id))
            continue
        g = job.gpus_per_node
        nodes = min(job.target_nodes, max(0, free) // g)
        if nodes >= job.min_nodes:
            out.append(SchedulingDecision(A.ADMIT, f"{nodes * g} GPU(s) free for {nodes} "
                                          f"node(s) x {g} GPUs (priority {job.priority})",
                                          job.job_id, nodes))
            free -= nodes * g
            continue
        position += 1
        made, decisions = _make_room(job, free, running)
        out += decisions
        for d in decisions:
            running[d.job_id] = replace(running[d.job_id], allotted=d.nodes,
                                        preempting=d.action == A.PREEMPT)
        out.append(_wait(job, position, max(0, free), running, made))
        free -= job.need_gpus  # the head reserves what it needs: nobody behind it takes it
    out += _grow(list(running.values()), free)
    return out


def _wait(job: JobView, position: int, free: int, running: dict[str, JobView],
          made: str) -> SchedulingDecision:
    releasing = [f"{j.job_id} ({(max(j.holds, j.allotted) - j.allotted) * j.gpus_per_node})"
                 for j in running.values() if j.holds > j.allotted]
    what = f"waiting for {job.need_gpus} GPU(s) ({job.min_nodes} node(s) x {job.gpus_per_node})"
    what += f"; {free} free of the cluster's GPUs"
    if made:
        what += f"; {made}"
    elif releasing:
        what += "; being released by " + ", ".join(releasing)
    else:
        holders = [f"{j.job_id} ({j.held_gpus})" for j in running.values() if j.held_gpus]
        what += ("; held by " + ", ".join(holders)) if holders else ""
    return SchedulingDecision(A.WAIT, what, job.job_id, position=position,
                              missing_gpus=max(0, job.need_gpus - free))


def _make_room(job: JobView, free: int,
               running: dict[str, JobView]) -> tuple[str, list[SchedulingDecision]]:
    """Shrink lower-priority elastic jobs, then preempt lower-priority preemptible ones, until
    `job` fits once they release; nothing if even all of that would not be enough."""
    releasing = sum((max(j.holds, j.allotted) - j.allotted) * j.gpus_per_node
                    for j in running.values())
    deficit = job.need_gpus - free - releasing
    if deficit <= 0:
        return "", []  # enough is already on its way
    lower = sorted((j for j in running.values() if j.priority < job.priority and not j.preempting),
                   key=lambda j: (j.priority, -j.order, j.job_id))
    plan: list[SchedulingDecision] = []
    for j in lower:
        spare = j.allotted - j.min_nodes
        if deficit <= 0 or spare <= 0:
            continue
        cut = min(spare, -(-deficit // j.gpus_per_node))
        plan.append(SchedulingDecision(A.SHRINK, f"making room for {job.job_id} (priority "
                                       f"{job.priority} > {j.priority}): {j.allotted} -> "
                                       f"{j.allotted - cut} node(s)", j.job_id, j.allotted - cut))
        deficit -= cut * j.gpus_per_node
    for j in lower:
        if deficit <= 0:
            break
        if j.preemptible:
            shrunk = next((d.nodes for d in plan if d.job_id == j.job_id), j.allotted)
            plan = [d for d in plan if d.job_id != j.job_id]
            plan.append(SchedulingDecision(A.PREEMPT, f"making room for {job.job_id} (priority "
                                           f"{job.priority} > {j.priority}): stop at a "
                                           "checkpoint boundary and requeue", j.job_id, 0))
            deficit -= shrunk * j.gpus_per_node
    if deficit > 0:
        return "", []  # taking from others would not be enough: take nothing
    names = ", ".join(f"{d.action.value} {d.job_id}" for d in plan)
    return f"making room: {names}", plan


def _grow(running: list[JobView], free: int) -> list[SchedulingDecision]:
    """Free GPUs nobody queued waits for go to running jobs below their target."""
    out = []
    for j in sorted(running, key=JobView.key):
        if j.preempting or j.allotted >= j.target_nodes or free < j.gpus_per_node:
            continue
        nodes = min(j.target_nodes, j.allotted + free // j.gpus_per_node)
        free -= (nodes - j.allotted) * j.gpus_per_node
        out.append(SchedulingDecision(A.GROW, f"{(nodes - j.allotted) * j.gpus_per_node} GPU(s) "
                                      f"free: {j.allotted} -> {nodes} node(s) of target "
                                      f"{j.target_nodes}", j.job_id, nodes))
    return out
