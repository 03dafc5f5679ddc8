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

from tenax.testing.jobs import run_cli
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
    location = failure["diagnostics"]
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
