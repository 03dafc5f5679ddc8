"""Cold start: launch -> first step of `tenax run` vs torchrun on the same workload, and where
Tenax's time goes; plus a killed rank -> resumed step (the warm restart must not get slower).

    python -m bench.cold_start_bench [--quick] [--json PATH] [--worlds 2,4] [--reps R]
                                     [--kills K] [--no-grow]

Why side by side: a cold start on a shared host moves with its load, so only a ratio measured in
one run means anything. The baseline is what a user would otherwise type: `torchrun` of a plain
DDP script (this module's `plain_worker`: gloo, the same decoder, AdamW, random tokens).
Tenax is `tenax run` with an embedded Ray, the same shape (Llama-like: dim 256, 4 layers, 8
heads, vocab 512, seq 128, global batch 16, dp = world, ZeRO 0, one micro-batch per rank).
Launch is the bench's clock just before the command starts; the first step is rank 0's wall
clock at the end of step 1 (both sides stamp it the same way). Runs interleave (torchrun,
Tenax, torchrun, ...) so load hits both alike; the figure is the median over reps of
torchrun ÷ Tenax (goal >= 0.8). Each Tenax run's `done` event carries its `cold_start`
breakdown (orchestrator/job/goodput_cold_start.py), reported as each phase's median seconds.
Tenax's modules are byte-compiled first, as a wheel's install does: where
PYTHONDONTWRITEBYTECODE is set (this host, the image) an editable install would otherwise
compile them in every process at every start (bench/RESULTS.md).
The recovery row is the first Tenax run of the largest world (`--quick`: the smallest) run
with `--chaos "kill rank=1 at=5; kill rank=1 at=10; ..."` (`--kills`, default 3; `--quick` 1):
the median over the kills of the failure event -> the first step after `recovered` (what a
killed rank costs; it must not grow with cold-start work). The grow row (not with `--quick` or
`--no-grow`) starts the largest world's job on half its ranks with room for two node blocks and
asks for the second at step 5 (`--chaos "scale nodes=2 at=5"`): the scale request -> the first
step on the grown layout (a new block: placement group, agents, their zygote, rendezvous, the
resharded restore).
"""
from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from tenax.testing.scripts import exit_unless_run_as_module

exit_unless_run_as_module(__spec__, __file__)  # a path run stops here, before `bench.`

logger = logging.getLogger(__name__)

SHAPE = dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=512, seq_len=128,
             ffn_hidden=688)
GLOBAL_BATCH, STEPS, TIMEOUT_S = 16, 3, 600


def plain_worker(steps: int, out: str) -> None:
    """One torchrun rank: what a plain DDP script does before and at its first step."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from tenax.parallel.config import ModelArgs
    from tenax.parallel.model import build_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = ModelArgs(**SHAPE)
    model = DistributedDataParallel(build_model(cfg, seed=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    gen = torch.Generator().manual_seed(rank)
    ends = []
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab_size, (GLOBAL_BATCH // world, cfg.seq_len + 1),
                               generator=gen)
        loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, cfg.vocab_size).float(),
                               tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss.item()
        ends.append(time.time())
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"step_end": ends}, f)
    dist.destroy_process_group()


def _env() -> dict[str, str]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get(
        "PYTHONPATH")])), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")


def run_torchrun(world: int, tmp: str) -> float:
    """Launch -> rank 0's first step end of torchrun + the plain script."""
    out = os.path.join(tmp, f"plain-{world}-{time.monotonic_ns()}.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={world}", "-m", "bench.cold_start_bench", "--plain-worker", out]
    launched = time.time()
    subprocess.run(cmd, env=_env(), check=True, capture_output=True, timeout=TIMEOUT_S)
    with open(out) as f:
        return json.load(f)["step_end"][0] - launched


