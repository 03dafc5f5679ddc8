"""Goodput under faults: a run with a rank killed every 50 steps vs the same run without faults.

    python -m bench.goodput_bench [--quick] [--json PATH]

Why compare to a fault-free run of the same job in the same invocation: what a user wants to
know is what fraction of the fault-free rate survives a given fault rate, and on a shared host
only a side-by-side run makes that comparable. The runs go clean, faulted, faulted, clean and
each figure is a ratio of the sums (--single: one of each): this 2-core host's speed drifts by
up to 10% between two consecutive 50 s runs, several times what two faults cost, so a single
pair landed on either side of 0.95 by drift alone (each pair's own ratio is still reported).
Figures:
- committed-step rate ratio: (train.steps ÷ wall)_faulted ÷ (train.steps ÷ wall)_clean, wall
  from controller start to `done` (goal >= 0.95). On a shared host the two runs see different
  speeds, so the same ratio is also given host-speed normalized: Σ step time of the committed
  steps ÷ wall, faulted ÷ clean;
- goodput: productive ÷ wall time from the controller's own accounting
  (orchestrator/job/goodput.py) for both runs, and their ratio (goal >= 0.95);
- step efficiency: committed steps ÷ steps computed (redone steps after a rollback count as
  computed but not committed);
- cost per fault in seconds (`fault_cost`; cross-checked from the runs' walls), and the fault
  interval that this cost would need to meet 0.95.
Faults are `kill rank` (SIGKILL of one rank's training process) at steps 50, 100, ...;
storage checkpoints every 10 steps (each fault lands right before one: without in-memory
snapshots 9 steps are redone, the worst case). Both runs take in-memory snapshots every step
(`checkpoint.memory_every_steps=1`, the default), so a fault should resume from `memory` with
at most 1 step redone; the source, step and lost steps of every resume are reported. A third
run, the faulted one with snapshots off (`memory_every_steps=0`, i.e. storage only), shows
what the snapshots buy (skip it with --no-off). The final losses must match.

A short warm-up job runs first and is not measured: the first job of a Ray session gets its
agents from the worker processes Ray prestarted at init (actor start 0.8 s vs 1.6 s for every
later job), and the clean run, always first, started 1.2-2.7 s sooner than the faulted one in
most invocations: a bias against the faulted run of up to 0.05 on the ratios, unrelated to
faults. The warm-up removes that part; the faulted run still often starts later (see the
history in bench/RESULTS.md).
"""
from __future__ import annotations

import logging
import os
import statistics
import sys
import tempfile
from typing import Any

from tenax.testing.scripts import exit_unless_run_as_module

exit_unless_run_as_module(__spec__, __file__)  # a path run stops here, before `bench.`

from bench.common import Report, parse_args, ratio, recoveries, snapshot_leftovers
from tenax.testing.clusters import local_ray
from tenax.testing.jobs import JobRun, make_spec

logger = logging.getLogger(__name__)

MODEL = ["model.dim=256", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=4",
         "model.vocab_size=512", "model.seq_len=128", "model.ffn_hidden=688",
         "parallel.micro_batch_size=2", "resources.nodes=1", "resources.gpus_per_node=2",
         "checkpoint.every_steps=10"]
FAULT_EVERY = 50
WARM_UP_STEPS = 3
TIMEOUT_S = 1800.0


