"""Recovery benchmark: how fast a failure is detected and how fast training resumes.

    python -m bench.recovery_bench [--quick] [--hang] [--json PATH]

Why these ratios. Detection latency only means something relative to the timeout the user set
(`fault_tolerance.heartbeat_timeout_s`): a killed rank process should be seen long before it
(the actor reports the child's exit at the next heartbeat poll), a lost node within it (goal
<= 1.2 x the timeout for every case). Recovery only means something relative to
what a restart from scratch costs on the same machine, so the time from the fault to the first
resumed step is divided by the cold start of the SAME job in the SAME run (controller start,
placement, actor and process start-up, rendezvous, model build, to its first step; goal <= 0.5).

Cases, one after the other in one invocation:
- kill rank: local Ray, 1 node x 2 slots, `kill rank=R at=S` chaos (SIGKILL of the rank's
  training process); the fault time comes from the chaos ledger.
- lost node (freeze): cluster_utils, head + 2 GPU nodes x 2 slots; at a step the bench sends
  SIGSTOP to every process of the node hosting ranks 2-3 (raylet, rank actors, forkservers,
  training processes): a hung host or a network partition. No socket closes, so only missing
  heartbeats can tell. The fault time is the bench's clock.
- lost node (crash): the same, with SIGKILL and `Cluster.remove_node`: a crashed host whose
  kernel resets its connections, so the surviving ranks' collectives fail at once.
The cold start of each case is that case's own job, from controller start to its first step.

`--hang` runs one other case alone: local Ray, 1 node x 4 slots, `hang rank=1 at=S` (the rank's
training process stops stepping, alive), `hang_timeout_s` 6 s. It measures the hang evidence
the controller gathers before killing anything (every rank's stacks, orchestrator/job/
diagnostics.py): its seconds (the failure's `diagnostics_s`; goal <= 2 s for 4 ranks), that
share of hang -> recovered, and whether the failure names rank 1 (the stacks single it out).

In-memory snapshots are on (`checkpoint.memory_every_steps=1`, the default; storage checkpoints
every 5 steps), so every resume should come from `memory` (the surviving agents' own
snapshots) or `replica` (the next node's copy of a lost node's ranks) with at most 1 step
redone (goal <= 1 per failure); the source of each resume is reported. Goals: resume ÷ cold
start <= 0.5 for a killed rank and a crashed node; a frozen node cannot be told from a slow one
before `heartbeat_timeout_s`, so its goal is resume <= heartbeat_timeout_s + 0.5 × cold start
(reported as resume ÷ that budget, <= 1). After each job no snapshot directory of it may be
left in /dev/shm.
"""
from __future__ import annotations

import logging
import signal
import statistics
import sys
import tempfile
import time
from typing import Any

from tenax.testing.scripts import exit_unless_run_as_module

exit_unless_run_as_module(__spec__, __file__)  # a path run stops here, before `bench.`

from bench.common import Report, parse_args, ratio, snapshot_leftovers
from tenax.testing.clusters import local_ray, ray_cluster
from tenax.testing.jobs import JobRun, make_spec

logger = logging.getLogger(__name__)

TIMEOUT_S = 600.0


def analyse_faults(job: JobRun, fault_times: list[float]) -> list[dict[str, Any]]:
    """Per fault: detection latency, fault -> first resumed step, lost steps, detector kind."""
    out = []
    for tf in sorted(fault_times):
        failure = next((e for e in job.of("failure") if e["t"] >= tf), None)
        if failure is None:
            out.append({"fault_t": tf, "detected": False})
            continue
        recovered = next((e for e in job.of("recovered") if e["t"] >= failure["t"]), None)
        resumed = job.first_step_after(recovered["t"]) if recovered else None
        out.append({
            "fault_t": tf, "detected": True, "kind": failure.get("kind"),
            "cause": failure.get("cause"),
            "detection_s": failure["t"] - tf,
            "resume_s": (resumed["t"] - tf) if resumed else None,
            "controller_recovery_s": recovered.get("seconds") if recovered else None,
            "resumed_from_step": recovered.get("step") if recovered else None,
            "lost_steps": recovered.get("lost_steps") if recovered else None,
            "source": recovered.get("source") if recovered else None,
            "mode": _mode_after(job, failure["t"])})
    return out


def _mode_after(job: JobRun, t: float) -> str | None:
    placed = next((e for e in job.of("placed") if e["t"] >= t), None)
    return placed.get("mode") if placed else None


def cold_start_s(job: JobRun) -> float | None:
    first = job.first_step_after(job.started_at)
    return first["t"] - job.started_at if first else None


