"""The least CPU that moving one in-memory snapshot costs on this host, with no Tenax code.

Per step and rank, a snapshot with a replica moves its bytes four times, whatever the code
around it: the rank copies its live state into a tmpfs buffer and checksums it, its agent
pushes that buffer into a TCP connection (`sendfile`), the peer's agent receives it into its
own tmpfs buffer and checksums it. Here the same four moves run bare (numpy copy, crc32c,
`sendfile` over loopback, `recv_into` a mapping with crc32c as the bytes arrive: the agents'
own `recv_checksummed`, which is nothing more), each on its own thread, and each thread's
CPU is read from its own clock (`time.thread_time`: user and system time, the kernel's TCP
work included). Where the ranks keep every core busy, whatever these cost is taken from
training, so it bounds what the snapshots can cost there from below (bench/overhead_bench.py
reports it beside the measured cost). On separate hosts the transfer's two halves run on other
machines' spare cores (and a NIC reads the sender's pages itself).

`mover` repeats those moves at a training job's step period in a process of its own, so that a
job without snapshots can run beside exactly the work snapshots must do and nothing else.
"""
from __future__ import annotations

import contextlib
import mmap
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import threading
import time
from typing import Any, Iterator

import numpy as np

from tenax.checkpoint.memory.snapshot_store import crc32c_of
from tenax.workers.replica_stream import CRC_STRETCH as STRETCH
from tenax.workers.replica_stream import recv_checksummed


def _crc_in_stretches(view: memoryview) -> int:
    """crc32c of `view`, a cache-sized stretch at a time (as the rank's copying thread does)."""
    return crc32c_of(view[start:start + STRETCH] for start in range(0, len(view), STRETCH))


def _copy_and_checksum(buffer: mmap.mmap, live: np.ndarray) -> int:
    """What the rank's copying thread does: copy into the mapped buffer and checksum each
    stretch right after it was written; the crc32c."""
    target, view, crc = np.frombuffer(buffer, dtype=np.uint8), memoryview(buffer), 0
    for start in range(0, len(live), STRETCH):
        np.copyto(target[start:start + STRETCH], live[start:start + STRETCH])
        crc = crc32c_of([view[start:start + STRETCH]], crc)
    del target
    view.release()
    return crc


def _mapped(path: str, nbytes: int) -> tuple[mmap.mmap, int]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, nbytes)
    return mmap.mmap(fd, nbytes), fd


def _receive(server: socket.socket, view: memoryview, reps: int, expected: int,
             out: list[float]) -> None:
    """Take `reps` streams into `view` with the agents' own receive loop (`recv_into` and
    crc32c as the bytes arrive: nothing else); CPU seconds to `out`. A stream whose checksum
    is not `expected` is answered b"NO"."""
    for _ in range(reps):
        conn, _ = server.accept()
        with conn:
            t0 = time.thread_time()
            crc = recv_checksummed(conn, view)
            out.append(time.thread_time() - t0)
            conn.sendall(b"OK" if crc == expected else b"NO")


def _send(port: int, path: str, nbytes: int, reps: int, out: list[float]) -> None:
    for _ in range(reps):
        t0 = time.thread_time()
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock, \
                open(path, "rb") as f:
            sock.sendfile(f, 0, nbytes)
            verdict = sock.recv(2)
        out.append(time.thread_time() - t0)
        if verdict != b"OK":
            raise RuntimeError(f"{path}: the receiver's checksum differs ({verdict!r})")


def measure(nbytes: int, reps: int = 10) -> dict[str, Any]:
    """Median CPU seconds per snapshot of `nbytes`, per move, over `reps` rounds."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    root = tempfile.mkdtemp(prefix="tenax-floor-", dir=base)
    local, replica = os.path.join(root, "local"), os.path.join(root, "replica")
    live = np.frombuffer(os.urandom(nbytes), dtype=np.uint8)
    (lmap, lfd), (rmap, rfd) = _mapped(local, nbytes), _mapped(replica, nbytes)
    copy_s: list[float] = []
    send_s: list[float] = []
    recv_s: list[float] = []
    try:
        for _ in range(reps):
            t0 = time.thread_time()
            _copy_and_checksum(lmap, live)
            copy_s.append(time.thread_time() - t0)
        with socket.create_server(("127.0.0.1", 0)) as server:
            view = memoryview(rmap)
            expected = _crc_in_stretches(live.data)
            receiver = threading.Thread(target=_receive,
                                        args=(server, view, reps, expected, recv_s))
            receiver.start()
            _send(server.getsockname()[1], local, nbytes, reps, send_s)
            receiver.join(120)
            view.release()
    finally:
        for m, fd in ((lmap, lfd), (rmap, rfd)):
            m.close()
            os.close(fd)
        for path in (local, replica):
            os.unlink(path)
        os.rmdir(root)
    parts = {"copy_and_checksum_s": statistics.median(copy_s),
             "send_s": statistics.median(send_s),
             "receive_and_checksum_s": statistics.median(recv_s)}
    return {**parts, "total_s": sum(parts.values()), "bytes": nbytes, "reps": reps}


def _move_forever(nbytes: int, copies: int, period_s: float, ready: Any, stop: Any) -> None:
    """`copies` snapshots of `nbytes` moved every `period_s` (copy and checksum, send, receive
    and checksum, each over its own connection as agents do), until `stop` is set."""
    root = tempfile.mkdtemp(prefix="tenax-mover-",
                            dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    live = np.frombuffer(os.urandom(nbytes), dtype=np.uint8)
    maps = [_mapped(os.path.join(root, f"b{i}"), nbytes) for i in range(copies + 1)]
    server = socket.create_server(("127.0.0.1", 0))
    received: list[float] = []
    threading.Thread(target=_receive, daemon=True,
                     args=(server, memoryview(maps[-1][0]), 1 << 30,
                           _crc_in_stretches(live.data), received)).start()
    ready.set()
    deadline = time.monotonic()
    while not stop.is_set():
        for m, _ in maps[:copies]:
            _copy_and_checksum(m, live)
        for i in range(copies):
            _send(server.getsockname()[1], os.path.join(root, f"b{i}"), nbytes, 1, [])
        deadline += period_s
        stop.wait(max(0.0, deadline - time.monotonic()))
    for path in os.listdir(root):
        os.unlink(os.path.join(root, path))
    os.rmdir(root)


@contextlib.contextmanager
def mover(nbytes: int, copies: int, period_s: float, timeout_s: float = 60.0) -> Iterator[None]:
    """Run `_move_forever` in a spawned process for the duration of the block."""
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_move_forever, args=(nbytes, copies, period_s, ready, stop),
                       daemon=True)
    proc.start()
    try:
        if not ready.wait(timeout_s):
            raise RuntimeError(f"the mover did not start within {timeout_s:.0f} s")
        yield
    finally:
        stop.set()
        proc.join(timeout_s)
        if proc.is_alive():
            proc.kill()
    if proc.exitcode != 0:  # it stopped early: the job beside it ran without its load
        raise RuntimeError(f"the mover failed (exit code {proc.exitcode}); the run beside it "
                           "does not measure the moves")
