"""Straggler detection: the pure policy and tracker on synthetic throughput series, plus one real
chaos run (`tenax run --chaos "slow rank=1 factor=1.5 at=10"`) that must flag rank 1 only.

Synthetic series: each rank's per-step busy-time throughput is a base rate times uniform jitter
(±10%); a slowed rank's base rate is divided by its slowdown factor. Seeds are fixed, so the
tests are deterministic, and many seeds/windows are run so a lucky draw cannot hide a bug.
"""
from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from tenax.orchestrator.job.health import (NOISE_FLOOR, STEP_CLIP, StragglerPolicy,
                                           StragglerTracker, step_scores, window_score)

ROOT = Path(__file__).resolve().parents[1]
RUN_BOUND_S = 900  # only so a broken job cannot hang the suite; not a speed goal


# ---- pure pieces ---------------------------------------------------------------------------
def test_step_scores_compare_each_rank_with_the_others() -> None:
    scores = step_scores({0: 100.0, 1: 80.0})
    assert scores[1] == pytest.approx(math.log(0.8)) and scores[0] == pytest.approx(-scores[1])
    # leave-one-out: the slow rank does not lower its own reference
    three = step_scores({0: 100.0, 1: 100.0, 2: 80.0})
    assert three[2] == pytest.approx(math.log(0.8))
    assert three[0] == pytest.approx(0.5 * math.log(1.25))
    # the median of the others: one briefly fast rank does not make the others look slow
    assert step_scores({0: 100.0, 1: 100.0, 2: 100.0, 3: 200.0}) == pytest.approx(
        {0: 0.0, 1: 0.0, 2: 0.0, 3: math.log(2.0)})
    assert step_scores({0: 100.0}) == {0: 0.0}
    assert step_scores({0: 0.0, 1: 10.0, 2: 10.0}) == {1: 0.0, 2: 0.0}


def test_window_score_winsorises_outlier_steps_around_the_median() -> None:
    assert window_score([math.log(0.5)] * 5) == pytest.approx(0.5)  # a slow rank keeps its score
    # a descheduled step (a tenth of the speed) counts as STEP_CLIP below the median, no lower
    steps = [0.0] * 9 + [math.log(0.1)]
    assert window_score(steps) == pytest.approx(math.exp(-STEP_CLIP / 10))
    assert window_score([0.1, -0.1, 0.2, -0.2]) == pytest.approx(1.0)


def win(scores: dict[int, float], steps: int = 10) -> dict[int, list[float]]:
    """A window in which every step of rank r scored scores[r]."""
    return {rank: [math.log(score)] * steps for rank, score in scores.items()}


def history(*windows: dict[int, float], lead: int = 2) -> list[dict[int, list[float]]]:
    """`lead` healthy windows first, then `windows`."""
    return [win({r: 1.0 for r in windows[0]})] * lead + [win(w) for w in windows]


def test_policy_tests_the_mean_of_recent_windows_not_each_window() -> None:
    policy = StragglerPolicy(threshold=0.8, action="alert")
    low, ok = {0: 1.0, 1: 0.7}, {0: 1.0, 1: 0.95}
    assert policy.make_decision([win(low)]).action == "none"  # one window alone never decides
    assert policy.make_decision([win(low)] * 2).action == "alert"
    assert policy.make_decision(history(ok, ok, low)).action == "none"  # one low window is noise
    assert policy.make_decision(history(ok, low, lead=4)).action == "none"  # mean 0.815
    # one noisy window does not break a detection: the mean of 3 windows is 0.77 < 0.8
    noisy = policy.make_decision(history(low, ok, low))
    assert noisy.action == "alert" and noisy.stragglers == ((1, 0.7),)
    # a slowdown is flagged after two windows: the 3-window mean (0.815) would still wait
    decision = policy.make_decision(history(ok, low, low))
    assert decision.action == "alert" and decision.stragglers == ((1, 0.7),)
    assert "rank 1" in decision.reason
    assert policy.make_decision(history(low, low, {0: 1.0})).action == "none"  # rank 1 unmeasured


