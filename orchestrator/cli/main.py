"""`tenax` command line: argument parsing and dispatch only.

Commands and flags are pinned by DESIGN.md. Each command prints rich tables for people and,
with `--json`, one JSON document for scripts (sizes in GiB, fractions in 0..1, layouts as
dicts). User errors exit with code 2 and one line naming the bad field and value.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any, Callable

from tenax.checkpoint import register as register_ckpt
from tenax.orchestrator.cli.client import register as register_service
from tenax.orchestrator.cli.data import register as register_data
from tenax.orchestrator.cli.diagnose import register as register_diagnose
from tenax.orchestrator.cli.profile import register as register_profile
from tenax.orchestrator.cli.serve import register as register_serve
from tenax.orchestrator.cli.export import register as register_export
from tenax.orchestrator.cli.preflight import register as register_preflight

logger = logging.getLogger(__name__)

EXIT_USAGE = 2


def _print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2, sort_keys=False))


def _table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in columns:
        left = col in ("schedule", "stage", "layout")
        table.add_column(col, justify="left" if left else "right")
    for row in rows:
        table.add_row(*[f"{v:.4g}" if isinstance(v, float) else str(v) for v in row])
    Console().print(table)


# ---- tenax plan ----------------------------------------------------------------------------
def cmd_plan_memory(args: argparse.Namespace) -> int:
    from tenax.parallel import (ZERO_NAMES, ledger_snapshot_bytes, node_snapshot_footprint,
                                zero_stage_ledgers)

    ledgers = zero_stage_ledgers(args.params_b * 1e9, args.world)
    snap = {z: node_snapshot_footprint(ledger_snapshot_bytes(led), args.gpus_per_node, args.world,
                                       1).to_dict() for z, led in ledgers.items()}
    doc = {"params_b": args.params_b, "world": args.world, "bytes_per_param": 16,
           "stages": {ZERO_NAMES[z]: {"zero": z, **led.to_dict(), "snapshot_memory": snap[z]}
                      for z, led in ledgers.items()}}
    if args.json:
        _print_json(doc)
        return 0
    rows = [[name, s["params_gib"], s["grads_gib"], s["optimizer_gib"], s["model_states_gib"],
             s["snapshot_memory"]["per_node"]["steady"], s["snapshot_memory"]["per_node"]["peak"]]
            for name, s in doc["stages"].items()]
    _table(f"Model states per GPU: {args.params_b}B params, {args.world} GPUs, bf16 + AdamW",
           ["stage", "params GiB", "grads GiB", "optimizer GiB", "total GiB",
            "snap/node", "snap peak/node"], rows)
    print(f"snap: host memory of {snap[1]['what']}, {args.gpus_per_node} GPUs per node")
    return 0


def cmd_plan_comm(args: argparse.Namespace) -> int:
    from tenax.parallel import Network, tp_comm

    comm = tp_comm(args.batch, args.seq, args.hidden, args.tp, args.layers, args.dtype_bytes)
    doc = {"dimension": "tp", "batch": args.batch, "seq": args.seq, "hidden": args.hidden,
           "tp": args.tp, "layers": args.layers, "dtype_bytes": args.dtype_bytes,
           "per_rank_per_step": comm.to_dict(Network().intra),
           "all_reduces_per_layer": 4}
    if args.json:
        _print_json(doc)
        return 0
    c = doc["per_rank_per_step"]
    _table("TP communication per rank per step (4 all-reduces per layer)",
           ["GiB", "ring steps", "time s (intra-node)"], [[c["gib"], c["steps"], c["time_s"]]])
    return 0


def cmd_plan_bubble(args: argparse.Namespace) -> int:
    from tenax.parallel import bubble_table

    table = bubble_table(args.pp, args.microbatches, virtual=args.virtual, F=args.F, B=args.B,
                         W=args.W, FB=args.FB)
    doc = {"pp": args.pp, "microbatches": args.microbatches, "virtual": args.virtual,
           "F": args.F, "B": args.B, "W": args.W, "FB": args.FB,
           "schedules": {name: b.to_dict() for name, b in table.items()}}
    if args.json:
        _print_json(doc)
        return 0
    rows = [[b["label"], b["bubble"], f"{100 * b['fraction']:.1f}%"]
            for b in doc["schedules"].values()]
    _table(f"Pipeline bubble: p={args.pp}, m={args.microbatches}, v={args.virtual}",
           ["schedule", "bubble time", "fraction"], rows)
    return 0


def cmd_plan_layout(args: argparse.Namespace) -> int:
    from tenax.orchestrator.spec import load_spec, plan_for_spec
    from tenax.parallel import DEFAULT_MFU, snapshot_footprint

    options, mem_gib = _gpu_options(args)
    args.mfu = args.mfu or DEFAULT_MFU
    if args.global_batch_size is not None:  # the same as --set train.global_batch_size=N
        args.overrides = [*args.overrides, f"train.global_batch_size={args.global_batch_size}"]
    if args.spec:
        spec = load_spec(args.spec, args.overrides)
        result = plan_for_spec(spec, args.gpus, args.gpus_per_node, mem_gib, mfu=args.mfu,
                               **options)
    else:
        spec, result = _plan_preset(args, options, mem_gib)
    doc = result.to_dict()
    doc["snapshot_memory"] = snapshot_footprint(
        spec.model.args(), result.layout, args.gpus_per_node, spec.checkpoint.memory_every_steps,
        spec.train.dtype).to_dict()
    if args.json:
        _print_json(doc)
        return 0
    _print_plan(doc)
    return 0


def _plan_preset(args: argparse.Namespace, options: dict[str, Any],
                 mem_gib: float | None) -> tuple[Any, Any]:
    """A preset names only a model: every degree, the batch split, recompute and precision
    (bf16 mixed) are free, except the keys the user --set, whatever else is pinned (to evaluate
    a published configuration). The global batch defaults to the planner's 4 per GPU."""
    from tenax.orchestrator.spec import load_spec
    from tenax.parallel import Cluster, PlanOptions, plan_layout, precision, slot_memory_gib

    keys = {o.split("=", 1)[0].strip() for o in args.overrides}
    loaded = [f"train.global_batch_size={4 * args.gpus}", "parallel.micro_batch_size=1"]
    # Defaults only for loading (the spec checks dp*micro_batch against the batch): the user's
    # --set come after them and win; an unset micro-batch stays free for the planner.
    spec = load_spec(preset=args.model_preset, overrides=loaded + args.overrides)
    pinned = {k.split(".", 1)[1] for k in keys if k.startswith("parallel.")}
    fixed = {k: getattr(spec.parallel, k) for k in pinned if k != "recompute"}
    dtype = precision(spec.train.dtype) if "train.dtype" in keys else {}
    mem = mem_gib or slot_memory_gib(spec.resources.device, args.gpus_per_node)
    return spec, plan_layout(spec.model.args(),
                             Cluster(args.gpus, args.gpus_per_node, mem, **options),
                             PlanOptions(spec.train.global_batch_size, spec.model.seq_len, fixed,
                                         mfu=args.mfu, recompute=spec.parallel.recompute,
                                         **dtype))


