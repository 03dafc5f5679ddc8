"""The pinned Prometheus metrics, checked on a real HTTP scrape of a MetricsServer.

A fake controller (what `attach` and `observe` use: job_id, timeouts, group.ranks,
stragglers.scores, goodput, add_observer) and a fake clock drive the exporter, so the semantics
(dead rank, growing heartbeat age, old group removed, restarts by reason) are tested exactly.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tenax.orchestrator.job.metrics import MetricsServer, attach

ROOT = Path(__file__).resolve().parents[1]
RANK = {"job", "rank", "node"}
JOB = {"job"}
# DESIGN.md "Metrics (pinned names ...)": sample name -> (family type, label names).
PINNED = {
    "tenax_rank_up": ("gauge", RANK),
    "tenax_rank_heartbeat_age_seconds": ("gauge", RANK),
    "tenax_rank_step": ("gauge", RANK),
    "tenax_rank_tokens_per_second": ("gauge", RANK),
    "tenax_rank_step_seconds": ("gauge", RANK),
    "tenax_rank_straggler_score": ("gauge", RANK),
    "tenax_job_state": ("gauge", JOB | {"state"}),
    "tenax_job_step": ("gauge", JOB),
    "tenax_job_loss": ("gauge", JOB),
    "tenax_job_tokens_per_second": ("gauge", JOB),
    "tenax_job_world_size": ("gauge", JOB),
    "tenax_job_layout_info": ("gauge", JOB | {"dp", "tp", "pp", "cp", "ep", "zero"}),
    "tenax_job_restarts_total": ("counter", JOB | {"reason"}),
    "tenax_job_recovery_seconds_bucket": ("histogram", JOB | {"le"}),
    "tenax_job_recovery_seconds_sum": ("histogram", JOB),
    "tenax_job_recovery_seconds_count": ("histogram", JOB),
    "tenax_job_lost_steps_total": ("counter", JOB),
    "tenax_job_goodput_ratio": ("gauge", JOB),
    "tenax_checkpoint_save_blocked_seconds": ("gauge", JOB),
    "tenax_checkpoint_save_seconds": ("gauge", JOB),
    "tenax_checkpoint_load_seconds": ("gauge", JOB),
    "tenax_checkpoint_last_committed_step": ("gauge", JOB),
}
LAYOUT = {"dp": 2, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero": 1}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def handle(rank: int, node: str, last_reply: float, step: int = 5, dead: str | None = None,
           state: str = "training") -> SimpleNamespace:
    status = {"rank": rank, "state": state, "step": step, "rank_tokens_per_s": 1000.0 + rank,
              "step_s": 0.25, "loss": 4.0}
    return SimpleNamespace(rank=rank, node_id=node, last_reply=last_reply, dead=dead, status=status)


def fake_controller(job_id: str, ranks: list[SimpleNamespace]) -> SimpleNamespace:
    observers: list[Any] = []
    return SimpleNamespace(job_id=job_id, timeouts=SimpleNamespace(heartbeat_timeout_s=5.0),
                           group=SimpleNamespace(ranks=ranks), observers=observers,
                           add_observer=observers.append,
                           stragglers=SimpleNamespace(scores={0: 1.0, 1: 0.62}),
                           goodput=SimpleNamespace(summary=lambda: {"goodput": 0.75}))


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    srv = MetricsServer(0, host="127.0.0.1")
    try:
        yield srv
    finally:
        srv.close()


def scrape(srv: MetricsServer) -> tuple[dict[str, str], list[Any]]:
    """({family name: type}, every sample) from a real HTTP scrape."""
    resp = requests.get(f"http://127.0.0.1:{srv.port}/metrics", timeout=10)
    resp.raise_for_status()
    families = list(text_string_to_metric_families(resp.text))
    return {f.name: f.type for f in families}, [s for f in families for s in f.samples]


def values(samples: list[Any], name: str, **labels: str) -> list[float]:
    return [s.value for s in samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]


def start_job(srv: MetricsServer, job_id: str, clock: Clock,
              ranks: list[SimpleNamespace]) -> tuple[SimpleNamespace, Any, SimpleNamespace]:
    controller, sink = fake_controller(job_id, ranks), SimpleNamespace(extra=[])
    job = attach(srv.collector, controller, sink)
    job.clock = clock
    emit = lambda event: [cb({**event, "job": job_id}) for cb in sink.extra]  # noqa: E731
    emit({"event": "state", "state": "PLACING", "reason": "submitted"})
    emit({"event": "placed", "layout": LAYOUT, "world_size": len(ranks),
          "nodes": [h.node_id for h in ranks]})
    emit({"event": "state", "state": "RUNNING", "reason": "started"})
    emit({"event": "step", "step": 5, "loss": 4.5, "tokens_per_s": 2000.0, "world_size": 2,
          "layout": LAYOUT, "step_s": 0.25})
    emit({"event": "checkpoint", "step": 4, "blocked_s": 0.02, "total_s": 0.5})
    for observe in controller.observers:
        observe(controller, [{"event": "checkpoint_loaded", "rank": 0, "step": 2, "seconds": 1.5}])
    return controller, emit, sink


def test_every_pinned_metric_with_its_type_and_labels(server: MetricsServer) -> None:
    clock = Clock()
    start_job(server, "job-a", clock, [handle(0, "n0", clock.now), handle(1, "n1", clock.now)])
    types, samples = scrape(server)
    for name, (kind, labels) in PINNED.items():
        found = [s for s in samples if s.name == name]
        assert found, f"{name} missing from the scrape"
        family = name.removesuffix("_total") if kind == "counter" else name
        family = family.rsplit("_", 1)[0] if kind == "histogram" else family
        assert types[family] == kind, f"{family}: {types[family]} != {kind}"
        for s in found:
            assert set(s.labels) == labels, f"{name}: labels {sorted(s.labels)} != {sorted(labels)}"
    assert values(samples, "tenax_rank_up", rank="1", node="n1") == [1.0]
    assert values(samples, "tenax_rank_tokens_per_second", rank="1") == [1001.0]
    assert values(samples, "tenax_rank_straggler_score", rank="1") == [0.62]
    assert values(samples, "tenax_job_state", state="RUNNING") == [1.0]
    assert sum(values(samples, "tenax_job_state")) == 1.0
    assert values(samples, "tenax_job_step") == [5.0] and values(samples, "tenax_job_loss") == [4.5]
    assert values(samples, "tenax_job_layout_info", dp="2", zero="1") == [1.0]
    assert values(samples, "tenax_job_goodput_ratio") == [0.75]
    assert values(samples, "tenax_checkpoint_save_blocked_seconds") == [0.02]
    assert values(samples, "tenax_checkpoint_load_seconds") == [1.5]
    assert values(samples, "tenax_checkpoint_last_committed_step") == [4.0]


def test_dead_rank_is_down_with_growing_age_until_the_group_is_replaced(
        server: MetricsServer) -> None:
    clock = Clock()
    ranks = [handle(0, "n0", clock.now), handle(1, "n1", clock.now)]
    controller, emit, _ = start_job(server, "job-a", clock, ranks)
    ranks[1].dead = "RayActorError: the actor died"
    clock.now += 3.0
    ranks[0].last_reply = clock.now
    controller.observers[0](controller, [])
    _, samples = scrape(server)
    assert values(samples, "tenax_rank_up", rank="0") == [1.0]
    assert values(samples, "tenax_rank_up", rank="1") == [0.0]
    ages = [values(samples, "tenax_rank_heartbeat_age_seconds", rank="1")[0]]
    emit({"event": "failure", "step": 5, "rank": 1, "ranks": [1], "cause": "died", "kind": "dead"})
    emit({"event": "state", "state": "RECOVERING", "reason": "rank 1 died"})
    for _ in range(2):
        clock.now += 4.0
        _, samples = scrape(server)
        assert values(samples, "tenax_rank_up") == [0.0, 0.0]  # the whole group is being replaced
        ages.append(values(samples, "tenax_rank_heartbeat_age_seconds", rank="1")[0])
    assert ages == sorted(ages) and ages[-1] - ages[0] == pytest.approx(8.0)
    emit({"event": "state", "state": "PLACING", "reason": "restart 1/5"})
    emit({"event": "placed", "layout": {**LAYOUT, "dp": 1}, "world_size": 1, "nodes": ["n2"]})
    emit({"event": "state", "state": "RUNNING", "reason": "started"})
    emit({"event": "recovered", "step": 4, "layout": {**LAYOUT, "dp": 1}, "world_size": 1,
          "lost_steps": 1, "seconds": 3.2})
    _, samples = scrape(server)
    rank_series = [s for s in samples if s.name.startswith("tenax_rank_")]
    assert {(s.labels["rank"], s.labels["node"]) for s in rank_series} == {("0", "n2")}
    assert values(samples, "tenax_rank_up") == [1.0]
    assert values(samples, "tenax_job_layout_info", dp="2") == []  # the old layout is gone
    assert values(samples, "tenax_job_restarts_total", reason="dead") == [1.0]
    assert values(samples, "tenax_job_recovery_seconds_bucket", le="5.0") == [1.0]
    assert values(samples, "tenax_job_recovery_seconds_bucket", le="2.0") == [0.0]
    assert values(samples, "tenax_job_recovery_seconds_sum") == [pytest.approx(3.2)]
    assert values(samples, "tenax_job_lost_steps_total") == [1.0]


def test_silent_rank_goes_down_after_the_heartbeat_timeout(server: MetricsServer) -> None:
    clock = Clock()
    ranks = [handle(0, "n0", clock.now), handle(1, "n0", clock.now)]
    controller, _, _ = start_job(server, "job-a", clock, ranks)
    clock.now += 4.0
    ranks[0].last_reply = clock.now
    controller.observers[0](controller, [])
    assert values(scrape(server)[1], "tenax_rank_up", rank="1") == [1.0]
    clock.now += 2.0  # rank 1 is now 6 s silent, past heartbeat_timeout_s = 5
    _, samples = scrape(server)
    assert values(samples, "tenax_rank_up", rank="1") == [0.0]
    assert values(samples, "tenax_rank_heartbeat_age_seconds", rank="1") == [6.0]
    ranks[1].status["state"] = "failed"
    ranks[1].last_reply = clock.now
    controller.observers[0](controller, [])
    assert values(scrape(server)[1], "tenax_rank_up", rank="1") == [0.0]  # answers, but failed


def test_restart_reasons_and_terminal_state(server: MetricsServer) -> None:
    clock = Clock()
    _, emit, _ = start_job(server, "job-a", clock, [handle(0, "n0", clock.now)])
    _, samples = scrape(server)
    assert sum(values(samples, "tenax_job_restarts_total")) == 0.0
    assert len(values(samples, "tenax_job_restarts_total")) >= 5  # known reasons start at 0
    emit({"event": "state", "state": "RECOVERING", "reason": "placement failed: timeout"})
    emit({"event": "failure", "step": 5, "rank": 0, "ranks": [0], "cause": "hung", "kind": "hang"})
    emit({"event": "state", "state": "RECOVERING", "reason": "rank 0 hung"})
    emit({"event": "checkpoint_failed", "step": 6, "cause": "disk full"})
    emit({"event": "state", "state": "SUCCEEDED", "reason": "done"})
    _, samples = scrape(server)
    assert values(samples, "tenax_job_restarts_total", reason="placement") == [1.0]
    assert values(samples, "tenax_job_restarts_total", reason="hang") == [1.0]
    assert values(samples, "tenax_checkpoint_failures_total") == [1.0]
    assert values(samples, "tenax_job_state", state="SUCCEEDED") == [1.0]
    assert not [s for s in samples if s.name.startswith("tenax_rank_")]  # no ranks any more


def test_one_exporter_holds_several_jobs_and_servers_are_independent(server: MetricsServer) -> None:
    clock = Clock()
    start_job(server, "job-a", clock, [handle(0, "n0", clock.now)])
    _, emit_b, _ = start_job(server, "job-b", clock, [handle(0, "n1", clock.now)])
    emit_b({"event": "step", "step": 9, "loss": 3.0, "tokens_per_s": 1.0, "world_size": 1,
            "layout": LAYOUT, "step_s": 0.1})
    other = MetricsServer(0, host="127.0.0.1")
    try:
        _, samples = scrape(server)
        assert values(samples, "tenax_job_step", job="job-a") == [5.0]
        assert values(samples, "tenax_job_step", job="job-b") == [9.0]
        assert values(scrape(other)[1], "tenax_job_step") == []  # no shared global registry
    finally:
        other.close()
    server.collector.remove_job("job-a")
    _, samples = scrape(server)
    assert {s.labels["job"] for s in samples if s.name.startswith("tenax_")} == {"job-b"}


def test_loss_is_nan_before_the_first_step(server: MetricsServer) -> None:
    controller = fake_controller("job-c", [])
    attach(server.collector, controller, SimpleNamespace(extra=[]))
    _, samples = scrape(server)
    assert math.isnan(values(samples, "tenax_job_loss")[0])
    assert values(samples, "tenax_job_state", state="PENDING") == [1.0]


@pytest.mark.slow  # a real controller on an embedded Ray
def test_real_kill_shows_rank_down_then_recovery(tmp_path: Any) -> None:
    """A real controller on an embedded Ray with `kill rank=1`: the poll that sees the death
    exports rank 1 down before the group is re-formed; afterwards every rank is up again and
    the restart and recovery are counted."""
    from tenax.orchestrator.chaos.faults import parse_chaos
    from tenax.orchestrator.cli.runner import ray_session
    from tenax.orchestrator.job.controller import Controller, ControllerOptions, JobState
    from tenax.orchestrator.job.metrics import TenaxCollector
    from tenax.orchestrator.spec import load_spec

    spec = load_spec(ROOT / "examples" / "tiny.yaml",
                     ["train.steps=80", f"checkpoint.uri=file://{tmp_path}/ckpt"])
    collector, sink = TenaxCollector(), SimpleNamespace(extra=[])
    seen: list[dict[str, Any]] = []

    def record(controller: Any, records: list[dict[str, Any]]) -> None:
        families = {f.name: f for f in collector.collect()}
        up = {s.labels["rank"]: s.value for s in families["tenax_rank_up"].samples}
        restarts = sum(s.value for s in families["tenax_job_restarts"].samples)
        seen.append({"up": up, "restarts": restarts})

    with ray_session(None, spec) as forkserver:
        options = ControllerOptions(chaos=parse_chaos("kill rank=1 at=20"),
                                    on_event=lambda e: [cb(e) for cb in sink.extra],
                                    forkserver=forkserver)
        controller = Controller(spec, options)
        attach(collector, controller, sink)
        controller.add_observer(record)  # after the metrics observer
        assert controller.run() == JobState.SUCCEEDED
    down = [i for i, snap in enumerate(seen) if snap["up"].get("1") == 0.0]
    assert down, f"rank 1 never exported as down: {seen}"
    after = seen[down[-1] + 1:]
    assert after and after[-1]["up"] == {"0": 1.0, "1": 1.0} and after[-1]["restarts"] == 1.0
    families = {f.name: f for f in collector.collect()}
    count = [s.value for s in families["tenax_job_recovery_seconds"].samples
             if s.name == "tenax_job_recovery_seconds_count"]
    assert count == [1.0]
