"""Pure decisions: given one immutable snapshot of the job, say what to do and why.

The controller gathers facts (rank health, node probe answers, restarts, capacity, requests
from the inbox) into a `JobSnapshot`, asks `decide`, and only executes the `JobDecision` it gets
back: a `JobAction` and its reason, plus the facts its executor needs. Keeping the decisions
pure makes every one of them table-testable without Ray and keeps every reason in one place,
where it is logged. `max_restarts` is read here and nowhere else. (The service's scheduler has
the same shape: `SchedulingAction`, `SchedulingDecision`, `decide(snapshot)`.)

Timeouts come from the job's `Timeouts` (`tenax.orchestrator.timeouts`) in `Limits`:
`heartbeat_timeout_s` (no answer to heartbeats: the process or node is gone), `hang_timeout_s`
(answers, but its step does not advance). A rank still starting (building the model, loading a
checkpoint) gets `startup_s` (twice `hang_timeout_s`) before it counts as stuck, because loading
a large checkpoint legitimately takes longer than a step.

Rank end states: `done` (reached train.steps), `stopped` (committed a requested boundary
checkpoint and exited), `failed` (an error or its process died), gone (`dead` actor or silent
heartbeat). Every state's policy handles each of them, so no state waits for a report that
can no longer come.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from tenax.orchestrator.timeouts import STARTUP_HANG_FACTOR, Timeouts

if TYPE_CHECKING:
    from tenax.orchestrator.job.health import StragglerFlag
    from tenax.orchestrator.placement.rank_handle import RankHealth

logger = logging.getLogger(__name__)

ENDED = ("done", "stopped")
# A collective's error that says a peer went away: a symptom, whose root cause (a dead rank,
# a lost node) its own agent reports a moment later (a loaded host schedules that agent later).
PEER_LOSS = ("connection closed by peer", "connection reset by peer", "broken pipe",
             "remote process exited", "communicator was aborted")
PEER_LOSS_GRACE_S = 1.0  # how long such a symptom alone waits for its root cause to show


class JobAction(str, Enum):
    """What the controller does next; `states.TRANSITIONS` says which state each one leads to."""
    SUBMIT = "submit"
    START = "start"
    CONTINUE = "continue"
    SUCCEED = "succeed"
    RESTART = "restart"
    FAIL = "fail"
    RESCALE = "rescale"
    REPLAN = "replan"
    CANCEL = "cancel"


@dataclass(frozen=True)
class Limits:
    """The spec fields the policies decide with (built once per job by `from_spec`)."""
    max_restarts: int
    gpus_per_node: int
    min_nodes: int = 1
    max_nodes: int = 1
    timeouts: Timeouts = Timeouts()

    @classmethod
    def from_spec(cls, spec: Any) -> "Limits":
        r = spec.resources
        return cls(spec.fault_tolerance.max_restarts, r.gpus_per_node, r.min_nodes, r.max_nodes,
                   Timeouts.from_spec(spec))


@dataclass(frozen=True)
class JobSnapshot:
    """Everything a decision may depend on, taken at one moment by the controller."""
    ranks: tuple["RankHealth", ...]
    restarts: int
    limits: Limits
    state: str = "RUNNING"
    state_age_s: float = 0.0
    state_deadline_s: float = float("inf")
    cancel_requested: bool = False
    stragglers: tuple["StragglerFlag", ...] = ()  # raised by the latest window
    capacity_nodes: int = 0
    current_nodes: int = 0
    target_nodes: int = 0
    failed_ranks: tuple[int, ...] = ()  # of the failure being recovered
    known_lost: tuple[tuple[str, int], ...] = ()  # (node, slots) the failure already names
    reported_lost: tuple[int, ...] = ()  # node blocks reported lost (inbox: scheduler, drills)
    probed: tuple[str, ...] = ()  # nodes being probed
    answered: tuple[str, ...] = ()  # nodes whose probe ran
    refused: tuple[str, ...] = ()  # nodes whose probe could not run (unreachable)
    failure_reason: str = ""
    previous_error: tuple[int, str] | None = None  # (step, error) of the previous failure
    nodes_down: tuple[str, ...] = ()  # RUNNING: job nodes whose raylet refuses connections


@dataclass(frozen=True)
class JobDecision:
    action: JobAction
    reason: str
    failed_ranks: tuple[int, ...] = ()  # the root-cause rank first
    cause_kind: str = ""  # dead | heartbeat | hang | error | straggler | placement | rescale
    lost_nodes: tuple[tuple[str, int], ...] = ()  # (Ray node id, slots) to treat as gone
    probe: tuple[str, ...] = ()  # RECOVERING: nodes to probe before deciding what is lost
    # REPLAN: the node blocks (placement order) that are gone. Several blocks may share one Ray
    # node (one raylet simulating many nodes): only these lose their agents and snapshots.
    lost_blocks: tuple[int, ...] = ()


def restart_or_fail(reason: str, restarts: int, limits: Limits, failed: tuple[int, ...] = (),
                    kind: str = "error", lost: tuple[tuple[str, int], ...] = ()) -> JobDecision:
    """The one place `max_restarts` is read: a failure restarts the job until it is spent."""
    if restarts >= limits.max_restarts:
        return JobDecision(JobAction.FAIL,
                           f"{reason}; max_restarts={limits.max_restarts} exhausted",
                           failed, kind, lost)
    return JobDecision(JobAction.RESTART, reason, failed, kind, lost)


def rank_problem(r: "RankHealth", limits: Limits,
                 stopped_ok: bool = False) -> tuple[int, int, str, str] | None:
    """(priority, rank, kind, reason) of one rank's failure; lower priority = closer to root."""
    if r.dead:
        return 0, r.rank, "dead", f"rank {r.rank} died ({r.dead})"
    t = limits.timeouts
    if r.heartbeat_age_s > t.heartbeat_timeout_s:
        return 1, r.rank, "heartbeat", (f"rank {r.rank} missed heartbeats for "
                                        f"{r.heartbeat_age_s:.1f} s "
                                        f"(heartbeat_timeout_s={t.heartbeat_timeout_s})")
    if r.state == "failed" and (r.error or "").startswith("rank process"):
        # The process itself died (signal, exit code): a root cause, unlike its peers' errors.
        return 0, r.rank, "dead", f"rank {r.rank} died: {r.error}"
    if r.state == "failed":  # a peer-gone symptom names its rank after any rank's own error
        return 4 if peer_loss(r.error) else 3, r.rank, "error", f"rank {r.rank} failed: {r.error}"
    if r.state == "stopped" and not stopped_ok:
        return 3, r.rank, "error", f"rank {r.rank} stopped although no stop was requested"
    limit = t.startup_s if r.state == "starting" else t.hang_timeout_s
    if r.state in ("training", "starting") and r.step_age_s > limit:
        what = "step" if r.state == "training" else "start-up"
        return 2, r.rank, "hang", (f"rank {r.rank} hung: {what} did not advance for "
                                   f"{r.step_age_s:.1f} s "
                                   f"(limit {limit:.0f} s from hang_timeout_s={t.hang_timeout_s})")
    return None


