"""Straggler detection on this machine: detection rate, windows to detection, false flags.

    python -m bench.straggler_bench [--quick] [--runs N] [--json PATH] [--traces PATH]
    python -m bench.straggler_bench --replay PATH   # re-score recorded traces

Why this shape. The detector's enemy is the noise of real per-rank busy-time throughput, so
the traces are real: 4 gloo ranks on this machine (2 shared cores) train the tiny example
model with `tenax.workers.rank.run_rank`, and rank 3's compute is stretched (chaos `slow`, the
same mechanism as `--chaos "slow rank=3 factor=F"`) by 1.1×, 1.2×, 1.25× and 1.5× in turn,
each slow stretch preceded by a healthy one. Every rank's step records (with the `time` the
rank stamped them) are kept. The `StragglerTracker` the controller uses is then replayed over
the traces, polled every heartbeat interval on the ranks' own clock, once per threshold and
window phase: a trial is one healthy stretch followed by one slow stretch.

Per factor and threshold: detected = rank 3 flagged within 3 windows of the slowdown, counting
the window in which it started (partly slow) as the first; windows = median windows to the flag;
false flags = trials with any flag on a healthy rank, or on rank 3 before its slowdown (the
first trial's healthy stretch includes the job's warm-up).
"""
from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import statistics
import tempfile
from typing import Any

from tenax.testing.scripts import exit_unless_run_as_module

exit_unless_run_as_module(__spec__, __file__)  # a path run stops here, before `bench.`

from bench.common import Report, parse_args, write_json

logger = logging.getLogger(__name__)

FACTORS = (1.1, 1.2, 1.25, 1.5)
THRESHOLDS = (0.8, 0.85, 0.875, 0.9, 0.925)
WORLD, SLOW_RANK = 4, 3
HEARTBEAT_S = 0.5
PHASES = (0.0, 0.25, 0.5, 0.75)  # window phase offsets, in heartbeat intervals
MODEL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
         "model.vocab_size=128", "model.seq_len=64", "model.ffn_hidden=192",
         "train.global_batch_size=8", "parallel.micro_batch_size=2", "train.warmup_steps=5",
         "resources.device=cpu", f"fault_tolerance.heartbeat_interval_s={HEARTBEAT_S}"]


def schedule(segment: int) -> list[float]:
    """Rank 3's slow factor per step: healthy, F1, healthy, F2, ... (one segment each)."""
    out: list[float] = []
    for factor in FACTORS:
        out += [1.0] * segment + [factor] * segment
    return out


def _rank_main(spec: dict[str, Any], layout: dict[str, Any], rank: int, port: int,
               factors: list[float], queue: Any) -> None:
    from tenax.workers.rank import RankHooks, RankOptions, run_rank

    class Slow:
        """The rank loop's fault hook, as a chaos `slow` drives it: the factor per step."""
        slow_factor = 1.0

        def before_step(self, step: int) -> None:
            if rank == SLOW_RANK:
                self.slow_factor = factors[min(step, len(factors)) - 1]

    def on_step(record: dict[str, Any]) -> None:
        if record.get("event") == "step":
            queue.put({k: record[k] for k in ("rank", "step", "rank_tokens_per_s", "time")})

    run_rank(RankOptions(spec, layout, rank, WORLD, "127.0.0.1", port, resume=False),
             RankHooks(on_step=on_step, faults=Slow()))
    queue.put({"rank": rank, "end": True})