def kill_rank_case(root: str, quick: bool) -> dict[str, Any]:
    steps, kills = (25, [(1, 13)]) if quick else (50, [(1, 13), (0, 28), (1, 43)])
    chaos = "; ".join(f"kill rank={r} at={s}" for r, s in kills)
    with local_ray(gpus=2) as ray_info:
        spec = make_spec(root, [f"train.steps={steps}", "resources.nodes=1",
                                "resources.gpus_per_node=2"], "recovery-kill")
        job = JobRun(spec, chaos).run(TIMEOUT_S)
        fired = job.fired()
    faults = analyse_faults(job, list(fired.values()))
    return {"case": "kill rank", "state": job.state, "chaos": chaos, "steps": steps,
            "ray_init_s": ray_info["init_s"], "cold_start_s": cold_start_s(job),
            "cold_start": (job.of("done") or [{}])[-1].get("cold_start", {}),
            "heartbeat_timeout_s": spec.fault_tolerance.heartbeat_timeout_s,
            "heartbeat_interval_s": spec.fault_tolerance.heartbeat_interval_s,
            "restarts": job.controller.restarts, "faults": faults,
            "shm_left": snapshot_leftovers(job.controller.job_id)}


HANG_RANK = 1


def hang_case(root: str, quick: bool) -> dict[str, Any]:
    steps, at = (12, 6) if quick else (30, 12)
    chaos = f"hang rank={HANG_RANK} at={at}"
    with local_ray(gpus=4):
        spec = make_spec(root, [f"train.steps={steps}", "resources.nodes=1",
                                "resources.gpus_per_node=4", "fault_tolerance.hang_timeout_s=6"],
                         "recovery-hang")
        job = JobRun(spec, chaos).run(TIMEOUT_S)
        fired = list(job.fired().values())
    failure = (job.of("failure") or [{}])[0]
    recovered = next((e for e in job.of("recovered") if e["t"] >= failure.get("t", 0)), None)
    tf = min(fired) if fired else None
    return {"case": "hang", "state": job.state, "chaos": chaos, "steps": steps,
            "hang_timeout_s": spec.fault_tolerance.hang_timeout_s, "fault_t": tf,
            "failure": failure, "diagnostics_s": failure.get("diagnostics_s"),
            "failure_s": failure["t"] - tf if failure and tf else None,
            "recovered_s": recovered["t"] - tf if recovered and tf else None,
            "shm_left": snapshot_leftovers(job.controller.job_id)}


def add_hang_rows(report: Report, case: dict[str, Any]) -> None:
    evidence, recovered = case["diagnostics_s"], case["recovered_s"]
    report.add("hang: evidence (stacks of 4 ranks)", evidence, "<= 2", unit="s",
               note=f"the failure's diagnostics_s; job {case['state']}")
    report.add("hang: evidence ÷ (hang → recovered)", ratio(evidence, recovered),
               note=f"{evidence or 0:.2f} s of {recovered or 0:.2f} s")
    failure_s = case["failure_s"]
    detect = failure_s - evidence if failure_s is not None and evidence is not None else None
    report.add("hang: detection ÷ hang timeout", ratio(detect, case["hang_timeout_s"]),
               note=f"{detect or 0:.2f} s vs {case['hang_timeout_s']:.1f} s (context)")
    named = case["failure"].get("rank")
    report.add("hang: the failure names the hung rank", float(named == HANG_RANK), ">= 1",
               note=f"rank {named}: {str(case['failure'].get('cause'))[:160]}")


def _node_processes(node: Any) -> list[Any]:
    """The node's raylet and everything under it: rank actors, forkservers, training processes."""
    import psutil

    raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
    return [raylet] + raylet.children(recursive=True)


