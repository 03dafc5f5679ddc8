"""Training processes on their own cores, everything else on the rest: a host used the way a
GPU node uses it.

On a GPU node the ranks' work runs on the devices; their host threads mostly wait, and the
host's other cores are free for whatever runs beside training (here: the agents that receive,
send and hold in-memory snapshots, Ray's daemons, the controller). On this CPU-only host the
ranks compute on the host's cores themselves, so by default they and the agents compete for
the same cores and any work beside training is taken out of it. `split_cores` restores the GPU
node's division of labour: every thread of every training process (the forkserver children
of the rank actors, and the forkservers themselves) is confined to the first `rank_cores`
cores, every other thread under this driver (Ray's daemons, the agents, the controller, a
`transport_floor.mover`) to the rest, and so are the training processes' own host-side
threads (HOST_SIDE_THREADS, named by checkpoint/save/background.py: the snapshot's copying thread
and the checkpoint writer), which on a GPU node issue the device-to-host copy and checksum the
host buffer on whichever host core is free. What a snapshot still costs on the ranks' cores is
what it would cost the training loop on a GPU node: planning it, the one all-reduce per
snapshot, the fence at the optimizer step, and the shared memory bandwidth and last-level
cache.

Affinity is per thread and inherited on creation, and processes start throughout a job, so a
watcher thread re-applies it every `period_s`; `CoreSplit.moved` counts the threads it placed.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Iterator

from tenax.checkpoint.save.background import SNAPSHOT_THREAD, WRITER_THREAD, os_thread_name

logger = logging.getLogger(__name__)

# A training process's threads that a GPU node runs on its spare host cores: they feed host
# memory (the snapshot's device-to-host copy and its checksum; the checkpoint writer) while
# the devices compute. Every other thread of it (the training loop, its collectives) stays
# with the ranks' cores.
HOST_SIDE_THREADS = frozenset({SNAPSHOT_THREAD, WRITER_THREAD})


def descendants(root: int) -> list[int]:
    """Every process under `root`, read from /proc (each process's parent is the 4th field of
    its stat line, after the command name in parentheses, which may itself hold spaces)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # ended while we read
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def is_training_process(pid: int) -> bool:
    """A rank's training process or the forkserver it is forked from (they share its command
    line; bench/overhead_bench.orchestration_cpu tells them apart the same way)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"forkserver" in f.read()
    except OSError:
        return False


def _place(pid: int, cores: set[int], host_side: set[int] | None = None) -> int:
    """Confine every thread of `pid` to `cores`, except that its threads named in
    HOST_SIDE_THREADS go to `host_side` when given; how many threads were moved."""
    moved = 0
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return 0  # the process ended
    for tid in tids:
        target = cores
        if host_side is not None and os_thread_name(pid, tid) in HOST_SIDE_THREADS:
            target = host_side
        try:
            if os.sched_getaffinity(tid) != target:
                os.sched_setaffinity(tid, target)
                moved += 1
        except OSError:
            continue  # the thread ended
    return moved


@dataclass
class CoreSplit:
    rank_cores: set[int]
    other_cores: set[int]
    moved: int = 0
    training_pids: set[int] = field(default_factory=set)

    def apply(self) -> None:
        """One pass over this driver and every process under it."""
        me = os.getpid()
        self.moved += _place(me, self.other_cores)
        for pid in descendants(me):
            if is_training_process(pid):
                self.training_pids.add(pid)
                self.moved += _place(pid, self.rank_cores, self.other_cores)
            else:
                self.moved += _place(pid, self.other_cores)


@contextlib.contextmanager
def split_cores(rank_cores: int = 1, period_s: float = 0.05) -> Iterator[CoreSplit]:
    """Within the block, training processes run on the first `rank_cores` cores of this
    process's allowed set and everything else under this driver on the rest; afterwards the
    driver gets its whole set back (the processes started inside have ended by then)."""
    allowed = sorted(os.sched_getaffinity(0))
    if not 0 < rank_cores < len(allowed):
        raise ValueError(f"rank_cores={rank_cores}: needs 1 to {len(allowed) - 1} of the "
                         f"{len(allowed)} cores this process may use, leaving one for the rest")
    split = CoreSplit(set(allowed[:rank_cores]), set(allowed[rank_cores:]))
    logger.info("training processes on cores %s, everything else on %s",
                sorted(split.rank_cores), sorted(split.other_cores))
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            split.apply()
            stop.wait(period_s)

    watcher = threading.Thread(target=watch, name="core-split", daemon=True)
    watcher.start()
    try:
        yield split
    finally:
        stop.set()
        watcher.join(timeout=10)
        _place(os.getpid(), set(allowed))
