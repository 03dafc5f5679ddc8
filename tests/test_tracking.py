"""What users plot: step records carry lr / grad_norm / tokens_per_s, rank 0 writes them to
TensorBoard and W&B off the training thread in order and in batches, and a broken backend is
switched off once, told as one event, and never fails the job."""
from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from tenax.workers.tracking import (TensorBoardWriter, Tracker, scalars_of, tee_hooks, texts_of,
                                    wandb_run_id)
from tenax.workers.tracking.tracker import CLOSE_TIMEOUT_S, ERROR_CLOSE_S

SPEC = {"name": "demo", "train": {"steps": 3}}


def f32(value: float) -> float:
    """TensorBoard keeps scalars as float32."""
    return float(np.float32(value))


class Recorder:
    """A backend that keeps what it is given; `gate` holds the writer thread inside `scalars`."""
    name = "recorder"

    def __init__(self, fail_on: str = "", gate: threading.Event | None = None) -> None:
        self.fail_on, self.gate = fail_on, gate
        self.calls: list[tuple[str, Any]] = []
        self.entered = threading.Event()

    def _call(self, method: str, *args: Any) -> None:
        if method == self.fail_on:
            raise OSError(f"{method} refused")
        self.calls.append((method, args))

    def open(self, first_step: int, spec: Any) -> None:
        self._call("open", first_step)

    def scalars(self, step: int, values: Any, wall_time: float) -> None:
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(30)
        self._call("scalars", step, dict(values))

    def text(self, step: int, tag: str, text: str, wall_time: float) -> None:
        self._call("text", step, tag)

    def flush(self) -> None:
        self._call("flush")

    def close(self) -> None:
        self._call("close")


def step_record(step: int, loss: float) -> dict[str, Any]:
    return {"event": "step", "step": step, "loss": loss, "lr": 0.1 * step,
            "grad_norm": 2.0 * step, "tokens_per_s": 100.0, "step_s": 0.5, "rank": 0,
            "layout": {"dp": 1}, "time": 1000.0 + step}


def test_records_map_to_the_series_users_plot():
    assert scalars_of(step_record(3, 1.5)) == {
        "train/loss": 1.5, "train/lr": pytest.approx(0.3), "train/grad_norm": 6.0,
        "train/tokens_per_s": 100.0, "train/step_s": 0.5}
    assert scalars_of({"event": "eval", "step": 4, "loss": 2.0, "tokens": 300,
                       "seconds": 1.5}) == {"eval/loss": 2.0, "eval/tokens_per_s": 200.0}
    assert scalars_of({"event": "checkpoint", "step": 5, "blocked_s": 0.1, "total_s": 0.7}) == {
        "checkpoint/blocked_s": 0.1, "checkpoint/save_s": 0.7}
    assert scalars_of({"event": "started", "step": 0}) == {}


def test_the_logging_section_of_the_spec():
    from tenax.orchestrator.spec import SpecError, load_spec

    spec = load_spec(overrides=["logging.tensorboard_dir=s3://bucket/runs/a",
                                "logging.wandb={project: p, mode: offline}"])
    assert spec.logging.tensorboard_dir == "s3://bucket/runs/a"
    assert (spec.logging.wandb.project, spec.logging.wandb.mode) == ("p", "offline")
    assert spec.logging.wandb.entity is None and spec.logging.wandb.name is None
    assert load_spec().to_dict()["logging"] == {"tensorboard_dir": None, "wandb": None}
    with pytest.raises(SpecError, match=r"logging\.wandb\.mode.*'sometimes'"):
        load_spec(overrides=["logging.wandb={mode: sometimes}"])
    with pytest.raises(SpecError, match=r"logging\.wandb\.dir"):
        load_spec(overrides=["logging.wandb={dir: /tmp}"])


def test_lr_and_grad_norm_are_prometheus_gauges():
    from prometheus_client import CollectorRegistry, generate_latest

    from tenax.orchestrator.job.metrics import TenaxCollector

    collector = TenaxCollector()
    job = collector.add_job("j1")
    registry = CollectorRegistry()
    registry.register(collector)
    before = generate_latest(registry).decode()
    assert 'tenax_job_lr{job="j1"} NaN' in before  # no step yet: no value, not a zero
    job.on_event({**step_record(4, 2.0), "job": "j1"})
    text = generate_latest(registry).decode()
    assert 'tenax_job_lr{job="j1"} 0.4' in text
    assert 'tenax_job_grad_norm{job="j1"} 8.0' in text
    assert "# TYPE tenax_job_grad_norm gauge" in text


