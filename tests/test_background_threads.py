"""checkpoint/save/background.py: a training process's host-side threads carry names the OS
shows (an operator looking at a busy rank, and bench/core_split.py placing threads by name,
tell them apart that way) and run at a lower priority."""
from __future__ import annotations

import os
import threading
import time

import pytest

from tenax.checkpoint.save.background import SNAPSHOT_THREAD, as_background, os_thread_name

LINUX = os.path.exists("/proc/self/task")


def wait_for(condition, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@pytest.mark.skipif(not LINUX, reason="Linux only")
def test_a_background_thread_is_named_and_lowered():
    seen: dict[str, object] = {}

    def body() -> None:
        as_background("a-name-longer-than-fifteen", 7)
        tid = threading.get_native_id()
        seen["name"] = os_thread_name(os.getpid(), tid)
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, tid)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(10)
    assert seen == {"name": "a-name-longer-t", "nice": 7}
    assert os_thread_name(os.getpid(), threading.get_native_id()) != "a-name-longer-t"


@pytest.mark.skipif(not LINUX, reason="Linux only")
def test_the_snapshot_copying_thread_carries_its_name(tmp_path):
    from tenax.checkpoint.memory.snapshot import MemorySnapshotter
    from tests.ckpt_jobs import DictState, ckpt_config

    def named() -> list[int]:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
        return [t for t in tids if os_thread_name(os.getpid(), t) == SNAPSHOT_THREAD]

    state = DictState()
    snaps = MemorySnapshotter(ckpt_config(f"file://{tmp_path}/ckpt"), state, 0, 1, str(tmp_path),
                              3, lambda ok: ok)
    assert named() == []
    state.train()
    snaps.snapshot(1)
    snaps.wait()
    assert len(named()) == 1
    snaps.close()
    assert wait_for(lambda: named() == [])