def test_policy_does_not_flag_within_the_noise_of_the_healthy_ranks() -> None:
    """0.87 is below a 0.9 threshold. With quiet healthy ranks it is a straggler; where healthy
    ranks wander by ±0.1 a window (σ = 1.4826 × MAD of the log scores = 0.149), 2-3 windows
    cannot tell it from noise (bounds e^(-3.29·σ/√2) = 0.71, e^(-3.29·σ/√3) = 0.75): no
    flag."""
    policy = StragglerPolicy(threshold=0.9)
    quiet = [win({0: 1.0, 1: 1.01, 2: 0.99, 3: 0.87}) for _ in range(6)]
    assert policy.make_decision(quiet).stragglers == ((3, 0.87),)
    noisy = [{0: 1.1 if i % 2 else 0.9, 1: 0.9 if i % 2 else 1.1, 2: 1.0, 3: 0.87}
             for i in range(6)]
    assert policy.noise([win(w) for w in noisy], 3) == pytest.approx(0.149, abs=0.001)
    assert policy.make_decision([win(w) for w in noisy]).action == "none"
    slower = [win({**w, 3: 0.7}) for w in noisy]
    assert policy.make_decision(slower).stragglers == ((3, 0.7),)
    assert policy.noise([win({0: 1.0, 1: 0.5})] * 4, 1) == NOISE_FLOOR  # reference never moves
    # steps that scatter ±0.2 within identical windows: σ = 1.4826 · 0.2 / √10, from window 2
    # on
    scatter = {0: [0.2, -0.2] * 5, 1: [0.0] * 10}
    assert policy.noise([scatter] * 2, 1) == pytest.approx(1.4826 * 0.2 / math.sqrt(10))


@pytest.mark.parametrize("action", ["ignore", "alert", "evict"])
def test_policy_action_is_configurable(action: str) -> None:
    low = {0: 1.0, 1: 0.5, 2: 1.0}
    assert StragglerPolicy(0.8, action).make_decision(history(low, low)).action == action


def test_policy_rejects_bad_configuration() -> None:
    with pytest.raises(ValueError):
        StragglerPolicy(0.8, "kill")
    with pytest.raises(ValueError):
        StragglerPolicy(1.2, "alert")
    with pytest.raises(ValueError):
        StragglerPolicy(0.8, "alert", windows=1)  # one window alone must never decide


# ---- tracker on synthetic series -------------------------------------------------------------
def simulate(world: int, rate: Callable[[int, int], float], polls: int, threshold: float,
             action: str = "alert",
             steps_per_poll: int = 5) -> tuple[StragglerTracker, dict[int, int]]:
    """Feed `polls` heartbeat polls (1 s apart, `steps_per_poll` steps per rank each) into a
    tracker; returns it and {rank: number of windows closed when the rank was first flagged}."""
    clock = [0.0]
    tracker = StragglerTracker(threshold, action, heartbeat_interval_s=1.0, clock=lambda: clock[0])
    flagged_at: dict[int, int] = {}
    step = 0
    for _ in range(polls):
        clock[0] += 1.0
        records = []
        for _ in range(steps_per_poll):
            step += 1
            records += [{"event": "step", "rank": r, "step": step,
                         "rank_tokens_per_s": rate(r, step)} for r in range(world)]
        for flag in tracker.observe(records, world):
            flagged_at.setdefault(flag.rank, tracker.windows_closed)
    return tracker, flagged_at


def jitter(seed: int, base: Callable[[int, int], float]) -> Callable[[int, int], float]:
    rng = random.Random(seed)
    return lambda rank, step: base(rank, step) * rng.uniform(0.9, 1.1)


@pytest.mark.parametrize("world", [2, 3, 8])
@pytest.mark.parametrize("threshold", [0.8, 0.85])
def test_steady_run_with_jitter_is_never_flagged(world: int, threshold: float) -> None:
    for seed in range(10):
        tracker, flagged = simulate(world, jitter(seed, lambda r, s: 1000.0), 400, threshold)
        assert tracker.windows_closed >= 150
        assert flagged == {}, f"seed {seed}: jitter flagged {flagged}"
        assert min(tracker.scores.values()) > 0.85


@pytest.mark.parametrize("world", [2, 4, 8])
def test_slowdown_of_125x_is_flagged_within_three_windows(world: int) -> None:
    """A rank 1.25× slower scores 1/1.25 = 0.8, exactly at the old default threshold, so "below
    0.8" cannot separate it from noise; a threshold of 0.85 (detects > 1.18×) flags it in the
    first 3 full windows after the slowdown while jitter alone never reaches it (test above)."""
    slow_rank = world - 1
    for seed in range(10):
        # Windows close every 2 polls (2 heartbeats); polls 1-20 = 10 windows at full speed,
        # the slowdown starts exactly with window 11.
        base = lambda r, s: 1000.0 / (1.25 if r == slow_rank and s > 100 else 1.0)  # noqa: E731
        tracker, flagged = simulate(world, jitter(seed, base), 40, threshold=0.85)
        assert set(flagged) == {slow_rank}, f"seed {seed}: {flagged}"
        assert flagged[slow_rank] <= 10 + 3, \
            f"seed {seed}: flagged after window {flagged[slow_rank]}"
        assert tracker.scores[slow_rank] == pytest.approx(0.8, abs=0.06)


