"""Straggler evidence: a `straggler` event names a diagnostics location where the flagged rank's
and one healthy rank's stacks were sampled in the background, and `tenax diagnose` says where
the slow rank spends its samples that the healthy one does not."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tenax.orchestrator.job.health_evidence import healthy_rank
from tenax.testing.jobs import run_cli
from tenax.workers.diagnostics import (compare_roles, join_samples, place_shares, read_evidence,
                                       read_stacks, split_samples, top_frame_shares,
                                       training_thread)


def stack(*frames: str) -> str:
    """A faulthandler dump whose main thread runs `frames` (most recent first) under run_rank."""
    lines = ["Current thread 0x00007f0000000002 (most recent call first):"]
    lines += [f'  File "/x/{f.split(":")[0]}.py", line {f.split(":")[1]} in {f.split(":")[2]}'
              for f in frames]
    lines.append('  File "/x/rank.py", line 120 in run_rank')
    return "\n".join(lines) + "\n"


SLEEPING = stack("chaos_injector:104:slow_down", "trainer:212:train_step")
COMPUTING = stack("linear:125:forward", "trainer:205:train_step")
WAITING = stack("distributed_c10d:2800:all_reduce", "data_parallel:90:finish_grads")


def test_samples_round_trip_and_a_single_dump_is_one_sample():
    text = join_samples([(0.0, SLEEPING), (0.1, COMPUTING), (0.2, SLEEPING)])
    assert split_samples(text) == [SLEEPING, COMPUTING, SLEEPING]
    assert split_samples(WAITING) == [WAITING]  # a hang's file: one dump, no marks


def test_shares_count_where_the_training_thread_was():
    text = join_samples([(0.0, SLEEPING), (0.1, COMPUTING), (0.2, SLEEPING), (0.3, SLEEPING)])
    assert top_frame_shares(text) == {"slow_down (chaos_injector.py:104)": 0.75,
                                      "forward (linear.py:125)": 0.25}
    places = place_shares(text, top=2)
    assert places[0] == ("slow_down (chaos_injector.py:104) <- train_step (trainer.py:212)", 0.75)


def test_compare_roles_names_where_the_straggler_differs_from_the_healthy_rank():
    slow = join_samples([(0.0, SLEEPING), (0.1, SLEEPING), (0.2, COMPUTING), (0.3, WAITING)])
    healthy = join_samples([(0.0, WAITING), (0.1, WAITING), (0.2, COMPUTING), (0.3, WAITING)])
    text = compare_roles({0: healthy, 1: slow}, {1: "straggler", 0: "healthy"})
    assert "rank 1 (straggler) spends 50% of its samples in slow_down (chaos_injector.py:104)"\
           ", rank 0 (healthy) 0%" in text, text
    assert "rank 0 (healthy), 4 sample(s):" in text and " 75%  all_reduce" in text


def test_the_healthy_reference_is_the_unflagged_rank_nearest_the_median():
    assert healthy_rank(4, {1}, {0: 1.2, 1: 0.5, 2: 0.97, 3: 0.9}) == 2
    assert healthy_rank(2, {1}, {}) == 0
    assert healthy_rank(2, {0, 1}, {0: 0.5, 1: 0.5}) is None


@pytest.mark.slow  # a `tenax` process
def test_the_cli_compares_a_straggler_with_the_healthy_rank(tmp_path: Path):
    where = tmp_path / "diagnostics" / "20260101T000000Z-straggler"
    where.mkdir(parents=True)
    (where / "rank-0.txt").write_text(join_samples([(0.0, WAITING), (0.1, COMPUTING)]))
    (where / "rank-2.txt").write_text(join_samples([(0.0, SLEEPING), (0.1, SLEEPING)]))
    (where / "evidence.json").write_text(json.dumps(
        {"cause": "straggler", "roles": {"2": "straggler", "0": "healthy"}, "seconds": 0.5}))
    assert read_evidence(str(where))["roles"] == {"2": "straggler", "0": "healthy"}
    done = run_cli(["diagnose", str(where)])
    assert done.returncode == 0, done.stderr
    assert "rank 2 (straggler) spends 100% of its samples in slow_down" in done.stdout
    done = run_cli(["diagnose", str(where), "--json"])
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["ranks"]["2"]["role"] == "straggler"
    assert report["ranks"]["2"]["places"][0]["share"] == 1.0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_slow_rank_drill_points_at_stacks_of_the_slowed_rank(tmp_path: Path):
    from tenax.testing.clusters import local_ray
    from tenax.testing.jobs import JobRun, make_spec

    # factor 4: the slowed rank sleeps 3x its compute, so most of its samples land in the sleep
    spec = make_spec(tmp_path, ["train.steps=100000", "resources.nodes=1",
                                "resources.gpus_per_node=2", "checkpoint.every_steps=100000",
                                "checkpoint.memory_every_steps=0"])
    with local_ray(gpus=2):
        job = JobRun(spec, chaos="slow rank=1 factor=4 at=10").start()
        try:
            job.wait_for(lambda: job.of("straggler"), 300, "a straggler event")
            location = job.of("straggler")[0]["diagnostics"]
            job.wait_for(lambda: bool(read_evidence_or_none(location)), 60, "the evidence")
        finally:
            job.controller.cancel()
            job.finish(120)
    event = job.of("straggler")[0]
    assert event["rank"] == 1 and location.endswith("-straggler")
    assert location.startswith(spec.checkpoint.uri.rstrip("/") + "/diagnostics/")
    evidence = read_evidence(location)
    assert evidence["roles"] == {"1": "straggler", "0": "healthy"}, evidence
    # off the critical path: the job kept stepping while its ranks were sampled
    written = Path(location.removeprefix("file://"), "evidence.json").stat().st_mtime
    assert any(event["t"] < e["t"] < written for e in job.of("step")), "the job paused"
    stacks = read_stacks(location)
    assert sorted(stacks) == [0, 1]
    tops = [training_thread(s) for s in split_samples(stacks[1])]
    assert any(t is not None and t.frames and t.frames[0].func == "slow_down" for t in tops), \
        stacks[1]
    healthy = [training_thread(s) for s in split_samples(stacks[0])]
    assert not any(t is not None and t.frames and t.frames[0].func == "slow_down"
                   for t in healthy)
    done = run_cli(["diagnose", location])
    assert done.returncode == 0, done.stderr
    assert "rank 1 (straggler) spends" in done.stdout and "slow_down" in done.stdout, done.stdout
    print(done.stdout)
    print(f"straggler evidence: {evidence['samples']} samples of 2 ranks in "
          f"{evidence['seconds']:.2f} s")


def read_evidence_or_none(location: str) -> dict | None:
    try:
        return read_evidence(location) or None
    except FileNotFoundError:
        return None