def tenax_sets(world: int, tmp: str, steps: int) -> list[str]:
    return [f"model.{k}={v}" for k, v in SHAPE.items()] + [
        f"parallel.dp={world}", "parallel.zero=0",
        f"parallel.micro_batch_size={GLOBAL_BATCH // world}",
        f"train.global_batch_size={GLOBAL_BATCH}", f"train.steps={steps}",
        "train.warmup_steps=0", "checkpoint.every_steps=5",
        f"checkpoint.uri=file://{tempfile.mkdtemp(dir=tmp)}", "resources.device=cpu",
        "resources.nodes=1", f"resources.gpus_per_node={world}", "name=coldstart"]


def run_tenax(world: int, tmp: str, steps: int = STEPS,
              chaos: str | None = None) -> tuple[float, list[dict[str, Any]]]:
    """Launch -> rank 0's first step end of `tenax run`, and the run's events."""
    log = os.path.join(tmp, f"tenax-{world}-{time.monotonic_ns()}.jsonl")
    cmd = [sys.executable, "-m", "tenax.orchestrator.cli.main", "run", "--log-json", log]
    for s in tenax_sets(world, tmp, steps):
        cmd += ["--set", s]
    if chaos:
        cmd += ["--chaos", chaos]
    launched = time.time()
    subprocess.run(cmd, env=_env(), check=True, capture_output=True, timeout=TIMEOUT_S)
    with open(log) as f:
        events = [json.loads(line) for line in f if line.strip()]
    first = next(e for e in events if e["event"] == "step")
    return first["time"] - launched, events


def measure(world: int, reps: int, tmp: str, kills: int = 0) -> dict[str, Any]:
    """`kills`: the first Tenax run is also the recovery case, with that many kills (its cold
    start counts alike: the first kill comes after step 5), which keeps `--quick` short."""
    plain, tenax, phases, case = [], [], [], {}
    for rep in range(reps):
        plain.append(run_torchrun(world, tmp))
        if kills and rep == 0:
            chaos = "; ".join(f"kill rank=1 at={5 * (k + 1)}" for k in range(kills))
            seconds, events = run_tenax(world, tmp, steps=5 * kills + 5, chaos=chaos)
            case = recovery(world, events)
        else:
            seconds, events = run_tenax(world, tmp)
        tenax.append(seconds)
        done = next(e for e in events if e["event"] == "done")
        phases.append(done["cold_start"])
        logger.info("world %d rep %d: torchrun %.2f s, tenax %.2f s", world, rep, plain[-1],
                    tenax[-1])
    ratios = [p / t for p, t in zip(plain, tenax)]
    return {"world": world, "torchrun_s": plain, "tenax_s": tenax, "ratios": ratios,
            "ratio": statistics.median(ratios), "cold_start": phases, "kill": case}


def recovery(world: int, events: list[dict[str, Any]]) -> dict[str, Any]:
    """A `kill rank=1` run: each failure event -> the first step after its `recovered`."""
    resumes, controller, sources, lost = [], [], set(), 0
    for failure in (e for e in events if e["event"] == "failure"):
        recovered = next(e for e in events
                         if e["event"] == "recovered" and e["time"] >= failure["time"])
        resumed = next(e for e in events
                       if e["event"] == "step" and e["time"] >= recovered["time"])
        resumes.append(resumed["time"] - failure["time"])
        controller.append(recovered["seconds"])
        sources.add(recovered["source"])
        lost += recovered["lost_steps"]
    return {"world": world, "resume_s": statistics.median(resumes), "resumes_s": resumes,
            "controller_s": statistics.median(controller), "source": "/".join(sorted(sources)),
            "lost_steps": lost, "kills": len(resumes)}


