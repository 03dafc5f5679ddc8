"""Hang evidence: a training process dumps every thread's stack on a signal, even while its
main thread is blocked; the controller keeps every rank's stacks before killing a hung group;
`tenax diagnose` groups ranks by their top frames and names the odd one out."""
from __future__ import annotations

import multiprocessing as mp
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tenax.orchestrator.job.diagnostics import named_by_stacks, odd_rank
from tenax.orchestrator.job.job_policy import FailurePolicy, JobDecision, JobSnapshot, Limits
from tenax.orchestrator.placement.worker_group import RankHealth
from tenax.orchestrator.timeouts import Timeouts
from tenax.testing.jobs import run_cli
from tenax.workers import human
from tenax.workers.diagnostics import (arm_stack_dump, diagnose, dump_stacks, forget_stacks,
                                       parse_stacks, read_stacks, training_thread)


def waits_in_a_lock(ready: Any) -> None:
    """A stand-in for a rank stuck where no Python runs: blocked acquiring a lock forever."""
    arm_stack_dump()
    threading.Thread(target=time.sleep, args=(600,), name="helper", daemon=True).start()
    lock = threading.Lock()
    lock.acquire()
    ready.set()
    run_rank_stub(lock)


def run_rank_stub(lock: threading.Lock) -> None:
    lock.acquire()


def test_a_blocked_process_dumps_every_threads_stack():
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    proc = ctx.Process(target=waits_in_a_lock, args=(ready,), daemon=True)
    proc.start()
    try:
        assert ready.wait(30)
        deadline = time.monotonic() + 30
        while True:  # `ready` is set just before the main thread reaches the lock
            text = dump_stacks(proc.pid, timeout_s=5)
            main = training_thread(text)
            if main is not None and main.frames[0].func == "run_rank_stub":
                break
            assert time.monotonic() < deadline, text
        assert proc.is_alive()  # the dump does not end the process
        threads = parse_stacks(text)
        assert len(threads) >= 2 and main.current  # the main thread and the helper
        assert any(f.func == "sleep" or "sleep" in str(f) or f.func == "run"
                   for t in threads if t is not main for f in t.frames)
        assert dump_stacks(proc.pid, timeout_s=5).count("run_rank_stub") == 1  # again: fresh
    finally:
        proc.kill()
        proc.join(10)
        forget_stacks(proc.pid)
    assert dump_stacks(proc.pid, timeout_s=0.2) == ""  # gone: nothing, no error


def stack(*frames: str) -> str:
    """A faulthandler dump whose main thread has `frames` (most recent first)."""
    lines = ["Thread 0x00007f0000000001 (most recent call first):",
             '  File "/x/threading.py", line 320 in wait',
             "", "Current thread 0x00007f0000000002 (most recent call first):"]
    lines += [f'  File "/x/{name.split(":")[0]}.py", line {name.split(":")[1]} in '
              f'{name.split(":")[2]}' for name in frames]
    lines.append('  File "/x/rank.py", line 120 in run_rank')
    return "\n".join(lines) + "\n"


IN_ALL_REDUCE = ("distributed_c10d:2800:all_reduce", "c10d_logger:81:wrapper",
                 "trainer:190:train_step")
HUNG = ("chaos_injector:97:before_step", "rank:77:progress", "rank:188:_steps")


def test_diagnose_names_the_rank_that_is_elsewhere():
    stacks = {0: stack(*IN_ALL_REDUCE), 1: stack(*HUNG), 2: stack(*IN_ALL_REDUCE),
              3: stack(*IN_ALL_REDUCE)}
    result = diagnose(stacks)
    assert result.odd == [1]
    assert [ranks for _, ranks in result.groups] == [[0, 2, 3], [1]]
    assert result.groups[0][0][0] == "all_reduce (distributed_c10d.py:2800)"
    assert "odd one out: rank 1" in result.render()


def test_diagnose_of_two_ranks_names_the_one_not_in_a_collective():
    assert diagnose({0: stack(*IN_ALL_REDUCE), 1: stack(*HUNG)}).odd == [1]
    assert diagnose({0: stack(*HUNG), 1: stack(*IN_ALL_REDUCE)}).odd == [0]


def test_diagnose_without_an_odd_one():
    result = diagnose({0: stack(*IN_ALL_REDUCE), 1: stack(*IN_ALL_REDUCE)})
    assert result.odd == [] and "no odd one out" in result.render()
    assert diagnose({0: stack(*HUNG), 1: stack(*IN_ALL_REDUCE), 2: stack("a:1:f")}).odd == []


def hang_decision(*ranks: int) -> JobDecision:
    """The failure policy's decision when every rank in `ranks` stopped stepping."""
    limits = Limits(3, 4, timeouts=Timeouts(hang_timeout_s=6.0))
    health = tuple(RankHealth(r, "n0", None, 0.1, "training", 5, 7.5, None) for r in ranks)
    return FailurePolicy().make_decision(JobSnapshot(health, 0, limits))


