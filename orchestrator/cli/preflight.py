"""`tenax preflight JOB.yaml [--set ...] [--steps N] [--json]`: smoke-test a job before a long
run (docs/preflight.md), and the gate `tenax run` puts before a job with `--preflight` or a
`preflight:` section. Exit 0 when no row fails, 1 when one does.
"""
from __future__ import annotations

import argparse
import json
import logging
from typing import Any, Callable

from rich.markup import escape

logger = logging.getLogger(__name__)

VERDICT_STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red"}
# `tenax run` runs one job per process: a node the preflight keeps from the job
# (resources.exclude_slow_nodes) stays held while the process lives; Ray releases the hold
# with its owner when the process ends.
HELD_FOR_THE_RUN: list[Any] = []


def at_least_one(text: str) -> int:
    """An argparse type: an integer >= 1 (argparse names the flag in its error), so a bad
    value is refused before Ray or anything else starts."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def print_report(report: Any, console: Any) -> None:
    """The rows as a rich table, then the verdict."""
    from rich.table import Table

    table = Table(title="Preflight")
    for col in ("check", "measured", "expected", "verdict", "detail"):
        table.add_column(col, overflow="fold")
    for row in report.rows:
        style = VERDICT_STYLE[row.verdict]
        table.add_row(row.name, escape(row.measured), escape(row.expected),
                      f"[{style}]{row.verdict}[/{style}]", escape(row.detail))
    console.print(table)
    style = VERDICT_STYLE[report.verdict]
    console.print(f"Preflight verdict: [{style}]{report.verdict}[/{style}]")


def failure_cause(report: Any) -> str:
    """The failing rows, as one line (the run's cause)."""
    return str(report.cause())


def preflight_gate(spec: Any, forced: bool, sink: Callable[[dict[str, Any]], None],
                   console: Any, forkserver: dict[str, Any] | None = None) -> str | None:
    """Before `tenax run` starts the job: the preflight, when `forced` (--preflight) or the
    spec has `preflight:`. The cause to stop on, when it failed and is required (--preflight
    or preflight.required); else None (the job runs)."""
    from tenax.orchestrator.cli.runner import sigterm_interrupts
    from tenax.orchestrator.preflight import PreflightInterrupted, run_preflight
    from tenax.workers import Event

    if not forced and spec.preflight is None:
        return None
    try:
        report = run_preflight(spec, None, lambda kind, f: sink(Event.make(kind, **f).to_dict()),
                               sigterm_interrupts, forkserver=forkserver)
    except PreflightInterrupted as err:
        return str(err)
    print_report(report, console)
    HELD_FOR_THE_RUN.append(report)
    required = forced or (spec.preflight is not None and spec.preflight.required)
    if report.verdict == "fail" and required:
        report.release()
        return failure_cause(report)
    if report.verdict == "fail":
        console.print("[yellow]preflight failed; running anyway (preflight.required is "
                      "false)[/yellow]")
    return None


def cmd_preflight(args: argparse.Namespace) -> int:
    if not args.address:  # an embedded Ray stays on loopback; must precede `import ray`
        from tenax.orchestrator.loopback import loopback_env

        loopback_env()
    from rich.console import Console

    from tenax.orchestrator.cli.runner import ray_session, sigterm_interrupts
    from tenax.orchestrator.preflight import PreflightInterrupted, run_preflight
    from tenax.orchestrator.spec import load_spec

    spec = load_spec(args.spec, args.overrides)
    try:
        with ray_session(args.address, spec) as forkserver:
            report = run_preflight(spec, args.steps, guard=sigterm_interrupts,
                                   forkserver=forkserver)
            report.release()  # no job follows
    except PreflightInterrupted as err:
        Console(stderr=True).print(f"Preflight not finished: {escape(str(err))}.")
        return 1
    if args.json:
        print(json.dumps({"event": "preflight", **report.to_dict()}, indent=2))
    else:
        print_report(report, Console())
    return 1 if report.verdict == "fail" else 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("preflight", help="smoke-test a job on its own placement and layout")
    p.add_argument("spec", nargs="?", help="job spec YAML/JSON (default: the embedded tiny job)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--steps", type=at_least_one, default=None,
                   help="smoke steps (default: preflight.steps of the spec, else 20)")
    p.add_argument("--address", help="Ray cluster address (default: start a local one)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_preflight)
