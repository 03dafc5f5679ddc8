"""Helpers shared by the bench/ scripts: Ray on loopback, timed job runs, report tables, JSON.

Why one module: every benchmark must measure its ratio side by side in one invocation on the
same machine (a shared, noisy host makes absolute times meaningless across runs), and they all
need the same plumbing to do so honestly — a private Ray on 127.0.0.1 that is always shut
down, a controller run whose events carry the wall time they were seen, waits on conditions
with deadlines instead of sleeps, and one table/JSON format so results can be compared.

`bench_env()` must run before the first `import ray` (see orchestrator/loopback.py). Run the
benches from the repo root as `python -m bench.<name>`: the repo root is then importable, so
the small job spec comes from the one module tests use too (`tests.ray_helpers`), with no
sys.path edits.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

# A small job every bench can afford on 2 shared cores: the same job the Ray tests run.
# make_spec (SMALL + extra overrides, checkpoints under a fresh directory) is re-exported to
# the bench scripts.
from tests.ray_helpers import SMALL, make_spec

logger = logging.getLogger(__name__)


def bench_env() -> None:
    """Loopback-only Ray and gloo; call before importing ray."""
    from tenax.orchestrator.loopback import loopback_env

    loopback_env()
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"


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


# ---- Ray ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def local_ray(gpus: int, cpus: int = 4) -> Iterator[dict[str, Any]]:
    """An embedded single-node Ray on 127.0.0.1 with `gpus` fake GPU slots, started the way
    `tenax run` starts one; yields {"tmp", "init_s"}; always shut down."""
    bench_env()
    import ray

    tmp = tempfile.mkdtemp(prefix="tenax-bench-ray-")
    t0 = time.monotonic()
    ray.init(num_cpus=cpus, num_gpus=gpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             _temp_dir=tmp, log_to_driver=False, configure_logging=False)
    info = {"tmp": tmp, "init_s": time.monotonic() - t0}
    logger.info("local Ray up in %.1f s (temp dir %s)", info["init_s"], tmp)
    try:
        yield info
    finally:
        ray.shutdown()


@contextlib.contextmanager
def ray_cluster(gpu_nodes: int, gpus_per_node: int = 2) -> Iterator[tuple[Any, list[Any]]]:
    """cluster_utils: a GPU-less head plus `gpu_nodes` raylets, all on 127.0.0.1."""
    bench_env()
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="tenax-bench-cluster-")
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "num_gpus": 0, "node_ip_address": "127.0.0.1"})
    try:
        nodes = [cluster.add_node(num_cpus=2, num_gpus=gpus_per_node, node_ip_address="127.0.0.1")
                 for _ in range(gpu_nodes)]
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        cluster.wait_for_nodes()
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


# ---- timed job runs ----------------------------------------------------------------------------
class TimedJob:
    """A Controller in a thread; every event gets `t` = time.time() when the controller emitted
    it, and raw rank records (e.g. `started`, which carries `resumed_from`) are kept as well."""

    def __init__(self, spec: Any, chaos: str | None = None) -> None:
        from tenax.orchestrator.chaos.faults import parse_chaos
        from tenax.orchestrator.job.controller import Controller

        self.spec = spec
        self.events: list[dict[str, Any]] = []
        self.records: list[dict[str, Any]] = []
        self.controller = Controller(spec, parse_chaos(chaos), self._on_event)
        self.controller.observers.append(self._observe)
        self.thread = threading.Thread(target=self.controller.run, daemon=True)
        self.started_at = 0.0
        self.finished_at = 0.0

    def _on_event(self, event: dict[str, Any]) -> None:
        self.events.append({**event, "t": time.time()})

    def _observe(self, _: Any, records: list[dict[str, Any]]) -> None:
        now = time.time()
        self.records.extend({**r, "t": now} for r in records if r.get("event") == "started")

    def start(self) -> "TimedJob":
        self.started_at = time.time()
        self.thread.start()
        return self

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if not self.thread.is_alive() and not predicate():
                raise RuntimeError(f"job ended ({self.controller.state.value}) before {what}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {timeout_s:.0f} s; state "
                                   f"{self.controller.state.value}, last events {self.events[-3:]}")
            time.sleep(0.05)

    def finish(self, timeout_s: float) -> "TimedJob":
        self.thread.join(timeout=timeout_s)
        if self.thread.is_alive():
            self.controller.cancel()
            self.thread.join(timeout=60)
            raise TimeoutError(f"job did not finish in {timeout_s:.0f} s: {self.events[-3:]}")
        self.finished_at = time.time()
        return self

    def run(self, timeout_s: float) -> "TimedJob":
        return self.start().finish(timeout_s)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == kind]

    def first_step_after(self, t: float) -> dict[str, Any] | None:
        return next((e for e in self.of("step") if e["t"] >= t), None)

    def losses(self) -> dict[int, float]:
        """Step -> loss; a step redone after a restart keeps its last value."""
        return {e["step"]: e["loss"] for e in self.of("step")}

    def fired(self) -> dict[str, float]:
        """Chaos key -> wall time it fired (from the job's ledger actor)."""
        import ray

        if self.controller.ledger is None:
            return {}
        return ray.get(self.controller.ledger.fired_events.remote(), timeout=30)

    @property
    def state(self) -> str:
        return self.controller.state.value


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


def machine() -> dict[str, Any]:
    import torch

    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
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


def recoveries(job: TimedJob) -> list[dict[str, Any]]:
    """Per `recovered` event: where the ranks resumed from, at which step, how many steps were
    redone and how long the controller took (failure -> started)."""
    return [{k: e.get(k) for k in ("source", "step", "lost_steps", "seconds", "world_size")}
            for e in job.of("recovered")]


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or not den:
        return None
    return num / den