def test_the_policy_names_every_stalled_rank_and_the_stacks_name_the_hung_one():
    decision = hang_decision(0, 1, 2, 3)
    assert decision.failed_ranks == (0, 1, 2, 3) and decision.cause_kind == "hang"
    assert decision.reason.startswith("ranks 0, 1, 2, 3 hung: step did not advance for 7.5 s")
    stacks = {r: stack(*(HUNG if r == 1 else IN_ALL_REDUCE)) for r in range(4)}
    named = named_by_stacks(decision, stacks)
    assert named.failed_ranks == (1, 0, 2, 3)
    assert named.reason == ("rank 1 hung in before_step (chaos_injector.py:97) while ranks 0, 2, "
                            "3 wait in all_reduce (distributed_c10d.py:2800); step did not "
                            "advance for 7.5 s (limit 6 s from hang_timeout_s=6.0)")
    event = {"event": "failure", "step": 5, "rank": named.failed_ranks[0], "cause": named.reason,
             "kind": "hang", "diagnostics": "file:///ck/diagnostics/T-hang", "diagnostics_s": 0.4}
    text = human(event)
    assert text.startswith("At step 5 rank 1 failed (hang): rank 1 hung in before_step")
    assert text.endswith("; stacks: tenax diagnose file:///ck/diagnostics/T-hang.")
    two = named_by_stacks(hang_decision(0, 1), {0: stack(*HUNG), 1: stack(*IN_ALL_REDUCE)})
    assert two.failed_ranks == (0, 1) and "while rank 1 waits in all_reduce" in two.reason


def test_ranks_that_stalled_with_the_first_to_cross_the_limit_are_named_too():
    limits = Limits(3, 4, timeouts=Timeouts(hang_timeout_s=6.0))
    ages = {0: 6.4, 1: 5.9, 2: 0.3}  # 1 stalled with 0, its last reply a poll later; 2 steps
    health = tuple(RankHealth(r, "n0", None, 0.1, "training", 5, age, None)
                   for r, age in ages.items())
    decision = FailurePolicy().make_decision(JobSnapshot(health, 0, limits))
    assert decision.failed_ranks == (0,)  # only a rank past the limit failed
    assert decision.reason.startswith("ranks 0, 1 hung: step did not advance for 6.4 s")
    alone = FailurePolicy().make_decision(JobSnapshot(health[:1] + health[2:], 0, limits))
    assert alone.reason.startswith("rank 0 hung: step did not advance")


def test_stacks_that_single_out_no_rank_leave_the_decision_alone():
    decision = hang_decision(0, 1, 2)
    assert named_by_stacks(decision, {}) == decision
    same = {r: stack(*IN_ALL_REDUCE) for r in range(3)}
    assert named_by_stacks(decision, same) == decision
    no_answer = {0: stack(*IN_ALL_REDUCE), 1: stack(*IN_ALL_REDUCE), 2: "(no stacks: gone)\n"}
    assert named_by_stacks(decision, no_answer) == decision  # a missing stack is no evidence
    assert odd_rank(diagnose(no_answer)) is None


@pytest.mark.slow  # two `tenax` processes
def test_the_cli_reads_a_diagnostics_directory(tmp_path):
    where = tmp_path / "diagnostics" / "20260101T000000Z-hang"
    where.mkdir(parents=True)
    for rank in range(3):
        (where / f"rank-{rank}.txt").write_text(stack(*(HUNG if rank == 2 else IN_ALL_REDUCE)))
    assert sorted(read_stacks(str(where))) == [0, 1, 2]
    done = run_cli(["diagnose", str(where)])
    assert done.returncode == 0, done.stderr
    assert "odd one out: rank 2" in done.stdout and "before_step" in done.stdout
    empty = tmp_path / "empty"
    empty.mkdir()
    done = run_cli(["diagnose", str(empty)])
    assert done.returncode != 0 and "no rank-N.txt" in done.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_hang_drill_keeps_every_ranks_stacks_and_names_the_hung_rank(tmp_path):
    from tenax.testing.clusters import local_ray
    from tenax.testing.jobs import make_spec, run_job

    spec = make_spec(tmp_path, ["train.steps=12", "resources.nodes=1",
                                "resources.gpus_per_node=2", "fault_tolerance.hang_timeout_s=6"])
    with local_ray(gpus=2):
        job = run_job(spec, chaos="hang rank=1 at=6")
    assert job.state == "SUCCEEDED"
    failure = job.of("failure")[0]
    assert failure["kind"] == "hang"  # which rank is not known from heartbeats: all stopped
    assert failure["rank"] == 1 and failure["ranks"][0] == 1  # the stacks know it
    text = human(failure)
    assert text.startswith(f"At step {failure['step']} rank 1 failed (hang): rank 1 hung in ")
    assert "while rank 0 waits in " in text and "hang_timeout_s=6" in text
    assert 0 < failure["diagnostics_s"] < 30
    location = failure["diagnostics"]
    assert text.endswith(f"; stacks: tenax diagnose {location}.")
    assert location.startswith(spec.checkpoint.uri.rstrip("/") + "/diagnostics/")
    assert location.endswith("-hang")
    stacks = read_stacks(location)
    assert sorted(stacks) == [0, 1]
    hung = training_thread(stacks[1])
    assert hung is not None and any(f.func == "before_step" for f in hung.frames[:3])
    waiting = training_thread(stacks[0])
    assert waiting is not None and "distributed" in waiting.frames[0].file
    assert diagnose(stacks).odd == [1]
    done = run_cli(["diagnose", location])
    assert done.returncode == 0 and "odd one out: rank 1" in done.stdout
    local = Path(location.removeprefix("file://"))
    assert sorted(p.name for p in local.iterdir()) == ["rank-0.txt", "rank-1.txt"]
