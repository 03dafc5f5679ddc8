"""The checks of `bench/gpu_check.py` that run another bench script: MFU with and without
`train.compile`, and per-step snapshots on the device (bench/device_snapshot_bench.py).

Each runs as `python -m bench.NAME ... --json PATH` in a subprocess with a deadline, so a crash
or a hang costs that check only; its figures land in the driver's `figures["checks"]`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

MFU_GOAL = 0.40
SNAPSHOT_GOAL = 0.97  # tokens/s with a snapshot asked for after every step ÷ without


def repo_env() -> dict[str, str]:
    """This environment with the working directory (the repository root) first on PYTHONPATH:
    the checks run as `python -m bench.NAME` subprocesses."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        os.getcwd(), os.environ.get("PYTHONPATH")])))


def run_script(d: Any, key: str, module: str, args: list[str], exits: tuple[int, ...] = (0,),
               timeout_s: float = 180.0) -> dict[str, Any] | None:
    """Run `python -m module` with `args` + `--json PATH`; its JSON, or None after recording
    the failure under checks[`key`]. `exits`: the exit codes that still leave a result (a
    script may write its figures and exit 1 for a failed check)."""
    path = os.path.join(d.tmp, f"{key}.json")
    cmd = [sys.executable, "-m", module, *args, "--json", path]
    try:
        proc = subprocess.run(cmd, env=repo_env(), capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        with open(d.log_path, "a") as f:
            f.write(f"---- {key} output (timed out) ----\n{str(exc.stdout)[-6000:]}\n"
                    f"{str(exc.stderr)[-4000:]}\n")
        d.log(f"{key}: timed out after {timeout_s:.0f} s")
        d.figures["checks"][key] = {"ok": False, "error": "timeout"}
        return None
    with open(d.log_path, "a") as f:
        f.write(f"---- {key} output ----\n{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}\n")
    if proc.returncode not in exits or not os.path.exists(path):
        d.log(f"{key}: exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
        d.figures["checks"][key] = {"ok": False, "error": proc.stderr[-2000:]}
        return None
    with open(path) as f:
        return json.load(f)


def mfu_check(d: Any) -> None:
    """MFU eager, then with the blocks compiled (`train.compile`), side by side."""
    steps = "10" if d.device == "cuda" else "3"
    for key, extra in (("mfu", ["--breakdown"]), ("mfu_compile", ["--compile", "--breakdown"])):
        r = run_script(d, key, "bench.mfu_bench", ["--device", d.device, "--steps", steps,
                                                    *extra], timeout_s=300.0)
        if r is None:
            continue
        d.figures["checks"][key] = {**r, "ok": r["loss_finite"],
                                    "goal": MFU_GOAL, "met": r["mfu"] >= MFU_GOAL}
        d.log(f"{key}: {r['device_name']} {r['dtype']} {r['params'] / 1e9:.2f}B params, "
              f"median step {r['median_step_s']:.3f} s, {r['tokens_per_s']:.0f} tokens/s, "
              f"MFU {r['mfu']:.3f} (goal {MFU_GOAL}) of {r['peak_flops'] / 1e12:.3g} TFLOP/s "
              f"({r['peak_source']}), {r['mfu_vs_measured_matmul']:.3f} of measured matmul "
              f"{r['measured_matmul_flops'] / 1e12:.3g} TFLOP/s; planner: {r['planner']}")
        shares = r.get("breakdown", {}).get("share_of_wall")
        if shares:
            d.log(f"{key} step by kernel kind, share of the wall: " + ", ".join(
                f"{kind} {share:.3f}" for kind, share in sorted(shares.items(),
                                                               key=lambda kv: -kv[1])))


def snapshot_check(d: Any) -> None:
    """bench/device_snapshot_bench.py: per-step snapshots through the production path (it
    exits 1, with its figures written, when a snapshot is not the state it was taken from or
    a restore does not bring back the state that was saved)."""
    r = run_script(d, "snapshots", "bench.device_snapshot_bench",
                   ["--device", d.device, "--compile"], exits=(0, 1), timeout_s=420.0)
    if r is None:
        return
    exact = r["exactness"]["exact"] and r["exactness"]["state_changed_after_each"] \
        and all(r["restore"]["exact"].values())
    staged = r["staged_on_device"] or d.device != "cuda"
    ratio = r["tokens_per_s_every_step_over_off"]
    d.figures["checks"]["snapshots"] = {**r, "ok": exact and staged, "goal": SNAPSHOT_GOAL,
                                        "met": ratio >= SNAPSHOT_GOAL}
    med, rest = r["median_step_s"], r["restore"]
    d.log(f"snapshots: {r['state_bytes'] / 1e9:.2f} GB of state in {r['snapshot_dir']}; "
          f"median step off {med['off']:.3f} s, every step {med['every_step']:.3f} s "
          f"(ratio {r['median_step_off_over_every_step']:.3f}); snapshot() on the training "
          f"thread median {r['snapshot_call_s']['median'] * 1e3:.1f} ms, max "
          f"{r['snapshot_call_s']['max'] * 1e3:.1f} ms; "
          f"tokens/s ratio {ratio:.3f} (goal {SNAPSHOT_GOAL}); {r['snapshots_taken']} of "
          f"{r['snapshots_asked']} asked taken; staged on device: {r['staged_on_device']}; "
          f"exact: {exact}; restore memory {rest['median_s']['memory']:.2f} s, disk warm "
          f"{rest['median_s']['disk_warm']:.2f} s, cold {rest['median_s']['disk_cold']:.2f} s "
          f"(memory / disk warm {rest['memory_over_disk_warm']:.2f}, cold "
          f"{rest['memory_over_disk_cold']:.2f})")