def test_mfu_and_peak_memory_on_cuda(monkeypatch):
    """The CUDA figures with the device calls stubbed (no GPU here): MFU against an
    independent count of the model's FLOPs per token."""
    import torch
    import torch.distributed as dist

    from tenax.orchestrator.spec import load_spec
    from tenax.workers.tracking import device_figures

    peaks = iter([1000, 2000])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: next(peaks))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    spec = load_spec()
    trainer = SimpleNamespace(device=torch.device("cuda", 0), spec=spec)
    figures = device_figures(trainer)
    m = spec.model
    flops = 6 * m.num_params(active=True) + 12 * m.n_layers * m.dim * m.seq_len
    out = figures(SimpleNamespace(tokens_per_s=1e6))
    assert out["peak_allocated_bytes"] == 1000
    assert out["mfu"] == pytest.approx(1e6 * flops / (4 * 989e12), rel=1e-5)
    assert figures(SimpleNamespace(tokens_per_s=1e6))["peak_allocated_bytes"] == 2000
    assert device_figures(SimpleNamespace(device=torch.device("cpu")))(None) == {}


def test_wandb_run_id_is_the_job_id_or_the_name_and_checkpoint():
    assert wandb_run_id("tiny-llama-1a2b3c4d", {}) == "tiny-llama-1a2b3c4d"
    assert wandb_run_id("a/b c", {}) == "a-b-c"
    long = wandb_run_id("x" * 100, {})
    assert len(long) == 64 and long != wandb_run_id("x" * 99 + "y", {})
    spec = {"name": "j", "checkpoint": {"uri": "file:///a"}}
    assert wandb_run_id("", spec) == wandb_run_id("", dict(spec)) != wandb_run_id(
        "", {"name": "j", "checkpoint": {"uri": "file:///b"}})


def test_tracker_writes_in_order_and_closes():
    backend = Recorder()
    tracker = Tracker([backend], 0, SPEC)
    for step in (1, 2, 3):
        tracker.submit(step_record(step, 1.0 / step))
    stats = tracker.close()
    assert (stats.written, stats.dropped, stats.failed) == (3, 0, [])
    assert backend.calls[0] == ("open", (0,)) and backend.calls[-1] == ("close", ())
    assert [a[0] for m, a in backend.calls if m == "scalars"] == [1, 2, 3]


def test_an_error_closes_the_tracker_without_waiting_long():
    gate = threading.Event()
    backend = Recorder(gate=gate)  # a writer stuck in a backend call
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="training failed"):
        with Tracker([backend], 0, SPEC) as tracker:
            tracker.submit(step_record(1, 1.0))
            assert backend.entered.wait(30)
            raise RuntimeError("training failed")
    waited = time.monotonic() - started
    assert ERROR_CLOSE_S <= waited < CLOSE_TIMEOUT_S / 2  # the error's short wait, not the end's
    gate.set()


def test_a_full_queue_drops_the_oldest_with_one_warning(caplog):
    gate = threading.Event()
    backend = Recorder(gate=gate)
    tracker = Tracker([backend], 0, SPEC, capacity=3)
    tracker.submit(step_record(1, 1.0))
    assert backend.entered.wait(30)  # the writer holds step 1; the queue fills behind it
    with caplog.at_level(logging.WARNING, logger="tenax.workers.tracking.tracker"):
        for step in range(2, 8):
            tracker.submit(step_record(step, 1.0))  # never blocks
        gate.set()
        stats = tracker.close()
    assert stats.dropped == 3
    assert [a[0] for m, a in backend.calls if m == "scalars"] == [1, 5, 6, 7]
    falls_behind = [r for r in caplog.records if "falls behind" in r.getMessage()]
    assert len(falls_behind) == 1


class Batched(Recorder):
    """A backend that takes its records in batches, like W&B."""
    batch_s = 30.0


