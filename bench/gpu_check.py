"""One short script for a lent GPU: per-step snapshots, MFU, engine parity on cuda and a
bf16 loss curve.

    python -m bench.gpu_check --out DIR [--device cuda|cpu] [--quick]

Why this shape: a lent GPU host has torch but no Ray and no network, and a few minutes of
time; so every check is a subprocess of this file (a crash or NCCL hang costs one check, not
the run, and a per-check deadline bounds it), and it writes everything to DIR/gpu_check.log and
the figures to DIR/gpu_check.json (default `$OUT`, else ./gpu_check_out). The engine checks
import only the engine (`parallel/`) and `bench/mfu_bench.py`; the snapshot check runs the
production trainer and checkpoint layer, which need the package's own dependencies (pydantic,
crc32c) besides torch. `--device cpu` (or `--quick`) runs the same checks on gloo/CPU with
small sizes (the dry run CI can afford).

Checks, most valuable first:
1. snapshots: `bench/device_snapshot_bench.py` on the ~1.3B-parameter model, its blocks
   compiled: tokens/s with a snapshot asked for after every step ÷ without (goal 0.97), each
   of two snapshots equal to the state it was taken from, and a restore from memory ÷ from
   local disk, each load bringing back the saved state byte for byte.
2. mfu: `bench/mfu_bench.py` on cuda bf16 with the same model, eager and with its blocks
   compiled (`train.compile`), next to the planner (goal 0.40).
3. parity: the engine on cuda fp32 (world size 1, NCCL; ZeRO 1 compiled, then ZeRO 0/1/2/3
   eager) against the CPU fp32 single-process reference, same seed and data, SGD (so
   parameters are comparable): losses per step (goal 1e-5 relative) and final parameters
   (max |diff| / lr ~ a gradient error, goal 1e-4).
4. bf16: 60 AdamW steps under bf16 autocast on a learnable synthetic stream: finite losses,
   last 5 mean < 0.7 x first 5 mean.
5. 2 ranks on the one GPU: NCCL refuses two ranks on one device, so this is tried and, when
   refused, gloo with CUDA tensors is used instead; the log says which.
Each is skipped when the time budget ($GPU_CHECK_BUDGET_S, default 420 s) is spent; the JSON
is rewritten after every check.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from tenax.testing.scripts import exit_unless_run_as_module

exit_unless_run_as_module(__spec__, __file__)  # a path run stops here, before `bench.`

from bench.gpu_check_scripts import mfu_check, repo_env, snapshot_check

logger = logging.getLogger(__name__)

PARITY_MODEL = dict(dim=128, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=256, seq_len=64,
                    ffn_hidden=352)
CURVE_MODEL = dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=4096, seq_len=256,
                   ffn_hidden=1376)
GLOBAL_BATCH, MICRO, PARITY_STEPS, PARITY_LR = 8, 2, 3, 0.05
LOSS_RTOL, GRAD_ATOL = 1e-5, 1e-4
WORKER_TIMEOUT_S = 150
TOTAL_BUDGET_S = float(os.environ.get("GPU_CHECK_BUDGET_S", "420"))


# ---- worker side (runs in a subprocess, one process group each) ---------------------------
def _worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from tenax.workers.rendezvous import join_process_group

    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity needs true fp32 matmuls
        torch.backends.cudnn.allow_tf32 = False
    join_process_group(args.rank, args.world, "127.0.0.1", args.port, 120.0, backend=args.backend)
    try:
        return _parity(args, device) if args.worker == "parity" else _curve(args, device)
    finally:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def _parity(args: argparse.Namespace, device: Any) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import DTensor

    from bench.mfu_bench import EngineLoop, model_config, synthetic_batch
    from tenax.parallel.model import canonical_param_name

    cfg = model_config(PARITY_MODEL)
    rows = GLOBAL_BATCH // args.world
    loop = EngineLoop(cfg, device, None, MICRO, rows // MICRO, dp=args.world, zero=args.zero,
                      optimizer_kind="sgd", lr=PARITY_LR, compile=args.compile)
    losses = []
    for step in range(PARITY_STEPS):
        x, y = synthetic_batch(GLOBAL_BATCH, cfg.seq_len, cfg.vocab_size, 7, step)
        mine = slice(args.rank * rows, (args.rank + 1) * rows)
        losses.append(loop.step(x[mine].to(device), y[mine].to(device)))
    params = {}
    for name, p in loop.pm.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        params[canonical_param_name(name)] = full.detach().float().cpu().clone()
    if args.rank == 0:
        torch.save(params, args.result + ".pt")
    return {"losses": losses}


def _curve(args: argparse.Namespace, device: Any) -> dict[str, Any]:
    import math

    import torch

    from bench.mfu_bench import EngineLoop, model_config, synthetic_batch

    dims = dict(CURVE_MODEL) if device.type == "cuda" else dict(PARITY_MODEL)
    cfg = model_config(dims)
    micro = 8 if device.type == "cuda" else 2
    loop = EngineLoop(cfg, device, torch.bfloat16, micro, 1, dp=1, zero=1, lr=2e-3)
    losses = []
    for step in range(args.steps):
        # A small fixed set of sequences: a model that trains at all memorises it quickly.
        x, y = synthetic_batch(micro, cfg.seq_len, cfg.vocab_size, 3, step % 4)
        losses.append(loop.step(x.to(device), y.to(device)))
    finite = all(math.isfinite(v) for v in losses)
    head, tail = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    return {"losses": losses, "finite": finite, "first5": head, "last5": tail,
            "ok": finite and tail < 0.7 * head, "model": dims}


# ---- driver side --------------------------------------------------------------------------
class Driver:
    def __init__(self, out_dir: str, device: str) -> None:
        self.out_dir, self.device = out_dir, device
        self.tmp = tempfile.mkdtemp(prefix="gpu-check-")
        self.log_path = os.path.join(out_dir, "gpu_check.log")
        self.start = time.monotonic()
        self.figures: dict[str, Any] = {"device": device, "checks": {}}
        self.ref: tuple[dict[str, Any], dict[str, Any]] | None = None

    def over_budget(self, share: float) -> bool:
        return time.monotonic() - self.start > share * TOTAL_BUDGET_S

    def write_json(self) -> None:
        """After every check: a run cut short still leaves the figures it reached."""
        checks = self.figures["checks"]
        self.figures["all_ok"] = bool(checks) and all(c.get("ok") for c in checks.values())
        self.figures["elapsed_s"] = time.monotonic() - self.start
        with open(os.path.join(self.out_dir, "gpu_check.json"), "w") as f:
            json.dump(self.figures, f, indent=2)

    def log(self, msg: str) -> None:
        line = f"[{time.monotonic() - self.start:7.1f}s] {msg}"
        print(line, flush=True)
        with open(self.log_path, "a") as f:
            f.write(line + "\n")

    def spawn(self, name: str, world: int, extra: list[str], timeout_s: float = WORKER_TIMEOUT_S
              ) -> list[dict[str, Any]] | str:
        """Run `world` worker processes; their results by rank, or a one-line failure."""
        from tenax.workers.rendezvous import free_port

        port, procs, paths = free_port(), [], []
        for rank in range(world):
            path = os.path.join(self.tmp, f"{name}-{rank}.json")
            paths.append(path)
            cmd = [sys.executable, "-m", "bench.gpu_check", "--worker", *extra, "--rank",
                   str(rank), "--world", str(world), "--port", str(port), "--result", path]
            procs.append(subprocess.Popen(cmd, env=repo_env(), stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        return self._collect(name, procs, paths, timeout_s)

    def _collect(self, name: str, procs: list[Any], paths: list[str], timeout_s: float
                 ) -> list[dict[str, Any]] | str:
        deadline, failure = time.monotonic() + timeout_s, ""
        for rank, proc in enumerate(procs):
            try:
                output, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                output, _ = proc.communicate()
                failure = failure or f"rank {rank} timed out after {timeout_s:.0f} s"
            if proc.returncode != 0 and not failure:
                tail = [ln for ln in output.strip().splitlines() if ln.strip()][-3:]
                failure = f"rank {rank} exit {proc.returncode}: {' | '.join(tail)}"
            with open(self.log_path, "a") as f:
                f.write(f"---- {name} rank {rank} output ----\n{output[-4000:]}\n")
        if failure:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            return failure
        results = []
        for path in paths:
            with open(path) as f:
                results.append(json.load(f))
        return results


def compare(ref: dict[str, Any], ref_params: dict[str, Any], got: dict[str, Any],
            got_params: dict[str, Any]) -> dict[str, Any]:
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
    param_diff = max(float((got_params[k] - ref_params[k]).abs().max()) for k in ref_params)
    grad_equiv = param_diff / PARITY_LR / PARITY_STEPS
    return {"loss_max_rel": loss_rel, "param_max_abs": param_diff,
            "grad_equivalent_max_abs": grad_equiv,
            "ok": loss_rel <= LOSS_RTOL and grad_equiv <= GRAD_ATOL}


def load_params(path: str) -> dict[str, Any]:
    import torch

    return torch.load(path, weights_only=True)  # tensors only: nothing else is unpickled


def parity_world1(d: Driver) -> None:
    ref = d.spawn("ref-cpu", 1, ["parity", "--device", "cpu", "--backend", "gloo", "--zero", "0"])
    if isinstance(ref, str):
        d.log(f"parity: CPU reference failed: {ref}")
        d.figures["checks"]["parity_reference"] = {"ok": False, "error": ref}
        return
    d.ref = (ref[0], load_params(os.path.join(d.tmp, "ref-cpu-0.json.pt")))
    d.log(f"parity: CPU fp32 reference losses {ref[0]['losses']}")
    backend = "nccl" if d.device == "cuda" else "gloo"
    run_parity(d, f"world1-{backend}-zero1-compile", 1, backend, 1, *d.ref, compile=True)
    for zero in (0, 1, 2, 3):
        if d.over_budget(0.8):
            d.log(f"parity world1-{backend}-zero{zero}: skipped (time budget)")
            continue
        run_parity(d, f"world1-{backend}-zero{zero}", 1, backend, zero, *d.ref)


def parity_world2(d: Driver) -> None:
    """Two ranks on the one device: NCCL first, gloo with CUDA tensors if NCCL refuses."""
    if d.ref is None:
        return
    backend = "nccl" if d.device == "cuda" else "gloo"
    name = f"world2-{backend}-zero1"
    # NCCL reports two ranks on one device at its first collective; 60 s bounds a hang instead.
    first_try = 60 if backend == "nccl" else WORKER_TIMEOUT_S
    if run_parity(d, name, 2, backend, 1, *d.ref, timeout_s=first_try) or backend != "nccl":
        two_backend, label, zeros = backend, backend, (0, 2, 3)
    else:
        d.log("two ranks on one GPU: NCCL refused (it needs one device per rank); "
              "falling back to gloo with CUDA tensors")
        d.figures["checks"][f"parity_{name}"].update(ok=True, expected_refusal=True)
        # FSDP2's collectives on gloo with CUDA tensors crash inside gloo (SIGSEGV, seen on
        # an H200 with torch 2.11): ZeRO-3 is checked on NCCL at world size 1 only.
        d.log("ZeRO-3 is not run on gloo-CUDA (FSDP2 collectives crash inside gloo there)")
        two_backend, label, zeros = "gloo", "gloo-cuda", (0, 1, 2)
    for zero in zeros:
        if d.over_budget(0.85):
            d.log(f"parity world2-{label}-zero{zero}: skipped (time budget)")
            continue
        run_parity(d, f"world2-{label}-zero{zero}", 2, two_backend, zero, *d.ref)


def run_parity(d: Driver, name: str, world: int, backend: str, zero: int, ref: dict[str, Any],
               ref_params: dict[str, Any], timeout_s: float = WORKER_TIMEOUT_S,
               compile: bool = False) -> bool:
    """`compile`: the blocks compiled (`train.compile`), against the same eager reference."""
    res = d.spawn(name, world, ["parity", "--device", d.device, "--backend", backend,
                                "--zero", str(zero)] + (["--compile"] if compile else []),
                  timeout_s)
    if isinstance(res, str):
        d.log(f"parity {name}: did not run: {res}")
        d.figures["checks"][f"parity_{name}"] = {"ok": False, "error": res}
        return False
    cmp = compare(ref, ref_params, res[0], load_params(os.path.join(d.tmp, f"{name}-0.json.pt")))
    d.figures["checks"][f"parity_{name}"] = {**cmp, "losses": res[0]["losses"]}
    d.log(f"parity {name}: {'OK' if cmp['ok'] else 'MISMATCH'} loss rel {cmp['loss_max_rel']:.2e} "
          f"(goal {LOSS_RTOL:g}), params max |diff| {cmp['param_max_abs']:.2e} "
          f"(grad-equivalent {cmp['grad_equivalent_max_abs']:.2e}, goal {GRAD_ATOL:g})")
    return True


def curve_check(d: Driver) -> None:
    backend = "nccl" if d.device == "cuda" else "gloo"
    steps = "60" if d.device == "cuda" else "40"
    res = d.spawn("bf16-curve", 1, ["curve", "--device", d.device, "--backend", backend,
                                    "--steps", steps])
    if isinstance(res, str):
        d.log(f"bf16 curve: did not run: {res}")
        d.figures["checks"]["bf16_curve"] = {"ok": False, "error": res}
        return
    r = res[0]
    d.figures["checks"]["bf16_curve"] = r
    d.log(f"bf16 curve: {'OK' if r['ok'] else 'FAILED'} finite={r['finite']} first5 "
          f"{r['first5']:.3f} last5 {r['last5']:.3f}; losses "
          + " ".join(f"{v:.3f}" for v in r["losses"][::5]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true",
                        help="the dry run: every check on CPU and gloo, small sizes (--device cpu)")
    parser.add_argument("--worker", default=None, choices=("parity", "curve"))
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--zero", type=int, default=0)
    parser.add_argument("--compile", action="store_true", help="parity: blocks compiled")
    parser.add_argument("--only", default="", help="comma-separated check names (a rerun)")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--result", default="")
    args = parser.parse_args()
    if args.worker:
        result = _worker(args)
        with open(args.result, "w") as f:
            json.dump(result, f)
        return 0
    os.makedirs(args.out, exist_ok=True)
    d = Driver(args.out, "cpu" if args.quick else args.device)
    d.log(f"gpu_check on {args.device}; python {sys.version.split()[0]}")
    # Most valuable first: a run cut short by the host's time limit keeps what it reached.
    checks = (snapshot_check, mfu_check, parity_world1, curve_check, parity_world2)
    only = set(filter(None, args.only.split(",")))
    unknown = only - {c.__name__ for c in checks}
    if unknown:
        parser.error(f"--only: {sorted(unknown)} are not checks; choose from "
                     f"{[c.__name__ for c in checks]}")
    for check in (c for c in checks if not only or c.__name__ in only):
        if d.over_budget(0.95):
            d.log(f"{check.__name__}: skipped (time budget {TOTAL_BUDGET_S} s)")
            continue
        try:
            check(d)
        except Exception as exc:  # one broken check must not lose the others' figures
            d.log(f"{check.__name__}: crashed: {type(exc).__name__}: {exc}")
        d.write_json()
    d.log(f"done in {d.figures['elapsed_s']:.0f} s; all ok: {d.figures['all_ok']}")
    return 0 if d.figures["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
