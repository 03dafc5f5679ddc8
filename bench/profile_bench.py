"""What `--profile-steps A:B` costs: the profiled steps, the steps around them, the export.

    python -m bench.profile_bench [--quick] [--json PATH]

Both sides run the same job on the local launcher (2 gloo ranks, dp2 zero1, same model, data,
steps); on one, every rank records a torch.profiler trace (CPU activities) of a window of steps
in the middle of the run (`train.profile_steps`) and writes it as Chrome JSON. Runs alternate
off/on/on/off... and each figure is the median over the pairs, so drift of a shared host hits
both sides alike. Figures (the trainer's own step times, `step_s`, median per run):
- inside the window: profiled ÷ plain step time for the same steps (what the profiler's op
  recording costs while it is on; no goal: it is a debugging tool, on for a few steps);
- outside the window: on ÷ off of the other steady steps (goal: the profiler leaves nothing
  behind, ≈ 1);
- the export: the pause after the window (trace export + copy + the ranks' agreement), and
  the trace's size per rank;
- losses: profiled == plain at every step (exact).
"""
from __future__ import annotations

import logging
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from tenax.testing.scripts import exit_unless_run_as_module

exit_unless_run_as_module(__spec__, __file__)  # a path run stops here, before `bench.`

from bench.common import Report, parse_args, ratio

logger = logging.getLogger(__name__)

WARMUP = 5
MODEL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
         "model.vocab_size=256", "model.seq_len=64", "model.ffn_hidden=128"]


def run_once(root: str, window: tuple[int, int] | None, steps: int) -> dict[str, Any]:
    """One launcher run: median step_s inside / outside `window`, the profile event, losses."""
    from tenax.parallel.layout import ParallelLayout
    from tenax.testing.jobs import make_spec
    from tenax.testing.ranks import rank_context
    from tenax.workers.launch import launch

    extra = MODEL + [f"train.steps={steps}", f"checkpoint.every_steps={steps}",
                     "checkpoint.memory_every_steps=0", "train.global_batch_size=8"]
    if window is not None:
        extra.append(f"train.profile_steps=[{window[0]},{window[1]}]")
    spec = make_spec(root, extra, name="profile-bench")
    events: list[dict[str, Any]] = []
    layout = ParallelLayout(dp=2, zero=1, micro_batch_size=1)
    if not launch(spec.to_dict(), layout.to_dict(), 2, events.append, 600, rank_context()):
        raise RuntimeError(f"bench run failed: {events[-3:]}")
    return {"steps": [e for e in events if e["event"] == "step" and e["rank"] == 0],
            "profile": next((e for e in events if e["event"] == "profile"), None)}


def figures(run: dict[str, Any], window: tuple[int, int]) -> dict[str, Any]:
    first, last = window
    inside = [e["step_s"] for e in run["steps"] if first <= e["step"] <= last]
    # the step right after the window carries the export in its wall time, not in step_s
    outside = [e["step_s"] for e in run["steps"]
               if e["step"] > WARMUP and not first <= e["step"] <= last]
    return {"inside": statistics.median(inside), "outside": statistics.median(outside),
            "losses": {e["step"]: e["loss"] for e in run["steps"]}}


def main() -> int:
    args = parse_args(__doc__)
    pairs, steps, window = (2, 40, (16, 25)) if args.quick else (4, 120, (51, 70))
    report = Report("Profiling a window of steps (--profile-steps): on ÷ off")
    runs: list[dict[bool, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tenax-profile-") as root:
        for i in range(pairs):
            order = (False, True) if i % 2 == 0 else (True, False)
            raw = {on: run_once(root, window if on else None, steps) for on in order}
            pair = {on: figures(raw[on], window) for on in order}
            profile = raw[True]["profile"]
            trace = Path(profile["diagnostics"].removeprefix("file://")) / "rank-0.trace.json"
            pair["export_s"], pair["trace_bytes"] = profile["export_s"], trace.stat().st_size
            runs.append(pair)
            logger.info("pair %d: %s", i, {k: v for k, v in pair.items() if k != "losses"})
    inside = [ratio(p[True]["inside"], p[False]["inside"]) for p in runs]
    outside = [ratio(p[True]["outside"], p[False]["outside"]) for p in runs]
    same = all(p[True]["losses"] == p[False]["losses"] for p in runs)
    report.add("profiled steps: step time on ÷ off", statistics.median(inside), "",
               f"window {window[0]}-{window[1]}; pairs " + ", ".join(f"{r:.2f}" for r in inside))
    report.add("other steps: step time on ÷ off", statistics.median(outside), "<= 1.05",
               "pairs " + ", ".join(f"{r:.3f}" for r in outside))
    report.add("pause after the window (export + copy)",
               statistics.median(p["export_s"] for p in runs), unit="s")
    report.add("trace size per rank", statistics.median(p["trace_bytes"] for p in runs) / 2**20,
               unit="MiB", note=f"{window[1] - window[0] + 1} steps")
    report.add("losses equal at every step", 1.0 if same else 0.0, "== 1")
    report.context = {"quick": args.quick, "pairs": pairs, "steps": steps, "window": window,
                      "model": MODEL, "load_avg": os.getloadavg(),
                      "runs": [{str(k): v for k, v in p.items() if k is not True and
                                k is not False} | {"inside": (p[True]["inside"],
                                                              p[False]["inside"])}
                               for p in runs]}
    report.finish(args.json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