def _gpu_options(args: argparse.Namespace) -> tuple[dict[str, Any], float | None]:
    """`--gpu NAME` and its override flags -> planner `Cluster` options and GiB per GPU (None:
    80 GiB GPUs, or a CPU slot's share of host RAM for `resources.device: cpu`)."""
    from tenax.parallel import gpu_model, planner_options

    if args.gpu is None:
        return {}, args.gpu_mem_gib
    scale = {"peak_tflops": ("peak_bf16_flops", 1e12), "hbm_gb": ("hbm_gb", 1.0),
             "hbm_tbps": ("hbm_bandwidth_Bps", 1e12), "nvlink_gbps": ("nvlink_Bps", 1e9),
             "internode_gbps": ("internode_Bps", 1e9)}
    overrides = {field: getattr(args, flag) * k if getattr(args, flag) is not None else None
                 for flag, (field, k) in scale.items()}
    gpu = gpu_model(args.gpu, **overrides)
    return planner_options(gpu), args.gpu_mem_gib or gpu.hbm_gib


def _print_plan(doc: dict[str, Any]) -> None:
    from rich.console import Console

    best, chosen = doc["estimate"], doc["chosen"]
    Console().print(f"[bold]Chosen layout[/bold]: {best['describe']}  "
                    f"(recompute {best['recompute']}, {best['microbatches']} micro-batches)\n"
                    f"why: {doc['reason']}\n"
                    f"per GPU {chosen['memory_per_gpu_gib']:.1f} GiB, "
                    f"step {chosen['step_time_s']:.4g} s, "
                    f"{chosen['tokens_per_s']:.4g} tokens/s, MFU {100 * chosen['mfu']:.1f}% "
                    f"(assumes {100 * doc['hardware']['mfu_assumed']:.0f}% of peak while "
                    "computing)")
    for warning in doc["warnings"]:
        Console().print(f"[yellow]warning[/yellow]: {warning}")
    if "snapshot_memory" in doc:
        Console().print(doc["snapshot_memory"]["summary"], markup=False)
    rows = [[best["describe"], best["memory"]["total_gib"], best["step_time"]["total_s"],
             best["tokens_per_s"], "chosen"]]
    rows += [[r["describe"], r["memory"]["total_gib"], r["step_time"]["total_s"],
              r["tokens_per_s"], r["reason"]] for r in doc["runners_up"]]
    _table(f"{doc['gpus']} GPUs, {doc['gpus_per_node']} per node, budget "
           f"{doc['memory_budget_gib']:.1f} GiB/GPU", ["layout", "GiB/GPU", "step s", "tokens/s",
                                                      "why"], rows)
    if doc["rejected"]:
        _table("Rejected", ["reason", "count"], [[k, v] for k, v in doc["rejected"].items()])


