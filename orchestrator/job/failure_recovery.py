"""The failure and recovery path of a job controller: RESTART and FAIL, RECOVERING, its REPLAN.

What it holds: the executors of the decisions that follow a failure. Recording the failure
(with a hang's evidence, gathered before anything is killed), the node-lost reports that
arrive through the inbox, the node probes RECOVERING waits on, the recovery facts each
`JobSnapshot` carries, and, at REPLAN, dropping the nodes the policy found lost.

Why separate from the controller: these steps share one record (`facts.Recovery`) and the
slots known lost, and nothing else of the controller's touches them; the controller keeps the
state machine (the loop, the transition table, the requests) and calls in here. Like every
executor, nothing here decides: `job_policy` names the suspects, the failure and what is lost.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

from tenax.orchestrator.job.diagnostics import hang_evidence
from tenax.orchestrator.job.facts import Recovery
from tenax.orchestrator.job.inbox import NodeLostReport
from tenax.orchestrator.job.job_policy import (PEER_LOSS_GRACE_S, JobDecision, JobSnapshot,
                                               NodeLossPolicy, own_error, peer_loss)
from tenax.orchestrator.placement.capacity import raylets_down
from tenax.orchestrator.placement.worker_group import WorkerGroup
from tenax.orchestrator.spec import JobSpec

logger = logging.getLogger(__name__)

__all__ = ["FailureRecovery", "Publish"]

Publish = Callable[..., None]  # the controller's `publish(event, **fields)`


class FailureRecovery:
    """A job's failure and recovery steps over its `Recovery` facts and the slots known lost.

    `facts` and `lost_slots` are the controller's own objects (it reads them too: progress
    accounting closes a recovery, placement records where the next start resumes from)."""

    def __init__(self, job_id: str, spec: JobSpec, facts: Recovery, lost_slots: dict[str, int],
                 publish: Publish) -> None:
        self.job_id, self.spec, self.publish = job_id, spec, publish
        self.facts, self.lost_slots = facts, lost_slots
        self._symptoms: frozenset[int] = frozenset()  # the peer-gone ranks last checked for
        self._down: tuple[str, ...] = ()  # ... and the job's nodes found down then

    def nodes_down(self, ranks: tuple[Any, ...]) -> tuple[str, ...]:
        """While ranks report only a peer gone (job_policy's PEER_LOSS grace, waiting for the
        rank or node that is gone to show), the job's nodes whose raylet refuses connections.
        A crashed node's agents never report (Ray takes ~14 s to declare them dead): found
        here, the grace need not run out first. Checked once per set of such ranks."""
        fresh = frozenset(r.rank for r in ranks if r.state == "failed" and peer_loss(r.error)
                          and r.step_age_s < PEER_LOSS_GRACE_S)
        if fresh and fresh != self._symptoms:
            self._down = tuple(sorted(raylets_down(tuple(sorted({r.node_id for r in ranks})))))
            if self._down:
                logger.warning("job %s: ranks %s lost a peer and node(s) %s refuse connections",
                               self.job_id, sorted(fresh), ", ".join(n[:8] for n in self._down))
        self._symptoms = fresh
        return self._down if fresh else ()

    def note_node_lost(self, report: NodeLostReport) -> None:
        """A node-lost report from the inbox: RECOVERING counts the block as lost."""
        logger.warning("job %s: node block %d reported lost: %s", self.job_id,
                       report.block, report.reason)
        self.facts.reported_lost.add(report.block)

    def probe(self, group: WorkerGroup | None, snapshot: Callable[[], JobSnapshot],
              wait_s: float) -> None:
        """RECOVERING's observation: probe the suspect nodes once, then collect answers."""
        probes = self.facts.probes
        if not probes.started:
            probes.start(NodeLossPolicy().suspects(snapshot()),
                         group.agents_by_node() if group else None)
        probes.collect(wait_s)

    def snapshot_facts(self) -> dict[str, Any]:
        """The `JobSnapshot` fields RECOVERING decides from: the failure, reports, probes."""
        rec = self.facts
        failure = rec.failure
        return dict(failed_ranks=failure.failed_ranks if failure else (),
                    known_lost=failure.lost_nodes if failure else (),
                    reported_lost=tuple(sorted(rec.reported_lost)), probed=rec.probes.nodes,
                    answered=tuple(rec.probes.answered), refused=tuple(rec.probes.refused),
                    failure_reason=failure.reason if failure else "",
                    previous_error=rec.last_error)

    def record_failure(self, decision: JobDecision, group: WorkerGroup | None,
                       step: int) -> None:
        """RESTART and FAIL: report the root cause; keep the facts RECOVERING decides from."""
        rec = self.facts
        rec.failure, rec.failed_at = decision, rec.failed_at or time.monotonic()
        rec.health = tuple(group.health()) if group is not None else ()
        rec.probes.reset()
        rec.last_error = own_error(decision, rec.health)
        if decision.failed_ranks:  # a hang's stacks first: before anything is killed
            decision, evidence = hang_evidence(group, self.spec, decision)
            rec.failure = decision  # a hang's stacks may single out another rank as the root
            self.publish("failure", step=step,
                         rank=decision.failed_ranks[0], ranks=list(decision.failed_ranks),
                         cause=decision.reason, kind=decision.cause_kind, **evidence)

    def drop_lost_nodes(self, decision: JobDecision, group: WorkerGroup | None) -> None:
        """REPLAN after RECOVERING: count the lost nodes' slots as gone, mark their blocks."""
        for node, slots in decision.lost_nodes:
            self.lost_slots[node] = self.lost_slots.get(node, 0) + slots
            logger.warning("job %s: node %s lost (%d slot(s))", self.job_id, node[:8], slots)
        if group is not None:  # by block: blocks may share a Ray node (one raylet)
            group.mark_blocks_lost(decision.lost_blocks)

    def reset(self) -> None:
        """The re-plan consumed the reports and the probes: the next failure starts afresh."""
        self.facts.reported_lost.clear()
        self.facts.probes.reset()