def loaded_host(seed: int, base: Callable[[int, int], float]) -> Callable[[int, int], float]:
    """What bench/straggler_bench.py recorded on 4 ranks sharing 2 cores: a step's busy-time
    throughput scatters by σ ≈ 0.17 in log per rank (0.2 for a score against the others), and
    3% of steps are descheduled to a third of the speed."""
    rng = random.Random(seed)
    return lambda r, s: (base(r, s) * math.exp(rng.gauss(0.0, 0.17))
                         * (0.33 if rng.random() < 0.03 else 1.0))


def test_12x_slowdown_in_loaded_host_noise_is_flagged_within_three_windows() -> None:
    """The goal at the default threshold 0.9, on synthetic noise as heavy as the host's: windows
    of 20 steps, the slowdown starting inside window 6 (step 106 of 101-120) must be flagged by
    the close of window 8 in >= 95% of seeds. (The previous rule, a median of 3 window medians,
    caught 35-75% of such runs on the real host: bench/straggler_bench.py.)"""
    hits = 0
    for seed in range(40):
        base = lambda r, s: 1000.0 / (1.2 if r == 3 and s > 105 else 1.0)  # noqa: E731
        _, flagged = simulate(4, loaded_host(seed, base), 16, 0.9, steps_per_poll=10)
        hits += flagged.get(3, 99) <= 8
    assert hits >= 38, f"1.2x flagged within 3 windows in {hits} of 40 seeds"


@pytest.mark.parametrize("threshold", [0.9, 0.99])  # default; the noise bound alone
def test_loaded_host_noise_is_flagged_at_most_at_the_documented_rate(threshold: float) -> None:
    """Healthy ranks in that noise: about 2e-3 flags per rank and window (module doc: 1e-3
    nominal, about twice that with σ estimated; measured 5-6 in 2980; z = 3.09 gives 12)."""
    clock, flags, rank_windows = [0.0], 0, 0
    for seed in range(5):
        rate = loaded_host(seed, lambda r, s: 1000.0)
        tracker = StragglerTracker(threshold, "alert", 1.0, clock=lambda: clock[0])
        for poll in range(300):
            clock[0] += 1.0
            records = [{"event": "step", "rank": r, "step": poll * 10 + i,
                        "rank_tokens_per_s": rate(r, poll * 10 + i)}
                       for i in range(1, 11) for r in range(4)]
            flags += len(tracker.observe(records, 4))
        rank_windows += 4 * tracker.windows_closed
    assert rank_windows >= 2800
    assert flags <= 2.5e-3 * rank_windows, f"{flags} flags in {rank_windows} rank-windows"


def descheduled(seed: int, base: Callable[[int, int], float]) -> Callable[[int, int], float]:
    """±10% jitter, and 1 step in 20 of any rank at a third of its speed (a loaded host
    descheduled it): the heavy tail bench/straggler_bench.py measured on 2 shared cores."""
    rng = random.Random(seed)
    return lambda r, s: base(r, s) * rng.uniform(0.9, 1.1) * (0.33 if rng.random() < 0.05 else 1.0)


@pytest.mark.parametrize("world", [2, 4])
def test_descheduled_steps_raise_no_flag_and_hide_no_straggler(world: int) -> None:
    for seed in range(10):
        tracker, flagged = simulate(world, descheduled(seed, lambda r, s: 1000.0), 400, 0.85)
        assert flagged == {}, f"seed {seed}: outlier steps flagged {flagged}"
        base = lambda r, s: 1000.0 / (1.25 if r == world - 1 and s > 100 else 1.0)  # noqa: E731
        _, flagged = simulate(world, descheduled(seed, base), 40, 0.85)
        assert set(flagged) == {world - 1} and flagged[world - 1] <= 10 + 3, \
            f"seed {seed}: {flagged}"


@pytest.mark.parametrize("factor", [1.5, 2.0])
def test_clear_slowdown_is_flagged_at_the_default_threshold(factor: float) -> None:
    base = lambda r, s: 1000.0 / (factor if r == 1 and s > 100 else 1.0)  # noqa: E731
    for seed in range(5):
        _, flagged = simulate(2, jitter(seed, base), 40, threshold=0.8)
        assert set(flagged) == {1} and flagged[1] <= 13


