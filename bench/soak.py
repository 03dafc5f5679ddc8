"""Chaos soak: many random faults in one run, and proof that no committed work was lost.

    python -m bench.soak [--quick] [--json PATH] [--seed N] [--seeds 3] [--faults N]

Why: each recovery path is tested on its own elsewhere; a long job meets them back to back —
a kill during the restart after a hang, a corrupted newest checkpoint right before a node
loss, a scale-down while a rank is slow. The soak draws >= 20 faults of every kind from a
seeded RNG (reproducible: the seed is printed and stored) and runs them through one job on a
local Ray with two logical nodes, then checks what a user relies on:
- the job SUCCEEDED with the clean run's losses (every step, final loss within 1e-5 rel);
- restarts == unplanned faults that fired (kill rank, kill node, hang; nothing else restarts);
- every resume loaded a committed, intact checkpoint (the catalog is checked the moment the
  ranks report `started`), and never an older one than the newest intact committed version
  known before the failure (zero lost committed steps; a version the drill corrupted is not
  intact, so falling back past it is correct);
- checkpoint steps only go backwards through a recovery to a committed step.

On embedded Ray every rank runs on one Ray node, so `kill node=0` uses the node-block
semantics: the block's ranks die and the controller retires that block's GPU slots for good
(the bench gives Ray spare slots so capacity stays at max_nodes). `hang_timeout_s` is small so
hangs are detected in seconds. The clean run uses the same spec in the same Ray session.
The bench runs 3 seeds by default (seed, seed+1, seed+2; `--quick`: 1 seed of 8 faults); it
passes only if every seed does.
"""
from __future__ import annotations

import logging
import random
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

from tenax.testing.scripts import exit_unless_run_as_module

exit_unless_run_as_module(__spec__, __file__)  # a path run stops here, before `bench.`

from bench.common import Report, parse_args, write_json
from tenax.testing.clusters import local_ray
from tenax.testing.jobs import JobRun, make_spec, mismatched_steps

logger = logging.getLogger(__name__)

KINDS = ("kill-rank", "kill-node", "hang", "slow", "scale", "corrupt-checkpoint")
UNPLANNED = ("kill-rank", "kill-node", "hang")


@dataclass
class SoakConfig:
    n_faults: int = 21
    steps: int = 0  # 0: 3 steps per fault + 12
    seed: int = 0
    gpus_per_node: int = 2
    nodes: int = 2
    hang_timeout_s: float = 12.0  # also bounds placement and start-up: keep room for a busy host
    every_steps: int = 5
    keep_last: int = 3
    timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        self.steps = self.steps or 3 * self.n_faults + 12


@dataclass(frozen=True)
class Fault:
    at: int
    kind: str
    chaos: str


def draw_faults(cfg: SoakConfig) -> list[Fault]:
    """Every kind at least once, the rest drawn at random; distinct even steps (one fault per
    attempt); targets that exist in every layout the job can take (ranks of node 0)."""
    rng = random.Random(cfg.seed)
    kinds = list(KINDS) + [rng.choice(KINDS) for _ in range(cfg.n_faults - len(KINDS))]
    rng.shuffle(kinds)
    slots = range(4, cfg.steps, 2)
    if len(slots) < len(kinds):
        raise ValueError(f"{cfg.steps} steps leave room for {len(slots)} faults, not {len(kinds)}")
    faults, target = [], cfg.nodes
    for at, kind in zip(sorted(rng.sample(slots, len(kinds))), kinds):
        rank = rng.randrange(cfg.gpus_per_node)
        if kind == "scale":
            target = 1 if target == cfg.nodes else cfg.nodes
        chaos = {"kill-rank": f"kill rank={rank}", "kill-node": "kill node=0",
                 "hang": f"hang rank={rank}",
                 "slow": f"slow rank={rank} factor={rng.choice([1.5, 2.0, 3.0])}",
                 "scale": f"scale nodes={target}", "corrupt-checkpoint": "corrupt-checkpoint"}[kind]
        faults.append(Fault(at, kind, f"{chaos} at={at}"))
    return faults