def own_error(decision: JobDecision, ranks: tuple["RankHealth", ...]) -> tuple[int, str] | None:
    """(step, error) of a failure whose root is an exception the rank raised itself (not a
    death, hang or silence, nor a peer-gone symptom); None for any other failure."""
    if decision.cause_kind != "error" or not decision.failed_ranks:
        return None
    root = next((r for r in ranks if r.rank == decision.failed_ranks[0]), None)
    if root is None or root.state != "failed" or not root.error or peer_loss(root.error):
        return None
    return root.step, root.error


def replayed_error(snap: JobSnapshot, decision: JobDecision) -> JobDecision:
    """A rank's own error again, word for word at the same step as the previous failure's:
    bad data or a bad config that every restart would replay (each one redoing the steps
    since the checkpoint), so the job fails now instead of spending max_restarts on it."""
    error = own_error(decision, snap.ranks)
    if decision.action != JobAction.RESTART or error is None or error != snap.previous_error:
        return decision
    return JobDecision(JobAction.FAIL, f"{decision.reason}; the previous attempt failed with the "
                       f"same error after step {error[0]}, so a restart would replay it (not "
                       f"restarted, {snap.limits.max_restarts - snap.restarts} of "
                       f"max_restarts={snap.limits.max_restarts} left)",
                       decision.failed_ranks, decision.cause_kind, decision.lost_nodes)