# ---- parser --------------------------------------------------------------------------------
def share_of_peak(text: str) -> float:
    """`--mfu`'s value: a number in (0, 1] (argparse names the flag in its error)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value} is not in (0, 1]: a share of the peak")
    return value


def _add_plan(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser("plan", help="cost model and layout planner").add_subparsers(
        dest="what", required=True)
    p = plan.add_parser("memory", help="model-state memory per GPU for each ZeRO stage")
    p.add_argument("--params-b", type=float, required=True, help="parameters, in billions")
    p.add_argument("--world", type=int, required=True, help="data-parallel GPUs")
    p.add_argument("--gpus-per-node", type=int, default=8,
                   help="for the in-memory snapshots' host memory per node (default 8)")
    p.set_defaults(func=cmd_plan_memory)
    p = plan.add_parser("comm", help="TP communication per rank per step")
    for flag in ("--batch", "--seq", "--hidden", "--tp", "--layers"):
        p.add_argument(flag, type=int, required=True)
    p.add_argument("--dtype-bytes", type=float, default=2)
    p.set_defaults(func=cmd_plan_comm)
    p = plan.add_parser("bubble", help="pipeline bubble of each schedule")
    p.add_argument("--pp", type=int, required=True)
    p.add_argument("--microbatches", type=int, required=True)
    p.add_argument("--virtual", type=int, default=1)
    for flag, default in (("--F", 1.0), ("--B", 2.0), ("--W", 0.5), ("--FB", 2.0)):
        p.add_argument(flag, type=float, default=default)
    p.set_defaults(func=cmd_plan_bubble)
    p = plan.add_parser("layout", help="best parallel layout for a model on a cluster")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--spec", help="job spec YAML/JSON")
    from tenax.orchestrator.presets import PRESETS

    src.add_argument("--model-preset", help=", ".join(PRESETS))
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--gpu-mem-gib", type=float, default=None,
                   help="default: the --gpu's HBM, or 80")
    p.add_argument("--gpu", choices=("a100", "h100", "h200", "b200"), default=None,
                   help="vendor figures: peak dense bf16, HBM, NVLink, NIC (override below)")
    for flag, unit in (("--peak-tflops", "dense bf16 TFLOP/s"), ("--hbm-gb", "GB"),
                       ("--hbm-tbps", "TB/s"), ("--nvlink-gbps", "GB/s per direction"),
                       ("--internode-gbps", "GB/s per GPU")):
        p.add_argument(flag, type=float, default=None, help=f"override the --gpu's {unit}")
    p.add_argument("--mfu", type=share_of_peak, default=None, metavar="SHARE",
                   help="share of peak sustained while computing, in (0, 1] (default: the "
                        "planner's assumption, printed with the plan; compiled blocks reach more)")
    p.add_argument("--global-batch-size", type=int, default=None,
                   help="sequences per step, as --set train.global_batch_size (preset default: "
                        "4 per GPU)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.set_defaults(func=cmd_plan_layout)
    for parser in plan.choices.values():
        parser.add_argument("--json", action="store_true", help="machine-readable output")


def cmd_run(args: argparse.Namespace) -> int:
    if not args.address:  # an embedded Ray stays on loopback; must precede `import ray`
        from tenax.orchestrator.loopback import loopback_env

        loopback_env()
    from tenax.orchestrator.cli.runner import run_job
    from tenax.orchestrator.spec import load_spec

    if args.profile_steps is not None:  # the same as --set train.profile_steps=[A,B]
        from tenax.workers import parse_profile_steps

        first, last = parse_profile_steps(args.profile_steps)
        args.overrides = [*args.overrides, f"train.profile_steps=[{first},{last}]"]
    spec = load_spec(args.spec, args.overrides)
    return run_job(spec, args.chaos, args.log_json, args.address, args.metrics_port,
                   args.preflight)


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run a job in the foreground on Ray (embedded if no --address)")
    p.add_argument("spec", nargs="?", help="job spec YAML/JSON (default: the embedded tiny job)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--chaos", help='faults to inject, e.g. "kill rank=1 at=30; hang rank=0 at=50"')
    p.add_argument("--log-json", help="append one JSON object per event to this file")
    p.add_argument("--address", help="Ray cluster address (default: start a local one)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    p.add_argument("--preflight", action="store_true",
                   help="smoke-test the job first and run it only if no check fails")
    p.add_argument("--profile-steps", metavar="A:B",
                   help="every rank keeps a torch.profiler trace of steps A..B (Chrome JSON) "
                        "under <checkpoint.uri>/diagnostics/")
    p.set_defaults(func=cmd_run)


REGISTRARS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_run, _add_plan, register_data, register_ckpt, register_serve, register_service,
    register_diagnose, register_profile]


def version_line() -> str:
    """What a bug report needs: Tenax's version and the torch, Ray and Python it runs on (read
    from the installed distributions: nothing is imported)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    from tenax import __version__

    def of(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "not installed"

    return (f"tenax {__version__} (torch {of('torch')}, ray {of('ray')}, "
            f"python {platform.python_version()})")


class VersionAction(argparse.Action):
    """`--version`, computed only when asked: every other command starts without the lookups."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS,
                 default: Any = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        print(version_line())  # stdout, as argparse prints its own version
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tenax",
                                     description="Fault-tolerant, elastic LLM training")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("-V", "--version", action=VersionAction,
                        help="print the versions of Tenax, torch, Ray and Python, and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    for register in REGISTRARS:
        register(sub)
    register_export(sub)
    register_preflight(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from tenax.orchestrator.errors import ChaosError
    from tenax.orchestrator.spec import SpecError
    from tenax.parallel import LayoutError, PlanError

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (SpecError, LayoutError, PlanError, ChaosError, ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