def _spec(root: str, cfg: SoakConfig, name: str, n_unplanned: int) -> Any:
    return make_spec(root, [
        f"train.steps={cfg.steps}", f"resources.nodes={cfg.nodes}", "resources.min_nodes=1",
        f"resources.max_nodes={cfg.nodes}", f"resources.gpus_per_node={cfg.gpus_per_node}",
        f"fault_tolerance.hang_timeout_s={cfg.hang_timeout_s}",
        f"fault_tolerance.max_restarts={n_unplanned + 5}",
        f"checkpoint.every_steps={cfg.every_steps}", f"checkpoint.keep_last={cfg.keep_last}"], name)


class ResumeAudit:
    """Controller observer: when ranks report `started` from a checkpoint, check on storage
    right away that the version is committed and intact (the loader protects it from
    retention while it runs, so the check cannot race a deletion)."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.resumes: list[dict[str, Any]] = []

    def __call__(self, _: Any, records: list[dict[str, Any]]) -> None:
        from tenax.checkpoint.format.catalog import Catalog
        from tenax.checkpoint.format.storage import Storage

        for r in records:
            if r.get("event") != "started" or r.get("rank") != 0 or r.get("resumed_from") is None:
                continue
            step = r["resumed_from"]
            if r.get("source") == "memory":  # an assembled snapshot, verified as it loaded
                self.resumes.append({"step": step, "t": time.time(), "committed": True,
                                     "problems": [], "source": "memory"})
                continue
            catalog = Catalog(Storage(self.uri))
            committed = step in catalog.committed_steps()
            problems = catalog.verify(step) if committed else ["no manifest"]
            self.resumes.append({"step": step, "t": time.time(), "committed": committed,
                                 "problems": problems, "source": "storage"})


def fired_faults(job: JobRun) -> list[str]:
    """Chaos event ids that fired: rank-side ones from the ledger (one key per rank; a node
    kill fires on each of its ranks), controller-side ones (scale, corrupt)."""
    ids = {key.rsplit(":", 1)[0] for key in job.fired()}
    ids |= {i for i in job.controller.controller_chaos_fired if not i.startswith("kill:")}
    return sorted(ids)


def _kind_of(event_id: str) -> str:
    kind = event_id.split(":")[0]
    return f"kill-{'node' if ':node=' in event_id else 'rank'}" if kind == "kill" else kind


def lost_committed_steps(job: JobRun, keep_last: int) -> list[dict[str, Any]]:
    """Per recovery: the newest intact committed step known before the failure (within what
    retention keeps) vs the step resumed from.

    A version the drill corrupted is not intact until it is committed AGAIN, and a re-commit
    of step S needs a rollback below S first (recovery or rescale): the drill damages what is
    on storage, and the `checkpoint` event of that very commit may reach the controller only
    after the `chaos` event. Counting such a late event as a re-commit would call the correct
    fallback past the damaged version a loss.
    """
    out, intact, commits, last_failure = [], set(), [], None
    corrupted: set[int] = set()  # damaged by the drill, not re-committed since
    recommittable: set[int] = set()  # corrupted steps the job has since rolled back below
    for e in job.events:
        kind = e.get("event")
        if kind == "checkpoint":
            step = e["step"]
            commits.append(step)
            if step not in corrupted or step in recommittable:
                intact.add(step)
                corrupted.discard(step)
                recommittable.discard(step)
        elif kind == "chaos" and e.get("kind") == "corrupt-checkpoint":
            match = re.search(r"step-0*(\d+)", str(e.get("detail", "")))
            if match:
                intact.discard(int(match.group(1)))
                corrupted.add(int(match.group(1)))
                recommittable.discard(int(match.group(1)))
        elif kind in ("recovered", "scaled"):
            recommittable |= {s for s in corrupted if s > e["step"]}
        if kind == "failure":
            last_failure = e
        elif kind == "recovered" and last_failure is not None:
            window = sorted(set(commits))[-keep_last:]
            candidates = [s for s in window if s in intact]
            expected = max(candidates) if candidates else 0
            out.append({"failure_step": last_failure["step"], "expected": expected,
                        "resumed": e["step"], "lost": max(0, expected - e["step"])})
            last_failure = None
    return out


def checkpoint_order_violations(job: JobRun) -> list[str]:
    """A checkpoint step must exceed the previous one unless a recovery or rescale resumed
    in between (then it must exceed the step resumed from)."""
    bad, floor = [], 0
    for e in job.events:
        kind = e.get("event")
        if kind in ("recovered", "scaled"):
            floor = e["step"]
        elif kind == "checkpoint":
            if e["step"] <= floor:
                bad.append(f"checkpoint step {e['step']} after step {floor}")
            floor = e["step"]
    return bad


def run_soak(cfg: SoakConfig, root: str) -> dict[str, Any]:
    """Clean run and chaos run of the same job in one local Ray; returns facts and checks."""
    faults = draw_faults(cfg)
    n_unplanned = sum(f.kind in UNPLANNED for f in faults)
    n_node_kills = sum(f.kind == "kill-node" for f in faults)
    chaos = "; ".join(f.chaos for f in faults)
    # Each node-block kill retires gpus_per_node slots for good: spare slots keep max_nodes.
    with local_ray(gpus=cfg.gpus_per_node * (cfg.nodes + n_node_kills), cpus=8):
        clean = JobRun(_spec(root, cfg, "soak-clean", n_unplanned)).run(cfg.timeout_s)
        spec = _spec(root, cfg, "soak", n_unplanned)
        job = JobRun(spec, chaos)
        audit = ResumeAudit(spec.checkpoint.uri)
        job.controller.add_observer(audit)
        job.run(cfg.timeout_s)
        fired = fired_faults(job)
    return {"config": asdict(cfg), "faults": [asdict(f) for f in faults], "chaos": chaos,
            "fired": fired, "clean": clean, "job": job, "audit": audit.resumes}


def checks(result: dict[str, Any]) -> dict[str, Any]:
    """Every property the soak promises, as plain data (tests assert on it)."""
    job, clean, cfg = result["job"], result["clean"], result["config"]
    fired_kinds = [_kind_of(i) for i in result["fired"]]
    got, want = job.losses(), clean.losses()
    mismatched = mismatched_steps(got, want)
    final, final_clean = got.get(cfg["steps"]), want.get(cfg["steps"])
    recoveries = lost_committed_steps(job, cfg["keep_last"])
    return {
        "state": job.state, "clean_state": clean.state, "cause": job.controller.cause,
        "faults_drawn": len(result["faults"]), "faults_fired": len(result["fired"]),
        "fired_by_kind": {k: fired_kinds.count(k) for k in KINDS},
        "unplanned_fired": sum(k in UNPLANNED for k in fired_kinds),
        "restarts": job.controller.restarts,
        # no rank failed: placing and starting ran past its bound (2 x hang_timeout_s), which a
        # loaded host causes; counted so an extra restart is explained, not excused
        "placement_restarts": sum(1 for e in job.of("state") if e.get("state") == "RECOVERING"
                                  and str(e.get("reason", "")).startswith("placement failed")),
        "lost_committed_steps": sum(r["lost"] for r in recoveries), "recoveries": recoveries,
        "redone_steps": job.controller.lost_steps,
        "scaled_lost_steps": sum(e.get("lost_steps", 0) for e in job.of("scaled")),
        "resumes_audited": len(result["audit"]),
        "resumes_expected": sum(e["step"] > 0 for e in job.of("recovered") + job.of("scaled")),
        "resumes_not_committed": [a for a in result["audit"]
                                  if not a["committed"] or a["problems"]],
        "checkpoint_order_violations": checkpoint_order_violations(job),
        "final_loss": final, "clean_final_loss": final_clean,
        "loss_mismatched_steps": mismatched,
        "wall_s": job.finished_at - job.started_at,
        "clean_wall_s": clean.finished_at - clean.started_at}


def passed(c: dict[str, Any]) -> bool:
    return (c["state"] == c["clean_state"] == "SUCCEEDED" and c["faults_fired"] == c["faults_drawn"]
            and c["restarts"] == c["unplanned_fired"] and c["lost_committed_steps"] == 0
            and c["scaled_lost_steps"] == 0 and not c["resumes_not_committed"]
            and c["resumes_audited"] == c["resumes_expected"]
            and not c["checkpoint_order_violations"] and not c["loss_mismatched_steps"]
            and c["final_loss"] is not None and c["final_loss"] == c["final_loss"])


def report(c: dict[str, Any], cfg: SoakConfig) -> Report:
    rep = Report(f"Chaos soak: {c['faults_fired']} faults in one run (seed {cfg.seed})")
    rep.add("faults fired", c["faults_fired"], f">= {min(20, c['faults_drawn'])}",
            ", ".join(f"{k} {n}" for k, n in c["fired_by_kind"].items()))
    rep.add("restarts − unplanned faults fired", c["restarts"] - c["unplanned_fired"], "== 0",
            f"{c['restarts']} restarts ({c['placement_restarts']} after placement timeouts), "
            f"{c['unplanned_fired']} kill/hang faults")
    rep.add("lost committed steps", c["lost_committed_steps"], "== 0",
            f"{len(c['recoveries'])} recoveries; {c['redone_steps']} uncommitted steps redone")
    rep.add("steps lost by planned scale events", c["scaled_lost_steps"], "== 0")
    rep.add("resumes from a non-committed/damaged version", len(c["resumes_not_committed"]),
            "== 0", f"{c['resumes_audited']} of {c['resumes_expected']} resumes audited on storage")
    rep.add("checkpoint steps going backwards", len(c["checkpoint_order_violations"]), "== 0",
            "except through a recovery to a committed step")
    ratio_ = (c["final_loss"] / c["clean_final_loss"]
              if c["final_loss"] and c["clean_final_loss"] else None)
    rep.add("final loss ÷ clean run's", ratio_, "== 1 ±1e-5",
            f"{len(c['loss_mismatched_steps'])} step(s) differ; job {c['state']}")
    rep.add("wall time, chaos run", c["wall_s"], unit="s",
            note=f"clean run {c['clean_wall_s']:.1f} s, {cfg.steps} steps")
    return rep


def soak_one(cfg: SoakConfig, quick: bool) -> tuple[Report, bool]:
    """One seed's soak: its report (context holds everything to reproduce it) and verdict."""
    with tempfile.TemporaryDirectory(prefix="tenax-soak-") as root:
        result = run_soak(cfg, root)
    c = checks(result)
    rep = report(c, cfg)
    rep.context = {"quick": quick, "config": result["config"], "chaos": result["chaos"],
                   "faults": result["faults"], "fired": result["fired"], "audit": result["audit"],
                   "checks": c,
                   "events": [e for e in result["job"].events if e.get("event") != "step"]}
    return rep, passed(c)


def main() -> int:
    def extra(parser: Any) -> None:
        parser.add_argument("--seed", type=int, default=0, help="first seed")
        parser.add_argument("--seeds", type=int, default=0,
                            help="seeds to run: seed, seed+1, ... (default 3, quick: 1)")
        parser.add_argument("--faults", type=int, default=0, help="default 21 (quick: 8)")

    args = parse_args(__doc__, extra)
    reports, verdicts = [], []
    seeds = args.seeds or (1 if args.quick else 3)
    for seed in range(args.seed, args.seed + max(1, seeds)):
        cfg = SoakConfig(n_faults=args.faults or (8 if args.quick else 21), seed=seed)
        rep, ok = soak_one(cfg, args.quick)
        rep.print()
        reports.append(rep.to_dict())
        verdicts.append(ok)
        print(f"seed {seed}: {'passed' if ok else 'FAILED'}")
    if args.json_path:
        write_json(args.json_path, {"title": "Chaos soak over seeds", "seeds": reports,
                                    "passed": verdicts})
    print("SOAK PASSED" if all(verdicts) else "SOAK FAILED")
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
