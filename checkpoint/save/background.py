"""The training process's own background threads (the snapshot copier, the checkpoint writer)
run at a lower priority and under a name the OS shows.

Why a name: `top -H`, `ps -L` and py-spy show "python" for every thread of a training process
unless the thread names itself; an operator looking at a busy rank (and bench/core_split.py,
which places a GPU node's host-side work apart from training) can then tell the copying thread
from the training thread. Linux only; elsewhere both are skipped (neither changes a result).
"""
from __future__ import annotations

import logging
import os
import threading

logger = logging.getLogger(__name__)

SNAPSHOT_THREAD = "snapshot-copy"
WRITER_THREAD = "ckpt-writer"
OS_NAME_MAX = 15  # the kernel keeps 15 bytes of a thread's name


def as_background(name: str, nice: int) -> None:
    """Called by the thread itself: lower its priority to `nice` and name it `name`."""
    tid = threading.get_native_id()
    try:  # Linux: a thread id is a task id, so this lowers only this thread
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except (OSError, AttributeError) as exc:
        logger.debug("cannot lower thread %s's priority: %s", name, exc)
    try:
        with open(f"/proc/self/task/{tid}/comm", "w") as f:
            f.write(name[:OS_NAME_MAX])
    except OSError as exc:
        logger.debug("cannot name thread %s: %s", name, exc)


def os_thread_name(pid: int, tid: int) -> str | None:
    """The name the OS shows for thread `tid` of process `pid`; None once it ended."""
    try:
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None