def grow(world: int, tmp: str) -> dict[str, Any]:
    """Half of `world`'s ranks on one node block, then a second block asked for at step 5: the
    scale request -> the first step on the grown layout."""
    sets = [s for s in tenax_sets(world, tmp, 10)
            if not s.startswith(("parallel.dp=", "resources.gpus_per_node="))]
    sets += [f"resources.gpus_per_node={world // 2}", "resources.max_nodes=2"]
    log = os.path.join(tmp, f"grow-{world}-{time.monotonic_ns()}.jsonl")
    cmd = [sys.executable, "-m", "tenax.orchestrator.cli.main", "run", "--log-json", log,
           "--chaos", "scale nodes=2 at=5"]
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, env=_env(), check=True, capture_output=True, timeout=TIMEOUT_S)
    with open(log) as f:
        events = [json.loads(line) for line in f if line.strip()]
    asked = next(e for e in events if e["event"] == "chaos" and e.get("kind") == "scale")
    scaled = next(e for e in events if e["event"] == "scaled")
    first = next(e for e in events if e["event"] == "step" and e["time"] >= scaled["time"])
    return {"world": world, "from_world": scaled["from_world"],
            "world_after": scaled["world_size"], "grow_s": first["time"] - asked["time"],
            "controller_s": scaled["seconds"], "lost_steps": scaled["lost_steps"]}


def median_phases(breakdowns: list[dict[str, float]]) -> dict[str, float]:
    from tenax.orchestrator.job.goodput_cold_start import durations

    spans = [durations(b) for b in breakdowns]
    return {p: statistics.median(s[p] for s in spans) for p in spans[0]}


def report(cases: list[dict[str, Any]], kill: dict[str, Any], grown: dict[str, Any] | None,
           quick: bool, json_path: str | None) -> None:
    from bench.common import Report

    rep = Report("Cold start: launch → first step, torchrun ÷ Tenax (embedded Ray), one run")
    for case in cases:
        w = case["world"]
        rep.add(f"{w} ranks: torchrun ÷ Tenax", case["ratio"], ">= 0.8",
                f"torchrun {statistics.median(case['torchrun_s']):.2f} s, Tenax "
                f"{statistics.median(case['tenax_s']):.2f} s (medians of "
                f"{len(case['ratios'])})")
        for phase, seconds in median_phases(case["cold_start"]).items():
            rep.add(f"  {w} ranks: {phase}", seconds, unit="s",
                    note="seconds in this phase of Tenax's cold start (median)")
    rep.add(f"{kill['world']} ranks: failure → resumed step", kill["resume_s"], unit="s",
            note=f"median of {kill['kills']}; controller {kill['controller_s']:.2f} s; from "
            f"{kill['source']}, {kill['lost_steps']} step(s) lost in all")
    if grown is not None:
        rep.add(f"grow {grown['from_world']} → {grown['world_after']} ranks: request → first "
                "step", grown["grow_s"], unit="s",
                note=f"controller {grown['controller_s']:.2f} s; {grown['lost_steps']} step(s) "
                "lost")
    rep.context = {"quick": quick, "cases": cases, "grow": grown}
    rep.finish(json_path)


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--plain-worker":  # a torchrun rank
        plain_worker(STEPS, sys.argv[2])
        return 0
    from bench.common import compile_tenax, parse_args

    args = parse_args(__doc__, lambda p: (p.add_argument("--worlds", default="2,4"),
                                          p.add_argument("--reps", type=int, default=0),
                                          p.add_argument("--kills", type=int, default=0),
                                          p.add_argument("--no-grow", action="store_true")))
    worlds = [int(w) for w in args.worlds.split(",")]
    reps = args.reps or (1 if args.quick else 3)
    kills = args.kills or (1 if args.quick else 3)
    killed = min(worlds) if args.quick else max(worlds)
    compile_tenax()  # as installed from a wheel: no side compiles its sources at each start
    with tempfile.TemporaryDirectory(prefix="tenax-coldstart-") as tmp:
        cases = [measure(w, reps, tmp, kills=kills if w == killed else 0) for w in worlds]
        grown = None if args.quick or args.no_grow or max(worlds) < 2 else grow(max(worlds), tmp)
    report(cases, next(c["kill"] for c in cases if c["kill"]), grown, args.quick,
           args.json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
