"""The cold-start breakdown: phases in order, cumulative, first time only, and consistent with
the launch -> first step a caller measures itself."""
from __future__ import annotations

import time

import pytest

from tenax.orchestrator.job.goodput import Goodput
from tenax.orchestrator.job.goodput_cold_start import (COLD_START_PHASES, ColdStart, durations,
                                                       process_started_at)
from tenax.testing.jobs import job_overrides, read_events, run_cli


def _started(rank: int, joined: float, built: float, at: float) -> dict:
    return {"event": "started", "rank": rank, "joined_at": joined, "built_at": built, "time": at}


def test_phases_are_cumulative_in_order_and_first_marks_win():
    cold = ColdStart(launched_at=100.0)
    cold.marks["ray_started"] = 102.0  # as if Ray took 2 s to start
    cold.mark("placement_groups_ready", 103.0)
    cold.mark("forkservers_ready", 104.0)  # before the controller heard from every agent
    cold.mark("agents_started", 105.0)
    cold.mark("agents_started", 109.0)  # a later placement: ignored
    cold.observe([_started(0, 106.0, 107.0, 107.5), _started(1, 106.5, 106.8, 107.2)])
    cold.observe([{"event": "step", "rank": 1, "step": 1, "time": 107.9},
                  {"event": "step", "rank": 0, "step": 1, "time": 108.0}])
    cold.observe([_started(0, 120.0, 121.0, 122.0),  # a restart after the first step
                  {"event": "step", "rank": 0, "step": 2, "time": 123.0}])
    got = cold.summary()
    assert list(got) == [p for p in COLD_START_PHASES if p != "ranks_forked"]
    assert got == {"ray_started": 2.0, "placement_groups_ready": 3.0, "agents_started": 5.0,
                   "forkservers_ready": 5.0, "rendezvous": 6.5, "trainer_built": 7.0,
                   "ranks_started": 7.5, "first_step": 8.0}
    shares = durations(got)
    assert sum(shares.values()) == pytest.approx(got["first_step"])
    assert all(v >= 0 for v in shares.values())


def test_unknown_phase_is_refused_and_unmeasured_rank_moments_are_skipped():
    cold = ColdStart()
    with pytest.raises(ValueError, match="placed_everything"):
        cold.mark("placed_everything")
    cold.observe([_started(0, 0.0, 0.0, time.time()),
                  {"event": "step", "rank": 0, "step": 1, "time": time.time()}])
    assert "rendezvous" not in cold.summary() and "first_step" in cold.summary()


def test_goodput_figures_carry_the_total_once_reached():
    goodput = Goodput(launched_at=time.time() - 1.0)
    assert "cold_start_s" not in goodput.summary()
    goodput.cold_start.observe([{"event": "step", "rank": 0, "step": 1, "time": time.time()}])
    total = goodput.summary()["cold_start_s"]
    assert total == goodput.cold_start.summary()["first_step"] and total >= 1.0


@pytest.mark.parametrize("started_ago, startup", [
    (2.0, 1.0),  # heard of 2 s late: startup ended 1 s after RUNNING, training took the rest
    (-5.0, 3.0),  # rank 0's clock runs ahead of the controller's: ended when heard of
    (100.0, 0.0),  # rank 0's clock runs behind: never before the phase began
])
def test_startup_ends_when_rank_zero_started_not_when_the_controller_heard(monkeypatch,
                                                                            started_ago, startup):
    """A short job's `started` and all its steps can reach the controller in one poll: goodput
    must not count those steps as startup (a 20-step service job once reported goodput 0%)."""
    from tenax.orchestrator.job.facts import Recovery, Rescaling
    from tenax.orchestrator.job.progress import JobProgress

    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    progress = JobProgress("j", Goodput(submitted_at=clock[0]))
    progress.goodput.begin("startup")
    clock[0] += 3.0
    started = time.time() - started_ago
    records = [{"event": "started", "rank": 0, "step": 0, "time": started}]
    records += [{"event": "step", "rank": 0, "step": s, "loss": 1.0, "step_s": 0.4,
                 "time": started + 0.4 * s} for s in (1, 2, 3)]
    list(progress.absorb(records, None, Rescaling(), Recovery()))
    got = progress.goodput.summary()
    assert got["wall_s"] == pytest.approx(3.0)
    assert got["startup_s"] == pytest.approx(startup, abs=0.05)
    assert got["productive_s"] == pytest.approx(3.0 - startup, abs=0.05)

def test_process_start_is_between_the_spawn_and_the_answer():
    import subprocess
    import sys

    code = ("from tenax.orchestrator.job.goodput_cold_start import process_started_at; "
            "print(process_started_at())")
    before = time.time()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    after = time.time()
    assert before - 0.02 <= float(out) <= after  # 10 ms ticks
    assert process_started_at() <= before


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tenax_run_reports_a_breakdown_consistent_with_the_measured_first_step(tmp_path):
    log = tmp_path / "events.jsonl"
    sets = job_overrides(tmp_path, "cold", ["train.steps=3", "resources.nodes=1",
                                            "resources.gpus_per_node=2"])
    args = ["run", "--log-json", str(log)] + [a for s in sets for a in ("--set", s)]
    launched = time.time()
    result = run_cli(args, timeout_s=240)
    assert result.returncode == 0, result.stderr[-2000:]
    events = read_events(log)
    done = next(e for e in events if e["event"] == "done")
    first = next(e for e in events if e["event"] == "step")
    cold = done["cold_start"]
    assert list(cold) == list(COLD_START_PHASES)
    values = list(cold.values())
    assert values == sorted(values) and values[0] > 0
    # The process starts after this test's clock read and before its first step: what the
    # breakdown calls launch -> first step is the test's own figure less the exec delay.
    measured = first["time"] - launched
    assert 0 <= measured - cold["first_step"] + 0.02 and cold["first_step"] <= measured + 0.02
    assert measured - cold["first_step"] < cold["ray_started"]  # launch is the process start
    assert sum(durations(cold).values()) == pytest.approx(cold["first_step"], abs=0.01)
    assert done["goodput"]["cold_start_s"] == cold["first_step"]