def peer_loss(error: str | None) -> bool:
    """An error that reports a collective's peer gone rather than a fault of this rank."""
    text = (error or "").lower()
    return any(words in text for words in PEER_LOSS)


def only_fresh_symptoms(snap: JobSnapshot, ranks: set[int]) -> bool:
    """Every failing rank reports a peer gone, for less than PEER_LOSS_GRACE_S: the rank or
    node that is gone has not shown yet, and blaming these would name the wrong rank."""
    failing = [r for r in snap.ranks if r.rank in ranks]
    return not snap.nodes_down and all(  # a node found down is what is gone: no need to wait
        r.state == "failed" and peer_loss(r.error) and r.step_age_s < PEER_LOSS_GRACE_S
        for r in failing)


def _stalled(snap: JobSnapshot) -> list[int]:
    """Ranks whose step has not advanced for half their hang limit. The ranks of a hang stall
    together but cross the limit a heartbeat poll apart: naming only the first to cross would
    blame whichever rank's last reply came first."""
    t = snap.limits.timeouts
    return [r.rank for r in snap.ranks if r.state in ("training", "starting") and not r.dead
            and r.step_age_s > (t.startup_s if r.state == "starting" else t.hang_timeout_s) / 2]


def _failure(snap: JobSnapshot, stopped_ok: bool) -> JobDecision | None:
    found = (rank_problem(r, snap.limits, stopped_ok) for r in snap.ranks)
    problems = sorted(p for p in found if p)
    if not problems or only_fresh_symptoms(snap, {p[1] for p in problems}):
        return None
    _, root_rank, kind, root = problems[0]
    hung = sorted({p[1] for p in problems if p[2] == "hang"} | set(_stalled(snap)))
    if kind == "hang" and len(hung) > 1:
        # In a hang every rank stops stepping: the heartbeats cannot tell which one hung, so
        # the reason names them all (the stacks can tell: orchestrator/job/diagnostics.py).
        root = f"ranks {', '.join(map(str, hung))} hung: " + root.partition(" hung: ")[2]
    # peers of a dead rank fail too; report the root cause first
    failed = (root_rank,) + tuple(sorted({p[1] for p in problems} - {root_rank}))
    return replayed_error(snap, restart_or_fail(root, snap.restarts, snap.limits, failed, kind))


class FailurePolicy:
    """Continue, succeed, restart (within max_restarts) or fail, from rank health alone."""

    def make_decision(self, snap: JobSnapshot) -> JobDecision:
        if snap.ranks and all(r.state == "done" for r in snap.ranks):
            return JobDecision(JobAction.SUCCEED, "every rank reached train.steps")
        healthy = JobDecision(JobAction.CONTINUE, "all ranks healthy")
        return _failure(snap, stopped_ok=False) or healthy