def test_a_batching_backend_gets_its_records_together_and_all_of_them_at_close():
    backend = Batched()
    tracker = Tracker([backend], 0, SPEC, capacity=100)
    for step in range(1, 11):
        tracker.submit(step_record(step, 1.0))
    lane = tracker.lanes[0]
    assert lane.pending() == 10  # not woken at each step: all wait for the batch
    for step in range(11, 51):  # half the queue waiting wakes the writer at once
        tracker.submit(step_record(step, 1.0))
    deadline = time.monotonic() + 30
    while lane.stats.written < 50 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lane.stats.written == 50 and lane.stats.dropped == 0
    flushes = [m for m, _ in backend.calls if m == "flush"]
    assert len(flushes) == 1  # one batch, one hand-over
    tracker.submit(step_record(51, 1.0))
    stats = tracker.close()  # the rest lands at close, without waiting for the batch
    assert (stats.written, stats.dropped) == (51, 0)
    assert [a[0] for m, a in backend.calls if m == "scalars"] == list(range(1, 52))


def test_wandb_is_handed_its_records_in_batches():
    from tenax.workers.tracking.wandb_writer import BATCH_S, TRANSACTION_LOG_FLUSH_S, WandbWriter

    assert 0 < WandbWriter.batch_s == BATCH_S <= TRANSACTION_LOG_FLUSH_S


@pytest.mark.parametrize("fail_on", ["open", "scalars", "flush"])
def test_a_failing_backend_is_switched_off_once_and_others_go_on(fail_on, caplog):
    broken, healthy = Recorder(fail_on=fail_on), Recorder()
    with caplog.at_level(logging.WARNING, logger="tenax.workers.tracking.tracker"):
        tracker = Tracker([broken, healthy], 0, SPEC)
        for step in (1, 2, 3):
            tracker.submit(step_record(step, 1.0))
        stats = tracker.close()
    assert stats.failed == ["recorder"]
    assert [a[0] for m, a in healthy.calls if m == "scalars"] == [1, 2, 3]
    assert len([r for r in caplog.records if "switched off" in r.getMessage()]) == 1


def test_unwritable_tensorboard_dir_warns_once(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="tenax.workers.tracking.tracker"):
        tracker = Tracker([TensorBoardWriter(str(blocker / "tb"))], 0, SPEC)
        for step in (1, 2, 3):
            tracker.submit(step_record(step, 1.0))
        stats = tracker.close()
    assert stats.failed == ["tensorboard"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "tensorboard switched off" in warnings[0]


def wait_until(predicate: Any, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def teed_rank_hooks(tracker: Tracker) -> tuple[Any, list[tuple[dict, threading.Thread]]]:
    """Rank hooks (as the training process has them) teed into `tracker`; what they emitted,
    with the thread each record was emitted on."""
    from tenax.workers.rank import RankHooks

    seen: list[tuple[dict, threading.Thread]] = []
    hooks = RankHooks(on_step=lambda record: seen.append((record, threading.current_thread())))
    return tee_hooks(hooks, tracker), seen


def test_a_backend_switched_off_is_one_event_on_the_training_thread():
    broken, healthy = Recorder(fail_on="scalars"), Recorder()
    tracker = Tracker([broken, healthy], 0, SPEC)
    hooks, seen = teed_rank_hooks(tracker)
    hooks.progress(step_record(1, 1.0))
    assert wait_until(lambda: tracker.stats.failed)  # the writer thread switched it off
    for step in (2, 3):
        hooks.progress(step_record(step, 1.0))  # the next record out takes the notice along
    tracker.close()
    offs = [record for record, _ in seen if record["event"] == "tracking_off"]
    assert len(offs) == 1, offs
    assert {k: offs[0][k] for k in ("backend", "reason", "step", "rank")} == {
        "backend": "recorder", "reason": "scalars failed: OSError: scalars refused", "step": 1,
        "rank": 0}
    assert {thread for _, thread in seen} == {threading.current_thread()}
    assert [record["step"] for record, _ in seen if record["event"] == "step"] == [1, 2, 3]
    # The backends still on note it where users look: a text entry at that step.
    assert [a[:2] for m, a in healthy.calls if m == "text"] == [(1, "notices")]
    assert texts_of(offs[0])["notices"].startswith("Tracking to recorder is off from step 1")


def test_a_backend_failing_as_the_job_ends_is_told_by_the_close():
    tracker = Tracker([Recorder(fail_on="close")], 4, SPEC)
    hooks, seen = teed_rank_hooks(tracker)
    hooks.progress(step_record(5, 1.0))
    tracker.close()  # the rank closes it on the training thread, after its last events
    offs = [record for record, _ in seen if record["event"] == "tracking_off"]
    assert [(o["reason"], o["step"]) for o in offs] == [("close failed: OSError: close refused",
                                                         5)]
    assert {thread for _, thread in seen} == {threading.current_thread()}
