"""bench/core_split.py: the bench's GPU-node emulation places every thread where its docstring
says (training on the first core; the rest of the host, and the training processes' host-side
threads, on the others)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from bench.core_split import split_cores

LINUX = os.path.exists("/proc/self/task")
CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []

# A stand-in for a rank's training process: "forkserver" in its command line, as the rank
# actors' forkserver children have; one thread names itself as the snapshot copier does.
TRAINING = """
import sys, threading, time  # forkserver stand-in
from tenax.checkpoint.save.background import SNAPSHOT_THREAD, as_background
def copier():
    as_background(SNAPSHOT_THREAD, 0)
    print(threading.get_native_id(), flush=True)
    time.sleep(120)
threading.Thread(target=copier, daemon=True).start()
time.sleep(120)
"""


def wait_for(condition, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@pytest.mark.skipif(not LINUX or len(CORES) < 2, reason="needs Linux and 2 cores")
def test_split_cores_places_training_apart_and_its_host_side_threads_with_the_rest():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root}
    training = subprocess.Popen([sys.executable, "-c", TRAINING], stdout=subprocess.PIPE,
                                text=True, env=env)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        copier = int(training.stdout.readline())
        rank_cores, rest = {CORES[0]}, set(CORES[1:])
        with split_cores(rank_cores=1, period_s=0.02) as split:
            assert wait_for(lambda: os.sched_getaffinity(training.pid) == rank_cores
                            and os.sched_getaffinity(copier) == rest
                            and os.sched_getaffinity(other.pid) == rest)
            assert os.sched_getaffinity(0) == rest  # the driver is "the rest of the host"
            assert training.pid in split.training_pids and other.pid not in split.training_pids
            assert split.moved >= 3
        assert os.sched_getaffinity(0) == set(CORES)  # the driver gets its cores back
    finally:
        for proc in (training, other):
            proc.kill()
            proc.wait(10)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs sched_getaffinity")
@pytest.mark.parametrize("rank_cores", [0, len(CORES)])
def test_split_cores_refuses_a_split_that_leaves_a_side_empty(rank_cores):
    with pytest.raises(ValueError, match=f"rank_cores={rank_cores}"):
        with split_cores(rank_cores=rank_cores):
            pass