class RescalePolicy:
    """RESCALING: every rank must end (stopped at the boundary, or done) within the deadline."""

    def make_decision(self, snap: JobSnapshot) -> JobDecision:
        if snap.ranks and all(r.state == "done" for r in snap.ranks):
            return JobDecision(JobAction.SUCCEED, "every rank reached train.steps before the stop")
        if snap.ranks and all(r.state in ENDED and not r.dead for r in snap.ranks):
            stopped = [r.step for r in snap.ranks if r.state == "stopped"]
            return JobDecision(JobAction.REPLAN, f"all ranks stopped at step {max(stopped)}")
        failure = _failure(snap, stopped_ok=True)
        if failure is not None:
            return failure
        if snap.state_age_s > snap.state_deadline_s:
            waiting = [r.rank for r in snap.ranks if r.state not in ENDED]
            return restart_or_fail(f"ranks {waiting} did not commit the boundary checkpoint and "
                                   f"stop within {snap.state_deadline_s:.0f} s "
                                   f"({STARTUP_HANG_FACTOR:g} x hang_timeout_s)",
                                   snap.restarts, snap.limits, tuple(waiting), "rescale")
        return JobDecision(JobAction.CONTINUE, "waiting for the ranks to stop at a step boundary")


class EvictionPolicy:
    """`straggler_action: evict`: restart without the straggler's node-sized block of ranks
    (placement packs ranks [k*g, (k+1)*g) on one node), unless that would stop the job."""

    def make_decision(self, snap: JobSnapshot) -> JobDecision | None:
        flag = next((f for f in snap.stragglers if f.action == "evict"), None)
        if flag is None:
            return None
        g, nodes = snap.limits.gpus_per_node, [r.node_id for r in snap.ranks]
        block = flag.rank // g
        peers = range(block * g, min((block + 1) * g, len(nodes)))
        ranks = (flag.rank,) + tuple(r for r in peers if r != flag.rank)
        node = nodes[flag.rank]
        reason = (f"rank {flag.rank} is a straggler (score {flag.score:.2f}): "
                  f"evicting its node {node[:8]}")
        lim = snap.limits
        if snap.restarts >= lim.max_restarts or snap.capacity_nodes - 1 < lim.min_nodes:
            logger.warning("not evicting: %s; no restart or node to spare", reason)
            return None
        return JobDecision(JobAction.RESTART, reason, ranks, "straggler", ((node, len(ranks)),))