def test_flag_is_raised_once_per_episode_and_again_after_recovery() -> None:
    def base(rank: int, step: int) -> float:
        slow = rank == 1 and (100 < step <= 200 or step > 300)
        return 1000.0 / (2.0 if slow else 1.0)

    clock = [0.0]
    tracker = StragglerTracker(0.8, "alert", heartbeat_interval_s=1.0, clock=lambda: clock[0])
    flags = []
    for poll in range(80):
        clock[0] += 1.0
        records = [{"event": "step", "rank": r, "step": poll * 5 + i,
                    "rank_tokens_per_s": base(r, poll * 5 + i)}
                   for i in range(1, 6) for r in range(2)]
        flags += tracker.observe(records, 2)
    assert [f.rank for f in flags] == [1, 1]
    assert all(f.score == pytest.approx(0.5) and f.action == "alert" for f in flags)


def test_ignore_action_scores_but_reports_nothing() -> None:
    base = lambda r, s: 1000.0 / (2.0 if r == 0 else 1.0)  # noqa: E731
    tracker, flagged = simulate(3, base, 20, threshold=0.8, action="ignore")
    assert flagged == {}
    assert tracker.scores[0] == pytest.approx(0.5) and tracker.flagged == {0}


def test_window_waits_for_every_rank_and_reset_forgets() -> None:
    clock = [0.0]
    tracker = StragglerTracker(0.8, "alert", heartbeat_interval_s=1.0, clock=lambda: clock[0])
    for step in range(1, 30):
        clock[0] += 1.0
        tracker.observe([{"event": "step", "rank": 0, "step": step, "rank_tokens_per_s": 10.0}], 2)
    assert tracker.windows_closed == 0  # rank 1 never reported: no score from one rank
    tracker.reset()
    assert tracker.scores == {} and not tracker.history


# ---- end to end ------------------------------------------------------------------------------
@pytest.mark.slow  # `tenax run` on an embedded Ray
def test_chaos_slow_rank_is_flagged_end_to_end(tmp_path: Path) -> None:
    """A real job on an embedded Ray: rank 1 runs 1.5× slower from step 10 and must be the only
    rank reported as a straggler in the JSON log."""
    log = tmp_path / "log.jsonl"
    cmd = [sys.executable, "-m", "tenax.orchestrator.cli.main", "run",
           str(ROOT / "examples" / "tiny.yaml"),
           "--set", "train.steps=400", "--set", f"checkpoint.uri=file://{tmp_path}/ckpt",
           "--set", "checkpoint.every_steps=200",
           "--chaos", "slow rank=1 factor=1.5 at=10", "--log-json", str(log)]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=RUN_BOUND_S)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    events = [json.loads(line) for line in log.read_text().splitlines()]
    stragglers = [e for e in events if e["event"] == "straggler"]
    assert stragglers, "no straggler event for the slowed rank:\n" + "\n".join(
        json.dumps(e) for e in events if e["event"] not in ("step", "checkpoint"))
    assert {e["rank"] for e in stragglers} == {1}, stragglers
    # The score is the flagging window's: 1/1.5 ≈ 0.67 on average, but one window's score on 2
    # shared cores scatters (a CI run once read 0.8+, which a bound of 0.8 failed); below the
    # default threshold is what a flag means.
    assert all(e["score"] < 0.9 and e["action"] == "alert" for e in stragglers), stragglers


@pytest.mark.slow  # `tenax run` on an embedded Ray
def test_evict_action_restarts_the_job_without_the_straggler_node(tmp_path: Path) -> None:
    """Two 1-GPU nodes, rank 1 slowed: `evict` restarts on the remaining node and finishes."""
    log = tmp_path / "log.jsonl"
    cmd = [sys.executable, "-m", "tenax.orchestrator.cli.main", "run",
           str(ROOT / "examples" / "tiny.yaml"),
           "--set", "train.steps=300", "--set", f"checkpoint.uri=file://{tmp_path}/ckpt",
           "--set", "resources.nodes=2", "--set", "resources.gpus_per_node=1",
           "--set", "resources.max_nodes=2", "--set", "fault_tolerance.straggler_action=evict",
           "--chaos", "slow rank=1 factor=1.5 at=10", "--log-json", str(log)]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=RUN_BOUND_S)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    events = [json.loads(line) for line in log.read_text().splitlines()]
    lifecycle = "\n".join(json.dumps(e) for e in events if e["event"] not in ("step", "checkpoint"))
    stragglers = [e for e in events if e["event"] == "straggler"]
    assert [(e["rank"], e["action"]) for e in stragglers] == [(1, "evict")], lifecycle
    failures = [e for e in events if e["event"] == "failure"]
    assert [f["kind"] for f in failures] == ["straggler"], lifecycle
    placed = [e for e in events if e["event"] == "placed"]
    assert [p["world_size"] for p in placed] == [2, 1], lifecycle
    assert events[-1]["event"] == "state" and events[-1]["state"] == "SUCCEEDED", lifecycle
