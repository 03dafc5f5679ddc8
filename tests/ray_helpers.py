"""Helpers for tests that run real jobs on real Ray (local or cluster_utils) on 127.0.0.1."""
from __future__ import annotations

import json
import tempfile
import threading
import time
from typing import Any, Callable

SMALL = ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
         "model.vocab_size=64", "model.seq_len=32", "model.ffn_hidden=64",
         "train.global_batch_size=8", "parallel.micro_batch_size=1", "train.lr=3e-3",
         "train.warmup_steps=2", "checkpoint.every_steps=5", "checkpoint.keep_last=3",
         "fault_tolerance.heartbeat_interval_s=0.25", "fault_tolerance.heartbeat_timeout_s=4",
         "fault_tolerance.hang_timeout_s=20", "resources.device=cpu"]


def ray_env() -> None:
    """Loopback-only Ray and gloo (conftest already did this before Ray was imported)."""
    from tenax.orchestrator.loopback import loopback_env

    loopback_env()


def start_local_ray(gpus: int) -> str:
    import ray

    ray_env()
    tmp = tempfile.mkdtemp(prefix="tenax-test-ray-")
    ray.init(num_cpus=4, num_gpus=gpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             _temp_dir=tmp, log_to_driver=False, configure_logging=False)
    return tmp


def make_spec(tmp_path: Any, extra: list[str], name: str = "job"):
    from tenax.orchestrator.spec import load_spec

    uri = f"file://{tmp_path}/{name}-{time.monotonic_ns()}"
    return load_spec(overrides=SMALL + [f"checkpoint.uri={uri}", f"name={name}"] + extra)


class JobRun:
    """Runs a Controller in a thread, collecting its events."""

    def __init__(self, spec: Any, chaos: str | None = None) -> None:
        from tenax.orchestrator.chaos.faults import parse_chaos
        from tenax.orchestrator.job.controller import Controller

        self.events: list[dict[str, Any]] = []
        self.controller = Controller(spec, parse_chaos(chaos), self.events.append)
        self.thread = threading.Thread(target=self.controller.run, daemon=True)

    def start(self) -> "JobRun":
        self.thread.start()
        return self

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; "
                                     f"state {self.controller.state}, last events {self.events[-5:]}")
            time.sleep(0.1)

    def finish(self, timeout_s: float = 240) -> "JobRun":
        self.thread.join(timeout=timeout_s)
        if self.thread.is_alive():
            self.controller.cancel()
            self.thread.join(timeout=30)
            raise AssertionError(f"job did not finish in {timeout_s} s: {self.events[-5:]}")
        return self

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == kind]

    def losses(self) -> dict[int, float]:
        """Step -> loss, the last value seen for a step (steps redone after a restart win)."""
        return {e["step"]: e["loss"] for e in self.of("step")}


def run_job(spec: Any, chaos: str | None = None, timeout_s: float = 240) -> JobRun:
    return JobRun(spec, chaos).start().finish(timeout_s)


def assert_same_losses(got: dict[int, float], want: dict[int, float], from_step: int = 1) -> None:
    for step, loss in want.items():
        if step >= from_step:
            assert step in got, f"step {step} missing"
            assert abs(got[step] - loss) <= 1e-5 * abs(loss), f"step {step}: {got[step]} vs {loss}"


_REFERENCES: dict[str, dict[int, float]] = {}


def reference_losses(spec: Any, timeout_s: float = 300) -> dict[int, float]:
    """Step -> loss of `spec`'s model, data and training settings run by one process.

    Why a fault test may compare with this instead of a clean multi-rank run of its own: every
    layout matches the single-process run (the parity tests hold each one to it at 1e-5), and
    one process is several times cheaper than placing and running the clean job on Ray. Cached
    per model/train/data settings, which many tests share."""
    from tenax.parallel.layout import ParallelLayout
    from tenax.workers.launch import launch
    from tests.distributed import rank_context

    doc = spec.to_dict()
    key = json.dumps({k: doc[k] for k in ("model", "train", "data")} |
                     {"mbs": doc["parallel"]["micro_batch_size"]}, sort_keys=True)
    if key not in _REFERENCES:
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
            raise AssertionError(f"single-process reference failed: {failures or sorted(losses)}")
        _REFERENCES[key] = losses
    return dict(_REFERENCES[key])