def run(root: str, steps: int, chaos: str | None, name: str,
        extra: list[str] | None = None) -> dict[str, Any]:
    spec = make_spec(root, MODEL + [f"train.steps={steps}"] + (extra or []), name)
    job = JobRun(spec, chaos).run(TIMEOUT_S)
    done = (job.of("done") or [{}])[-1]
    first = job.first_step_after(job.started_at)
    end = done.get("t", job.finished_at)
    step_s = sorted(e["step_s"] for e in job.of("step"))
    committed = {e["step"]: e["step_s"] for e in job.of("step")}  # a redone step: last value
    return {"name": name, "chaos": chaos, "state": job.state, "cause": job.controller.cause,
            "median_step_s": step_s[len(step_s) // 2] if step_s else None,
            "stalls_s": stalls(job), "committed_step_time_s": sum(committed.values()),
            "wall_s": end - job.started_at,
            "wall_from_first_step_s": end - first["t"] if first else None,
            "steps_computed": len(job.of("step")), "steps": steps,
            "restarts": job.controller.restarts, "lost_steps": job.controller.lost_steps,
            "goodput": done.get("goodput", {}), "final_loss": job.losses().get(steps),
            "recoveries": recoveries(job),
            "memory_every_steps": spec.checkpoint.memory_every_steps,
            "snapshot_bytes": [e.get("bytes") for e in job.of("snapshot")][-1:],
            "shm_left": snapshot_leftovers(job.controller.job_id)}


def stalls(job: JobRun) -> list[float]:
    """Per failure: last step record before it -> first step record after its recovery."""
    out = []
    for failure in job.of("failure"):
        before = [e for e in job.of("step") if e["t"] <= failure["t"]]
        recovered = next((e for e in job.of("recovered") if e["t"] >= failure["t"]), None)
        after = job.first_step_after(recovered["t"]) if recovered else None
        if before and after:
            out.append(round(after["t"] - before[-1]["t"], 3))
    return out


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs of one kind as one: times, steps and faults summed (ratios of sums)."""
    if len(runs) == 1:
        return runs[0]
    out = dict(runs[0])
    for key in ("wall_s", "committed_step_time_s", "steps", "steps_computed", "restarts",
                "lost_steps", "stalls_s", "recoveries", "shm_left"):
        out[key] = sum((r[key] for r in runs[1:]), runs[0][key])
    firsts = [r["wall_from_first_step_s"] for r in runs]
    out["wall_from_first_step_s"] = None if None in firsts else sum(firsts)
    out["median_step_s"] = statistics.median(r["median_step_s"] for r in runs)
    productive = sum(r["goodput"].get("productive_s", 0.0) for r in runs)
    wall = sum(r["goodput"].get("wall_s", 0.0) for r in runs)
    out["goodput"] = {"goodput": productive / wall if wall else None, "productive_s": productive,
                      "wall_s": wall}
    losses = {r["final_loss"] for r in runs}
    out["final_loss"] = runs[0]["final_loss"] if len(losses) == 1 else None
    out["state"] = "SUCCEEDED" if all(r["state"] == "SUCCEEDED" for r in runs) else "FAILED"
    return out


def add_pair_rows(report: Report, clean: list[dict[str, Any]],
                  faulted: list[dict[str, Any]]) -> None:
    """Each side-by-side pair's own raw ratio: how far the host's drift moves a single pair."""
    if len(clean) < 2:
        return
    pairs = [ratio(c["wall_s"], f["wall_s"]) for c, f in zip(clean, faulted)]
    report.add("committed-step rate of each pair", min(pairs),
               note=f"clean-faulted, then faulted-clean: {[round(p, 3) for p in pairs]}; "
               f"clean runs {[round(c['wall_s'], 1) for c in clean]} s")


def fault_cost(stalls_s: list[float], lost_steps: int, step_s: float) -> float:
    """Seconds each fault delays the job: mean stall + (redone steps per fault - 1) x step.

    A stall runs from the last step record before the failure (step N) to the first one after
    the resume. With one step redone that first record is step N again, so the stall is the
    whole delay (the clean run had step N at the stall's start; the redo is inside it). With
    none redone it is step N+1, which the clean run also spent a step on; with k redone, the
    k-1 steps after the first are not in it. (Adding every redone step to the stall would
    count the first one twice: ~0.4 s per fault too much.)"""
    n = len(stalls_s)
    return (sum(stalls_s) + (lost_steps - n) * step_s) / n


def _normalized_rate(r: dict[str, Any]) -> float:
    """Time the committed steps themselves took ÷ wall: the share of the run that produced
    kept work, at whatever speed the shared host gave each step (immune to its drift)."""
    return r["committed_step_time_s"] / r["wall_s"]


def add_source_rows(report: Report, faulted: dict[str, Any]) -> None:
    """Where each resume came from and what it redid (goal: memory, <= 1 step)."""
    recs = faulted["recoveries"]
    from_memory = [r for r in recs if r["source"] in ("memory", "replica")]
    report.add("resumes from memory ÷ faults", ratio(len(from_memory), faulted["restarts"]),
               ">= 1", "; ".join(f"{r['source']}@{r['step']} lost {r['lost_steps']} "
                                 f"in {r['seconds']:.2f}s" for r in recs) or "no resume")
    lost = [r["lost_steps"] for r in recs if r["lost_steps"] is not None]
    report.add("lost steps per fault (worst)", max(lost) if lost else None, "<= 1",
               f"per fault {lost}; storage checkpoints every 10 steps")
    left = faulted["shm_left"]
    report.add("snapshot dirs left in /dev/shm after the job", len(left), "<= 0",
               ", ".join(left)[:200])


def add_off_rows(report: Report, clean: dict[str, Any], off: dict[str, Any]) -> None:
    """The same faults with snapshots off: what storage-only recovery keeps (main: 0.78-0.82)."""
    lost = [r["lost_steps"] for r in off["recoveries"]]
    report.add("snapshots off: committed-step rate faulted ÷ clean",
               ratio(clean["wall_s"], off["wall_s"]),
               note=f"memory_every_steps=0: {off['wall_s']:.1f} s; lost steps per fault {lost}; "
               f"sources {[r['source'] for r in off['recoveries']]}")
    report.add("snapshots off: same, host-speed normalized",
               ratio(_normalized_rate(off), _normalized_rate(clean)),
               note="clean run has snapshots on (their cost: overhead_bench)")


def add_rows(report: Report, clean: dict[str, Any], faulted: dict[str, Any]) -> None:
    n = faulted["restarts"]
    rate = ratio(clean["wall_s"], faulted["wall_s"])  # same steps: rate ratio = wall ratio^-1
    report.add("committed-step rate: faulted ÷ clean", rate, ">= 0.95",
               f"{faulted['steps']} steps in {faulted['wall_s']:.1f} s vs {clean['wall_s']:.1f} s")
    report.add("same, host-speed normalized", ratio(_normalized_rate(faulted),
                                                    _normalized_rate(clean)), ">= 0.95",
               f"Σ committed step time ÷ wall: {_normalized_rate(faulted):.3f} vs "
               f"{_normalized_rate(clean):.3f}; median step {faulted['median_step_s']:.3f} vs "
               f"{clean['median_step_s']:.3f} s")
    gp_f, gp_c = faulted["goodput"].get("goodput"), clean["goodput"].get("goodput")
    report.add("goodput (productive ÷ wall), faulted", gp_f,
               note=f"clean run: {gp_c:.3f}" if gp_c is not None else "")
    report.add("goodput ratio: faulted ÷ clean", ratio(gp_f, gp_c), ">= 0.95")
    report.add("step efficiency: committed ÷ computed",
               ratio(faulted["steps"], faulted["steps_computed"]),
               note=f"{faulted['steps_computed']} computed, {faulted['lost_steps']} lost")
    step_s, stall = faulted["median_step_s"], faulted["stalls_s"]
    cost = fault_cost(stall, faulted["lost_steps"], step_s) if n and stall else None
    report.add("time lost per fault", cost, unit="s",
               note=f"stalls (last step → first step after the resume) {stall} s, "
               f"{faulted['lost_steps'] / max(n, 1):.1f} step(s) redone per fault "
               f"(the first redone one is inside the stall)")
    if n and faulted["wall_from_first_step_s"] and clean["wall_from_first_step_s"]:
        # A cross-check that does not trust the stall bounds: the faulted run's extra wall
        # after its first step, less what its committed steps took longer (host speed).
        extra = (faulted["wall_from_first_step_s"] - clean["wall_from_first_step_s"]) - \
            (faulted["committed_step_time_s"] - clean["committed_step_time_s"])
        report.add("same, from the two runs' walls", extra / n, unit="s",
                   note="(extra wall after the first step - extra committed step time) ÷ faults")
    if cost:
        interval = FAULT_EVERY * step_s
        report.add("expected rate ratio from the cost per fault", interval / (interval + cost),
                   note=f"{FAULT_EVERY} x {step_s:.3f} s ÷ ({FAULT_EVERY} x {step_s:.3f} + "
                   f"{cost:.2f}) s: what the measured cost implies")
        report.add("fault interval that would meet 0.95", cost * 0.95 / 0.05 / step_s,
                   unit="steps", note=f"at {step_s:.3f} s/step on this host (bench: {FAULT_EVERY})")
    same = faulted["final_loss"] is not None and clean["final_loss"] is not None and \
        abs(faulted["final_loss"] - clean["final_loss"]) <= 1e-5 * abs(clean["final_loss"])
    report.add("final loss faulted ÷ clean", ratio(faulted["final_loss"], clean["final_loss"]),
               "== 1 ±1e-5", "identical within 1e-5" if same else "DIFFERS")


def _extra(parser: Any) -> None:
    parser.add_argument("--no-off", action="store_true",
                        help="skip the faulted run with in-memory snapshots off")
    parser.add_argument("--single", action="store_true",
                        help="one clean and one faulted run instead of clean, faulted, faulted, "
                        "clean (half the time; the host's drift then lands on the ratio)")


def main() -> int:
    args = parse_args(__doc__, _extra)
    steps = 100 if args.quick else 200
    kills = [(1 if i % 2 == 0 else 0, at) for i, at in enumerate(range(FAULT_EVERY, steps + 1,
                                                                         FAULT_EVERY))]
    chaos = "; ".join(f"kill rank={r} at={at}" for r, at in kills)
    with tempfile.TemporaryDirectory(prefix="tenax-goodput-") as root, local_ray(gpus=2):
        warm_up = run(root, WARM_UP_STEPS, None, "goodput-warm-up")  # see the module docstring
        # Clean, faulted, faulted, clean: the host's drift over the session cancels.
        order = ["clean", "faulted"] if args.single else ["clean", "faulted", "faulted", "clean"]
        done = {"clean": [], "faulted": []}
        for i, kind in enumerate(order):
            done[kind].append(run(root, steps, chaos if kind == "faulted" else None,
                                  f"goodput-{kind}-{i}"))
        off = None if args.no_off else run(root, steps, chaos, "goodput-faulted-off",
                                           ["checkpoint.memory_every_steps=0"])
    clean, faulted = combine(done["clean"]), combine(done["faulted"])
    report = Report(f"Goodput with a rank killed every {FAULT_EVERY} steps vs fault-free")
    add_rows(report, clean, faulted)
    add_pair_rows(report, done["clean"], done["faulted"])
    add_source_rows(report, faulted)
    if off is not None:
        add_off_rows(report, done["clean"][0], off)
    report.context = {"quick": args.quick, "warm_up_wall_s": warm_up["wall_s"], "order": order,
                      "clean": done["clean"], "faulted": done["faulted"], "off": off,
                      "model": MODEL, "load_avg": os.getloadavg()}
    report.finish(args.json_path)
    runs = [warm_up, *done["clean"], *done["faulted"]] + ([off] if off else [])
    return 0 if all(r["state"] == "SUCCEEDED" for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
