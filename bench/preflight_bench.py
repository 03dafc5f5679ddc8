"""Preflight cost: the wall time of `run_preflight` ÷ the same job run plainly for the same
steps, side by side in one Ray session.

    python -m bench.preflight_bench [--quick] [--json PATH]

Why this ratio. The preflight runs the job itself (same placement, layout, data) for N steps,
then resumes one step from storage into another layout and runs a few steps killed once and
restored from memory (the recovery row), and reads the data in the calling process first. So
its cost is three job starts plus N + 1 + min(N, 4) steps: the ratio says how much a user pays
on top of the smoke steps themselves (goal <= 2.5 at the full run's 50 steps; `--quick`'s 8
steps are too few for the starts not to dominate, so it reports without a goal). Runs
alternate plain / preflight; each ratio is one pair, the reported one the median. Every
preflight row's verdict is in the JSON context (all must pass).

Links: on a `cluster_utils` cluster of two nodes (dp2 x tp2, a tp group inside each node) the
links check runs K times healthy (goal: no warning in any) and K times with chaos `slow` on
node 1's ranks (goal: every run names node 1 and only it); the healthy runs' slowest group ÷
median group is the context (no planner figure on CPU slots, so groups are compared).
"""
from __future__ import annotations

import logging
import statistics
import sys
import tempfile
import time
from typing import Any

from tenax.testing.scripts import exit_unless_run_as_module

exit_unless_run_as_module(__spec__, __file__)  # a path run stops here, before `bench.`

from bench.common import Report, parse_args
from tenax.testing.clusters import local_ray
from tenax.testing.jobs import JobRun, make_spec

logger = logging.getLogger(__name__)

ONE_NODE = ["resources.nodes=1", "resources.min_nodes=1", "resources.max_nodes=1",
            "resources.gpus_per_node=2", "checkpoint.memory_every_steps=0"]


def one_pair(root: str, steps: int) -> dict[str, Any]:
    """Wall seconds of the plain job and of its preflight (N = steps), and the verdicts."""
    from tenax.orchestrator.preflight import run_preflight

    spec = make_spec(root, [*ONE_NODE, f"train.steps={steps}"], name="pf-bench")
    t0 = time.monotonic()
    job = JobRun(spec).run(600)
    plain_s = time.monotonic() - t0
    t0 = time.monotonic()
    report = run_preflight(make_spec(root, [*ONE_NODE, f"train.steps={steps}"], name="pf-bench"),
                           steps)
    preflight_s = time.monotonic() - t0
    return {"plain_s": plain_s, "preflight_s": preflight_s, "plain_state": job.state,
            "verdict": report.verdict, "rows": report.to_dict()["rows"]}


def links_runs(root: str, runs: int) -> dict[str, Any]:
    """The links check on two raylets, healthy and with node 1's ranks slowed 4x."""
    from tenax.orchestrator.chaos.faults import parse_chaos
    from tenax.orchestrator.preflight import links_check
    from tenax.orchestrator.spec import plan_for_spec
    from tenax.testing.clusters import ray_cluster

    spec = make_spec(root, ["resources.nodes=2", "resources.min_nodes=2",
                            "resources.max_nodes=2", "resources.gpus_per_node=2",
                            "parallel.tp=2"], name="pf-links")
    layout = plan_for_spec(spec, 4, 2, pin_zero=True).layout
    drill = parse_chaos("slow rank=2 at=1 factor=4; slow rank=3 at=1 factor=4")
    with ray_cluster(2):
        healthy, slowed = [], []
        for _ in range(runs):
            t0 = time.monotonic()
            healthy.append({**links_check(spec, layout).to_dict(), "s": time.monotonic() - t0})
            slowed.append(links_check(spec, layout, drill).to_dict())
    return {"healthy": healthy, "slowed": slowed, "layout": layout.describe()}


def named_only_node_1(row: dict[str, Any]) -> bool:
    return row["verdict"] == "warn" and "node 1" in row["detail"] and "node 0" not in row["detail"]


def main() -> int:
    args = parse_args(__doc__)
    steps, pairs = (8, 1) if args.quick else (50, 3)
    report = Report("Preflight: its wall time beside the plain job's")
    with tempfile.TemporaryDirectory(prefix="tenax-preflight-") as root, local_ray(gpus=2):
        runs = [one_pair(root, steps) for _ in range(pairs)]
    ratios = [r["preflight_s"] / r["plain_s"] for r in runs]
    report.add(f"preflight ÷ plain job, {steps} steps", statistics.median(ratios),
               "" if args.quick else "<= 2.5",
               note=f"median of {pairs} pair(s)")
    report.add("plain job (context)", statistics.median(r["plain_s"] for r in runs), unit="s")
    report.add("preflight (context)", statistics.median(r["preflight_s"] for r in runs),
               unit="s")
    with tempfile.TemporaryDirectory(prefix="tenax-preflight-") as root:
        links = links_runs(root, 3 if args.quick else 10)
    warned = sum(r["verdict"] != "pass" for r in links["healthy"])
    named = sum(named_only_node_1(r) for r in links["slowed"])
    report.add(f"links: healthy checks with a warning (of {len(links['healthy'])})", warned,
               "<= 0", note="two raylets, dp2 x tp2")
    report.add(f"links: slowed node 1 named (of {len(links['slowed'])})", named,
               f">= {len(links['slowed'])}", note="chaos slow factor=4 on ranks 2, 3")
    report.add("links check wall time (context)",
               statistics.median(r["s"] for r in links["healthy"]), unit="s")
    report.context = {"quick": args.quick, "steps": steps, "runs": runs, "links": links}
    report.finish(args.json_path)
    ok = warned == 0 and named == len(links["slowed"])
    return 0 if ok and all(r["verdict"] == "pass" and r["plain_state"] == "SUCCEEDED"
                           for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
