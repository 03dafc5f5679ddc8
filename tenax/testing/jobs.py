"""Real jobs for tests and benchmarks: a small spec, a Controller run in a thread with every
event kept and timed, the single-process reference losses, and `tenax` CLI runs with a JSON
event log.

Ray must already run (`tenax.testing.clusters`) before a `JobRun` starts.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

logger = logging.getLogger(__name__)

# A job every test and bench can afford on 2 shared cores.
SMALL = ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
         "model.vocab_size=64", "model.seq_len=32", "model.ffn_hidden=64",
         "train.global_batch_size=8", "parallel.micro_batch_size=1", "train.lr=3e-3",
         "train.warmup_steps=2", "checkpoint.every_steps=5", "checkpoint.keep_last=3",
         "fault_tolerance.heartbeat_interval_s=0.25", "fault_tolerance.heartbeat_timeout_s=4",
         "fault_tolerance.hang_timeout_s=20", "resources.device=cpu"]


def job_overrides(root: Any, name: str, extra: list[str]) -> list[str]:
    """SMALL, then checkpoints under a fresh directory of `root`, the name, then `extra`."""
    uri = f"file://{root}/{name}-{time.monotonic_ns()}"
    return SMALL + [f"checkpoint.uri={uri}", f"name={name}"] + extra


def make_spec(root: Any, extra: list[str], name: str = "job") -> Any:
    """The validated spec of `job_overrides(root, name, extra)`."""
    from tenax.orchestrator.spec import load_spec

    return load_spec(overrides=job_overrides(root, name, extra))


class JobRun:
    """A Controller in a thread. Every event it publishes is kept with `t`, the wall time
    (time.time()) it was seen; the ranks' raw `started` records (which carry `resumed_from`)
    are kept the same way in `records`."""

    def __init__(self, spec: Any, chaos: str | None = None,
                 forkserver: dict[str, Any] | None = None) -> None:
        from tenax.orchestrator.chaos.faults import parse_chaos
        from tenax.orchestrator.job.controller import Controller, ControllerOptions

        self.spec = spec
        self.events: list[dict[str, Any]] = []
        self.records: list[dict[str, Any]] = []
        self.controller = Controller(spec, ControllerOptions(chaos=parse_chaos(chaos),
                                                             on_event=self._on_event,
                                                             forkserver=forkserver))
        self.controller.add_observer(self._observe)
        self.thread = threading.Thread(target=self.controller.run, daemon=True)
        self.started_at = 0.0
        self.finished_at = 0.0

    def _on_event(self, event: dict[str, Any]) -> None:
        self.events.append({**event, "t": time.time()})

    def _observe(self, _: Any, records: list[dict[str, Any]]) -> None:
        now = time.time()
        self.records.extend({**r, "t": now} for r in records if r.get("event") == "started")

    def start(self) -> "JobRun":
        self.started_at = time.time()
        self.thread.start()
        return self

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Until `predicate()` holds; raises once the job ended without it or at the deadline."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if not self.thread.is_alive() and not predicate():
                raise RuntimeError(f"job ended ({self.state}) before {what}; "
                                   f"last events {self.events[-5:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {timeout_s:.0f} s; state {self.state}, "
                                   f"last events {self.events[-5:]}")
            time.sleep(0.05)

    def finish(self, timeout_s: float = 240) -> "JobRun":
        """Wait for the job to end; past `timeout_s` it is cancelled and this raises."""
        self.thread.join(timeout=timeout_s)
        if self.thread.is_alive():
            self.controller.cancel()
            self.thread.join(timeout=60)
            raise TimeoutError(f"job did not finish in {timeout_s:.0f} s: {self.events[-5:]}")
        self.finished_at = time.time()
        return self

    def run(self, timeout_s: float = 240) -> "JobRun":
        return self.start().finish(timeout_s)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == kind]

    def first_step_after(self, t: float) -> dict[str, Any] | None:
        return next((e for e in self.of("step") if e["t"] >= t), None)

    def losses(self) -> dict[int, float]:
        """Step -> loss, the last value seen for a step (steps redone after a restart win)."""
        return {e["step"]: e["loss"] for e in self.of("step")}

    def fired(self) -> dict[str, float]:
        """Chaos key -> wall time it fired (from the job's ledger actor)."""
        import ray

        chaos = self.controller.chaos
        if chaos is None or chaos.ledger is None:
            return {}
        return ray.get(chaos.ledger.fired_events.remote(), timeout=30)

    @property
    def state(self) -> str:
        return self.controller.state.value


def run_job(spec: Any, chaos: str | None = None, timeout_s: float = 240) -> JobRun:
    return JobRun(spec, chaos).run(timeout_s)


def mismatched_steps(got: dict[int, float], want: dict[int, float], from_step: int = 1,
                     rel: float = 1e-5) -> list[int]:
    """Steps of `want` (from `from_step` on) that `got` lacks or whose loss differs by more
    than `rel` of `want`'s (a NaN differs)."""
    return [step for step, loss in sorted(want.items()) if step >= from_step and not (
        step in got and abs(got[step] - loss) <= rel * abs(loss))]


def assert_same_losses(got: dict[int, float], want: dict[int, float], from_step: int = 1) -> None:
    """Raise AssertionError naming every step whose loss is missing or differs (1e-5 rel)."""
    bad = mismatched_steps(got, want, from_step)
    if bad:
        raise AssertionError("losses differ from the reference at steps " + ", ".join(
            f"{s} ({got.get(s, 'missing')} vs {want[s]})" for s in bad))


_REFERENCES: dict[str, dict[int, float]] = {}


def reference_losses(spec: Any, timeout_s: float = 300) -> dict[int, float]:
    """Step -> loss of `spec`'s model, data and training settings run by one process.

    Why a fault test may compare with this instead of a clean multi-rank run of its own: every
    layout matches the single-process run (the parity tests hold each one to it at 1e-5), and
    one process is several times cheaper than placing and running the clean job on Ray. Cached
    per model/train/data settings, which many tests share."""
    doc = spec.to_dict()
    key = json.dumps({k: doc[k] for k in ("model", "train", "data")} |
                     {"mbs": doc["parallel"]["micro_batch_size"]}, sort_keys=True)
    if key not in _REFERENCES:
        _REFERENCES[key] = _single_process_losses(doc, timeout_s)
    return dict(_REFERENCES[key])


def _single_process_losses(doc: dict[str, Any], timeout_s: float) -> dict[int, float]:
    from tenax.parallel.layout import ParallelLayout
    from tenax.testing.ranks import rank_context
    from tenax.workers.launch import launch

    layout = ParallelLayout(dp=1, zero=0, micro_batch_size=doc["parallel"]["micro_batch_size"])
    steps = doc["train"]["steps"]
    doc["checkpoint"] = {**doc["checkpoint"], "every_steps": steps, "memory_every_steps": 0,
                         "uri": f"file://{tempfile.mkdtemp(prefix='tenax-reference-')}"}
    losses: dict[int, float] = {}
    failures: list[dict[str, Any]] = []

    def on_event(event: dict[str, Any]) -> None:
        if event.get("event") == "step":
            losses[event["step"]] = event["loss"]
        elif event.get("event") == "failure":
            failures.append(event)

    ok = launch(doc, layout.to_dict(), 1, on_event, timeout_s, rank_context())
    if not ok or sorted(losses) != list(range(1, steps + 1)):
        raise RuntimeError(f"single-process reference failed: {failures or sorted(losses)}")
    return losses


# ---- the command line --------------------------------------------------------------------
def run_cli(args: list[str], env: dict[str, str] | None = None, timeout_s: float = 120,
            cwd: Path | str | None = None) -> subprocess.CompletedProcess:
    """`tenax ARGS` in a subprocess (this interpreter), output captured as text; `env` is
    added to this process's environment."""
    return subprocess.run([sys.executable, "-m", "tenax.orchestrator.cli.main", *args], cwd=cwd,
                          env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout_s)


def read_events(log: Path | str) -> list[dict[str, Any]]:
    """The events of a `--log-json` file, in order."""
    return [json.loads(line) for line in Path(log).read_text().splitlines() if line.strip()]
