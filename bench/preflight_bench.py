"""Preflight cost: the wall time of `run_preflight` ÷ the same job run plainly for the same
steps, side by side in one Ray session.

    python -m bench.preflight_bench [--quick] [--json PATH]

Why this ratio. The preflight runs the job itself (same placement, layout, data) for N steps,
then once more for one step resumed from a checkpoint (the recovery row), and reads the data in
the calling process first. So its cost is about two job starts plus N + 1 steps: the ratio
says how much a user pays on top of the smoke steps themselves (goal <= 2.5: the second start
must stay the only real extra). Runs alternate plain / preflight; each ratio is one pair, the
reported one the median. Every preflight row's verdict is in the JSON context (all must pass).
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


def main() -> int:
    args = parse_args(__doc__)
    steps, pairs = (8, 1) if args.quick else (50, 3)
    report = Report("Preflight: its wall time beside the plain job's")
    with tempfile.TemporaryDirectory(prefix="tenax-preflight-") as root, local_ray(gpus=2):
        runs = [one_pair(root, steps) for _ in range(pairs)]
    ratios = [r["preflight_s"] / r["plain_s"] for r in runs]
    report.add(f"preflight ÷ plain job, {steps} steps", statistics.median(ratios), "<= 2.5",
               note=f"median of {pairs} pair(s)")
    report.add("plain job (context)", statistics.median(r["plain_s"] for r in runs), unit="s")
    report.add("preflight (context)", statistics.median(r["preflight_s"] for r in runs),
               unit="s")
    report.context = {"quick": args.quick, "steps": steps, "runs": runs}
    report.finish(args.json_path)
    return 0 if all(r["verdict"] == "pass" and r["plain_state"] == "SUCCEEDED"
                    for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