def record_trace(segment: int, root: str) -> list[dict[str, Any]]:
    """One real 4-rank run; every rank's step records."""
    from tenax.orchestrator.spec import layout_from_spec, load_spec
    from tenax.workers.rendezvous import free_port

    factors = schedule(segment)
    spec = load_spec(overrides=MODEL + [f"train.steps={len(factors)}",
                                        f"checkpoint.uri=file://{root}/ckpt",
                                        f"checkpoint.every_steps={len(factors) + 1}"])
    layout = layout_from_spec(spec, WORLD)
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank_main, args=(spec.to_dict(), layout.to_dict(), r, port,
                                                   factors, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    records, ended = [], 0
    while ended < WORLD:
        item = queue.get(timeout=600)
        if item.get("end"):
            ended += 1
        else:
            records.append(item)
    for p in procs:
        p.join(timeout=30)
    return records


def replay(records: list[dict[str, Any]], threshold: float, phase: float, segment: int,
           factor_index: int) -> dict[str, Any]:
    """Feed one trial (healthy stretch, then slow stretch) to a tracker polled on rank time."""
    from tenax.orchestrator.job.health import StragglerTracker

    first = 2 * factor_index * segment  # the healthy stretch before this factor
    onset = first + segment
    trial = sorted((r for r in records if first < r["step"] <= onset + segment),
                   key=lambda r: r["time"])
    clock = [trial[0]["time"] + phase * HEARTBEAT_S]
    tracker = StragglerTracker(threshold, "alert", HEARTBEAT_S, clock=lambda: clock[0])
    onset_time = min(r["time"] for r in trial if r["rank"] == SLOW_RANK and r["step"] > onset)
    onset_window, flags, i = None, [], 0
    while i < len(trial):
        clock[0] += HEARTBEAT_S
        batch = []
        while i < len(trial) and trial[i]["time"] <= clock[0]:
            batch.append({"event": "step", **trial[i]})
            i += 1
        if onset_window is None and clock[0] >= onset_time:
            onset_window = tracker.windows_closed  # the open window holds the slowdown's start
        for flag in tracker.observe(batch, WORLD):
            flags.append((flag.rank, tracker.windows_closed, clock[0] >= onset_time))
    slow_flags = [w for rank, w, after in flags if rank == SLOW_RANK and after]
    false = sum(1 for rank, _, after in flags if rank != SLOW_RANK or not after)
    windows = (slow_flags[0] - onset_window) if slow_flags and onset_window is not None else None
    return {"windows": windows, "false": false}


def table(traces: list[list[dict[str, Any]]], segment: int) -> dict[tuple[float, float], dict]:
    out = {}
    for threshold in THRESHOLDS:
        for index, factor in enumerate(FACTORS):
            trials = [replay(tr, threshold, phase, segment, index)
                      for tr in traces for phase in PHASES]
            hit = [t["windows"] for t in trials if t["windows"] is not None and t["windows"] <= 3]
            found = [t["windows"] for t in trials if t["windows"] is not None]
            out[(threshold, factor)] = {
                "trials": len(trials), "detected": len(hit) / len(trials),
                "median_windows": statistics.median(found) if found else None,
                "false_flag_trials": sum(1 for t in trials if t["false"])}
    return out


def main() -> None:
    def flags(p: Any) -> None:
        p.add_argument("--runs", type=int, default=3)
        p.add_argument("--traces", metavar="PATH", help="also write the raw step records here")
        p.add_argument("--replay", metavar="PATH", help="score the traces written by --traces")

    args = parse_args(__doc__, flags)
    segment = 40 if args.quick else 60
    runs = 1 if args.quick else args.runs
    if args.replay:  # re-score traces recorded earlier (no training)
        with open(args.replay) as f:
            saved = json.load(f)
        segment, traces, loads = saved["segment"], saved["traces"], saved.get("loads", [])
    else:
        loads = [os.getloadavg()[0]]  # the host is shared: the load is part of every figure
        with tempfile.TemporaryDirectory(prefix="tenax-straggler-") as root:
            traces = []
            for i in range(runs):
                traces.append(record_trace(segment, f"{root}/{i}"))
                loads.append(os.getloadavg()[0])
        logger.info("1-minute load average before and after each run: %s", loads)
    if args.traces:
        write_json(args.traces, {"segment": segment, "traces": traces, "loads": loads})
    results = table(traces, segment)
    rep = Report("Straggler detection: 4 ranks on this machine, rank 3 slowed")
    for (threshold, factor), r in results.items():
        goal = ">= 0.95" if factor >= 1.2 and threshold == 0.9 else ""
        rep.add(f"t={threshold} {factor}x: detected within 3 windows", r["detected"], goal,
                f"median {r['median_windows']} windows; false flags in "
                f"{r['false_flag_trials']}/{r['trials']} trials")
    rep.context = {"runs": len(traces), "segment_steps": segment, "phases": PHASES, "loads": loads,
                   "results": {f"{t}/{f}": r for (t, f), r in results.items()}}
    rep.finish(args.json_path)


if __name__ == "__main__":
    main()
