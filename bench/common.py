"""Helpers shared by the bench/ scripts: flags, report tables, JSON, small figures of a run.

Why one module: every benchmark must measure its ratio side by side in one invocation on the
same machine (a shared, noisy host makes absolute times meaningless across runs), and they all
report the same way so results can be compared: one table/JSON format with a goal per row.
Ray on loopback, the small job spec and timed controller runs come from `tenax.testing`, the
harness the test suite uses too.

Run the benches from the repository root as `python -m bench.<name>`.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from tenax.testing.jobs import JobRun

logger = logging.getLogger(__name__)


def parse_args(description: str, extra: Callable[[argparse.ArgumentParser], None] | None = None
               ) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description.strip().splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI-sized run")
    parser.add_argument("--json", dest="json_path", metavar="PATH",
                        help="write the results as JSON here")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    if extra is not None:
        extra(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return args


# ---- reports -----------------------------------------------------------------------------------
@dataclass
class Row:
    """One measured figure; `goal` like '<= 1.2', '>= 0.95' or '== 1 ±0.01' (relative
    tolerance; empty goal: context only)."""
    name: str
    value: float | None
    goal: str = ""
    note: str = ""
    unit: str = ""

    @property
    def met(self) -> bool | None:
        if not self.goal or self.value is None:
            return None
        op, target, *tol = self.goal.split()
        target_f = float(target)
        if op == "==":
            rel = float(tol[0].lstrip("±")) if tol else 1e-9
            return abs(self.value - target_f) <= rel * max(abs(target_f), 1e-12)
        return {"<=": self.value <= target_f, ">=": self.value >= target_f}[op]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "met": self.met}


@dataclass
class Report:
    title: str
    rows: list[Row] = field(default_factory=list)
    context: dict[str, Any] = field(default_factory=dict)

    def add(self, name: str, value: float | None, goal: str = "", note: str = "",
            unit: str = "") -> Row:
        row = Row(name, None if value is None else float(value), goal, note, unit)
        self.rows.append(row)
        return row

    def to_dict(self) -> dict[str, Any]:
        return {"title": self.title, "machine": machine(), "rows": [r.to_dict() for r in self.rows],
                "context": self.context}

    def print(self) -> None:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=self.title)
        for col in ("measure", "value", "goal", "met", "note"):
            table.add_column(col, justify="right" if col == "value" else "left")
        for r in self.rows:
            value = "n/a" if r.value is None else f"{r.value:.4g}{(' ' + r.unit) if r.unit else ''}"
            met = {True: "[green]yes[/green]", False: "[red]no[/red]", None: ""}[r.met]
            table.add_row(r.name, value, r.goal, met, r.note)
        Console().print(table)

    def finish(self, json_path: str | None) -> None:
        self.print()
        if json_path:
            write_json(json_path, self.to_dict())


TENAX_PACKAGES = ("tenax", "tenax.orchestrator", "tenax.workers", "tenax.checkpoint",
                  "tenax.parallel", "tenax.testing")


def compile_tenax() -> int:
    """Byte-compile Tenax's modules, as `pip install` of a wheel does (the image's `pip
    install .` too); returns how many package folders compiled without an error. An editable
    install writes its bytecode on first import, except where PYTHONDONTWRITEBYTECODE is set
    (this host, the image): there every process that imports Tenax compiles its sources again
    (~0.1 s of CPU in the CLI alone), which a start-up bench would otherwise charge to Tenax."""
    import compileall
    import importlib

    folders = [path for name in TENAX_PACKAGES for path in importlib.import_module(name).__path__]
    compiled = sum(bool(compileall.compile_dir(path, quiet=1)) for path in folders)
    logger.info("byte-compiled Tenax's %d package folders (%d without an error)", len(folders),
                compiled)
    return compiled


def machine() -> dict[str, Any]:
    import torch

    return {"cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__, "device": "cuda" if torch.cuda.is_available() else "cpu",
            "backend": "nccl" if torch.cuda.is_available() else "gloo",
            "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def write_json(path: str, payload: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)
    logger.info("wrote %s", path)


def snapshot_leftovers(job_prefix: str) -> list[str]:
    """In-memory snapshot directories (checkpoint/memory/snapshot_store.py) of jobs whose id starts
    with `job_prefix` that are still on this host: a finished job must leave none."""
    from tenax.checkpoint.memory.snapshot_store import snapshot_root

    root = snapshot_root()
    try:
        return sorted(os.path.join(root, n) for n in os.listdir(root) if n.startswith(job_prefix))
    except FileNotFoundError:
        return []


def recoveries(job: JobRun) -> list[dict[str, Any]]:
    """Per `recovered` event: where the ranks resumed from, at which step, how many steps were
    redone and how long the controller took (failure -> started)."""
    return [{k: e.get(k) for k in ("source", "step", "lost_steps", "seconds", "world_size")}
            for e in job.of("recovered")]


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or not den:
        return None
    return num / den
