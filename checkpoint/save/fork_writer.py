"""The fork runner of a save: a low-priority child process writes a copy-on-write snapshot.

Why apart from writer.py: it is the one runner that crosses a process boundary, so its
deadline is enforced by killing the child (an abandoned flag set in the parent cannot reach a
forked child; the kill at the deadline is what stops a late fork writer from committing).
See writer.py for the measurements that made the thread writer the default.
"""
from __future__ import annotations

import json
import logging
import os
import select
import threading
import time

from tenax.checkpoint.save.writer import (WRITER_NICE, Flight, SaveJob, failed_event, run_job,
                                          write_all, write_failure_marker)

logger = logging.getLogger(__name__)


def start_fork(job: SaveJob) -> Flight:
    """Fork a nice-19 child that runs the job on a copy-on-write snapshot of the tensors."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into the trainer; os._exit skips atexit and gloo
        code = 1
        try:
            os.close(read_fd)
            job.blocked_s = time.monotonic() - job.started_at
            os.nice(WRITER_NICE)
            write_all(write_fd, memoryview(json.dumps(run_job(job)).encode()))
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    flight = Flight(job)
    threading.Thread(target=_watch_child, args=(job, flight, pid, read_fd),
                     name=f"ckpt-watch-{job.step}", daemon=True).start()
    return flight


def _watch_child(job: SaveJob, flight: Flight, pid: int, read_fd: int) -> None:
    chunks: list[bytes] = []
    try:
        while True:
            remaining = flight.deadline - time.monotonic()
            if remaining <= 0:
                os.kill(pid, 9)
                break
            ready, _, _ = select.select([read_fd], [], [], min(remaining, 1.0))
            if ready:
                chunk = os.read(read_fd, 1 << 16)
                if not chunk:
                    break  # EOF: the child finished or died
                chunks.append(chunk)
    finally:
        os.close(read_fd)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code == 0 and chunks:
        flight.finish(json.loads(b"".join(chunks)))
        return
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    if time.monotonic() >= flight.deadline:
        how += f" after missing its deadline ({job.timeout_s:.0f}s + size allowance)"
    cause = f"writer process {pid} of step {job.step} {how}"
    logger.error("checkpoint step %d failed on rank %d: %s", job.step, job.rank, cause)
    if job.commit is None:
        write_failure_marker(job, cause)
    flight.finish(failed_event(job.step, cause, job.rank))