def _lose_node(cluster: Any, node: Any, procs: list[Any], how: str) -> float:
    """Take the node down; returns the fault time.

    freeze: SIGSTOP every process of the node (a hung host or a network partition: no socket is
    closed, peers see silence). crash: SIGKILL them all and remove the node (the kernel resets
    the node's connections, so peers see errors at once)."""
    import psutil

    t_fault = time.time()
    for proc in procs:
        try:
            proc.send_signal(signal.SIGSTOP if how == "freeze" else signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    if how == "crash":
        cluster.remove_node(node, allow_graceful=False)
    logger.info("%s node %s (%d processes)", how, node.node_id[:8], len(procs))
    return t_fault


def _bury(procs: list[Any]) -> None:
    """After a freeze: kill the stopped processes so the cluster can shut down."""
    import psutil

    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def node_loss_case(root: str, quick: bool, how: str) -> dict[str, Any]:
    steps, at = (25, 12) if quick else (40, 17)
    with ray_cluster(gpu_nodes=2) as (cluster, nodes):
        spec = make_spec(root, [f"train.steps={steps}", "resources.nodes=2",
                                "resources.gpus_per_node=2", "resources.min_nodes=1",
                                "resources.max_nodes=2", "fault_tolerance.max_restarts=3"],
                         f"recovery-node-{how}")
        job = JobRun(spec).start()
        job.wait_for(lambda: job.controller.step >= at, TIMEOUT_S, f"step {at}")
        victim = next(n for n in nodes if n.node_id == job.controller.group.ranks[2].node_id)
        procs = _node_processes(victim)
        t_fault = _lose_node(cluster, victim, procs, how)
        try:
            job.finish(TIMEOUT_S)
        finally:
            _bury(procs)
    faults = analyse_faults(job, [t_fault])
    return {"case": f"lost node ({how})", "state": job.state, "cause": job.controller.cause,
            "steps": steps, "fault_after_step": at, "cold_start_s": cold_start_s(job),
            "heartbeat_timeout_s": spec.fault_tolerance.heartbeat_timeout_s,
            "heartbeat_interval_s": spec.fault_tolerance.heartbeat_interval_s,
            "restarts": job.controller.restarts, "faults": faults,
            "world_after": (job.of("recovered") or [{}])[-1].get("world_size"),
            "shm_left": snapshot_leftovers(job.controller.job_id)}


def _mean(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def add_rows(report: Report, case: dict[str, Any], goal_detect: str) -> None:
    faults = [f for f in case["faults"] if f.get("detected")]
    name, timeout = case["case"], case["heartbeat_timeout_s"]
    detect = _mean([f["detection_s"] for f in faults])
    resume = _mean([f["resume_s"] for f in faults])
    kinds = ",".join(sorted({str(f["kind"]) for f in faults})) or "none"
    report.add(f"{name}: detection ÷ heartbeat timeout", ratio(detect, timeout), goal_detect,
               f"{detect or 0:.2f} s vs {timeout:.1f} s; detector: {kinds}")
    cold, modes = case["cold_start_s"], ",".join(str(f["mode"]) for f in faults)
    report.add(f"{name}: fault → resumed step ÷ cold start", ratio(resume, cold),
               "" if "freeze" in name else "<= 0.5",
               f"{resume or 0:.2f} s vs cold start {cold or 0:.2f} s; mode {modes}")
    if "freeze" in name:
        budget = timeout + 0.5 * cold if cold else None
        report.add(f"{name}: resume ÷ (heartbeat timeout + 0.5 × cold start)",
                   ratio(resume, budget), "<= 1",
                   f"{resume or 0:.2f} s vs {timeout:.1f} + 0.5 × {cold or 0:.2f} s")
    lost = [f["lost_steps"] for f in faults if f["lost_steps"] is not None]
    sources = ", ".join(f"{f['source']}@{f['resumed_from_step']}" for f in faults)
    report.add(f"{name}: lost steps per failure (worst)", max(lost) if lost else None, "<= 1",
               f"{lost} over {len(faults)} fault(s); resumed from {sources or 'nothing'}; "
               f"job {case['state']}")
    report.add(f"{name}: snapshot dirs left after the job", len(case["shm_left"]), "<= 0",
               ", ".join(case["shm_left"])[:200])


class Decisions(logging.Handler):
    """The controller's recovery-source decisions and fallbacks, kept for the JSON: a resume
    from storage where memory was expected must be explainable after the run."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.created:.3f} {record.getMessage()}")


def add_cold_start_rows(report: Report, since_launch: dict[str, float]) -> None:
    """The kill-rank job's cold start, phase by phase (the `done` event's `cold_start`). Its
    Ray was started by the bench, so the controller's construction is the launch."""
    from tenax.orchestrator.job.goodput_cold_start import durations

    for phase, seconds in durations(since_launch).items():
        report.add(f"kill rank: cold start, {phase}", seconds, unit="s", note="context")


def hang_main(quick: bool, json_path: str | None) -> int:
    report = Report("Recovery: hang evidence, measured beside the recovery it delays")
    with tempfile.TemporaryDirectory(prefix="tenax-recovery-") as root:
        case = hang_case(root, quick)
    add_hang_rows(report, case)
    report.context = {"quick": quick, "cases": [case]}
    report.finish(json_path)
    return 0 if case["state"] == "SUCCEEDED" else 1


def main() -> int:
    args = parse_args(__doc__, lambda parser: parser.add_argument(
        "--hang", action="store_true", help="only the hang case: its evidence's cost"))
    if args.hang:
        return hang_main(args.quick, args.json_path)
    report = Report("Recovery: detection and resume, measured side by side")
    decisions = Decisions()
    source_log = logging.getLogger("tenax.orchestrator.placement.recovery")
    source_log.addHandler(decisions)
    source_log.setLevel(logging.INFO)
    with tempfile.TemporaryDirectory(prefix="tenax-recovery-") as root:
        cases = [kill_rank_case(root, args.quick)] + \
            [node_loss_case(root, args.quick, how) for how in ("freeze", "crash")]
    for case in cases:
        add_rows(report, case, "<= 1.2")
    kill = cases[0]
    report.add("kill rank: Ray start (context)", kill["ray_init_s"], unit="s",
               note="embedded ray.init, what `tenax run` adds before the controller starts")
    add_cold_start_rows(report, kill["cold_start"])
    report.context = {"quick": args.quick, "cases": cases, "recovery_decisions": decisions.lines}
    report.finish(args.json_path)
    return 0 if all(c["state"] == "SUCCEEDED" for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