def _blocks(snap: JobSnapshot) -> list[tuple[int, list["RankHealth"]]]:
    g = snap.limits.gpus_per_node
    return [(k, list(snap.ranks[k * g:(k + 1) * g])) for k in range(-(-len(snap.ranks) // g))]


class NodeLossPolicy:
    """RECOVERING: which node blocks are gone. A block is lost when the failure named it
    (eviction), when it was reported lost (inbox), when every rank of it has been silent for a
    whole heartbeat timeout, when its node's probe was refused (its raylet is down), or when
    every rank of it failed and its node did not answer a probe within the state's deadline.
    Every node of the group is probed, all at once, never in turn: when a node crashes, the
    first failures seen are often the survivors' collective errors, while the crashed node's
    own ranks have not been seen failing yet (a live node's agents answer in milliseconds)."""

    def suspects(self, snap: JobSnapshot) -> tuple[str, ...]:
        out = [block[0].node_id for k, block in _blocks(snap)
               if block and not self._certain(snap, k, block)]
        return tuple(dict.fromkeys(out))

    def _certain(self, snap: JobSnapshot, k: int, block: list["RankHealth"]) -> bool:
        return k in snap.reported_lost or self._silent(snap, block) or \
            any(node == block[0].node_id for node, _ in snap.known_lost)

    @staticmethod
    def _silent(snap: JobSnapshot, block: list["RankHealth"]) -> bool:
        """Every rank of the block silent for a whole heartbeat timeout. The ranks of a node
        frozen at one moment can cross the timeout a poll apart (their last replies came in
        different polls), so the failure may name only some of them; RECOVERING polls no
        heartbeats, so for a block already quiet at the failure (every rank past half the
        timeout) the time since counts too, while its node answers no probe."""
        limit = snap.limits.timeouts.heartbeat_timeout_s
        ages = [r.heartbeat_age_s for r in block]
        if all(a > limit for a in ages):
            return True
        if snap.state != "RECOVERING" or block[0].node_id in snap.answered:
            return False
        return all(a > limit / 2 and a + snap.state_age_s > limit for a in ages)

    def make_decision(self, snap: JobSnapshot) -> JobDecision:
        certain = {block[0].node_id for k, block in _blocks(snap)
                   if block and self._certain(snap, k, block)}
        pending = set(snap.probed) - set(snap.answered) - set(snap.refused)
        if pending - certain and snap.state_age_s <= snap.state_deadline_s:
            return JobDecision(JobAction.CONTINUE,
                               f"waiting for {len(pending - certain)} node probe(s)")
        every = _blocks(snap)
        blocks = tuple(k for k, block in every if self._lost(snap, k, block, pending))
        known, lost = dict(snap.known_lost), dict(snap.known_lost)
        for k in blocks:
            node = every[k][1][0].node_id
            if node not in known:  # an eviction's failure already counted its slots
                lost[node] = lost.get(node, 0) + len(every[k][1])
        gone = "; ".join(f"node {n[:8]} lost ({s} slot(s))" for n, s in lost.items())
        reason = (f"restart {snap.restarts + 1}/{snap.limits.max_restarts} after: "
                  f"{snap.failure_reason}")
        return JobDecision(JobAction.REPLAN, reason + (f"; {gone}" if gone else ""),
                           snap.failed_ranks, lost_nodes=tuple(lost.items()), lost_blocks=blocks)

    def _lost(self, snap: JobSnapshot, k: int, block: list["RankHealth"],
              pending: set[str]) -> bool:
        """Block k is gone. Decided per block, not per Ray node: blocks that share a node (one
        raylet simulating several) are lost one by one, as separate nodes would be; a refused
        probe (the raylet itself is down) takes every block on it."""
        if not block:
            return False
        failed = set(snap.failed_ranks)
        whole = all(r.rank in failed or r.dead for r in block)
        node = block[0].node_id
        return self._certain(snap, k, block) or node in snap.refused or \
            (whole and node in pending)


def wants_rescale(snap: JobSnapshot) -> JobDecision:
    """RESCALE when a running job should re-plan now: the target moved, or nodes joined that
    bring it closer to the target. (Nodes that leave show up as failed ranks instead.)"""
    lim = snap.limits
    want = min(max(snap.target_nodes, lim.min_nodes), lim.max_nodes)
    reachable = min(want, snap.capacity_nodes)
    if reachable == snap.current_nodes or snap.capacity_nodes <= 0:
        return JobDecision(JobAction.CONTINUE, "at the reachable target")
    if reachable < snap.current_nodes:
        return JobDecision(JobAction.RESCALE, f"target {want} node(s): shrinking from "
                           f"{snap.current_nodes} to {reachable}")
    return JobDecision(JobAction.RESCALE, f"target {want} node(s), {snap.capacity_nodes} "
                       f"available: growing from {snap.current_nodes} to {reachable}")


def decide(snap: JobSnapshot) -> JobDecision:
    """The decision for the snapshot's state (PLACING's comes from placing: see controller)."""
    if snap.cancel_requested:
        return JobDecision(JobAction.CANCEL, "cancel requested")
    if snap.state == "PENDING":
        return JobDecision(JobAction.SUBMIT, f"submitted: target {snap.target_nodes} node(s) x "
                           f"{snap.limits.gpus_per_node} GPUs")
    if snap.state == "RESCALING":
        return RescalePolicy().make_decision(snap)
    if snap.state == "RECOVERING":
        return NodeLossPolicy().make_decision(snap)
    decision = FailurePolicy().make_decision(snap)
    if decision.action == JobAction.CONTINUE:
        decision = EvictionPolicy().make_decision(snap) or decision
    if decision.action == JobAction.CONTINUE and snap.capacity_nodes:
        want = wants_rescale(snap)
        if want.action == JobAction.RESCALE:
            return JobDecision(JobAction.RESCALE, want.reason + "; checkpointing at the next step")
    return decision
