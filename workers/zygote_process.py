"""ZygoteProcess: a training process forked by a forkserver that another process started.

The stdlib's forkserver client talks to the one server its own process started. This one talks
to any forkserver on the node (an `Endpoint`: its node block's zygote, workers/zygote.py), and
the child takes on what differs per starter before it runs: the starter's environment, its
stdout/stderr, its niceness and its process group. It dies with the forkserver it was forked
from (PR_SET_PDEATHSIG): its starter learns its exit status from that forkserver, so a child
outliving it could be neither reaped nor told apart from a dead one.
"""
from __future__ import annotations

import ctypes
import io
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass
from multiprocessing import connection, context, forkserver, popen_forkserver, process, \
    reduction, resource_tracker, spawn, util
from typing import Any, Callable

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 30.0  # a listening forkserver accepts at once; a wedged one must not hang us
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Endpoint:
    """Where a node's forkserver listens (plain data, crosses Ray)."""
    address: str  # its unix socket
    pid: int  # its process: the parent of every training process it forks
    ready_at: float = 0.0  # wall time it had imported PRELOAD (0: not yet known)


class ZygotePopen(popen_forkserver.Popen):
    """The stdlib forkserver client, pointed at an `Endpoint` instead of a server of its own."""

    def _launch(self, process_obj: "ZygoteProcess") -> None:
        process_obj.stdio = (self.duplicate_for_child(1), self.duplicate_for_child(2))
        payload = io.BytesIO()
        context.set_spawning_popen(self)  # the pipes in the process's arguments travel as fds
        try:
            reduction.dump(spawn.get_preparation_data(process_obj.name), payload)
            reduction.dump(process_obj, payload)
        finally:
            context.set_spawning_popen(None)
        self.sentinel, data_w = request_fork(process_obj.endpoint.address, self._fds)
        # The child watches its end of this pipe to learn that its parent is gone.
        keep = os.dup(data_w)
        self.finalizer = util.Finalize(self, util.close_fds, (keep, self.sentinel))
        with open(data_w, "wb", closefd=True) as pipe:
            pipe.write(payload.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)
        self.forkserver_died = False

    def poll(self, flag: int = os.WNOHANG) -> int | None:
        """The child's exit status, which its forkserver reports. A forkserver that died took
        the child with it (PR_SET_PDEATHSIG, SIGKILL) and cannot report: the stdlib says 255,
        an exit code the child never chose; this says SIGKILL and why."""
        if self.returncode is None:
            if not connection.wait([self.sentinel], 0 if flag == os.WNOHANG else None):
                return None
            try:
                self.returncode = forkserver.read_signed(self.sentinel)
            except (OSError, EOFError):
                self.forkserver_died = True
                self.returncode = -signal.SIGKILL
        return self.returncode


def request_fork(address: str, fds: list[int]) -> tuple[int, int]:
    """Ask the forkserver at `address` for a child; returns (status_r, data_w): the child's pid
    and later its exit status arrive on the first, its pickled start data go to the second."""
    with socket.socket(socket.AF_UNIX) as client:
        client.settimeout(CONNECT_TIMEOUT_S)
        client.connect(address)
        parent_r, child_w = os.pipe()
        child_r, parent_w = os.pipe()
        # The child's own forkserver "alive" fd: a training process starts no forkserver.
        unused = os.open(os.devnull, os.O_WRONLY)
        try:
            reduction.sendfds(client, [child_r, child_w, unused, resource_tracker.getfd(), *fds])
        except BaseException:
            os.close(parent_r)
            os.close(parent_w)
            raise
        finally:
            for fd in (child_r, child_w, unused):
                os.close(fd)
    return parent_r, parent_w


class ZygoteProcess(process.BaseProcess):
    """A `multiprocessing` process forked from the forkserver at `endpoint`, running with the
    environment and stdout/stderr of the process that started it."""
    _start_method = "forkserver"

    def __init__(self, endpoint: Endpoint, target: Callable[..., Any], args: tuple = (),
                 name: str | None = None) -> None:
        super().__init__(target=target, args=args, name=name, daemon=True)
        self.endpoint = endpoint
        self.env = dict(os.environ)
        # Ray runs its workers at niceness 15, so the control plane (raylet, GCS, a driver's
        # controller) wins the CPU over training; a forkserver a driver started runs at 0, and
        # its children at 0 made every kill -> resumed step slower (bench/RESULTS.md).
        self.niceness = os.nice(0)
        # The starter's process group: a Ctrl-C at the terminal of a launcher whose forkserver
        # this is must not reach the training processes (Ray gives each worker its own group).
        self.group = os.getpgrp()
        self.stdio = (-1, -1)  # indices of the starter's stdout/stderr among the inherited fds

    @staticmethod
    def _Popen(process_obj: "ZygoteProcess") -> ZygotePopen:
        return ZygotePopen(process_obj)

    @property
    def forkserver_died(self) -> bool:
        """Whether it ended because the forkserver it was forked from died."""
        return bool(getattr(self._popen, "forkserver_died", False))

    def run(self) -> None:
        die_with_parent(self.endpoint.pid)
        os.environ.clear()
        os.environ.update(self.env)
        if self.niceness > os.nice(0):  # only ever lower the priority (raising it needs rights)
            os.nice(self.niceness - os.nice(0))
        try:
            os.setpgid(0, self.group)
        except OSError as err:  # another session: the forkserver's group stays
            logger.debug("process group %d not joined: %s", self.group, err)
        inherited = forkserver.get_inherited_fds()
        sys.stdout.flush()
        sys.stderr.flush()
        for target, index in zip((1, 2), self.stdio):
            os.dup2(inherited[index], target)
            os.close(inherited[index])
        super().run()


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent (the forkserver) dies; exit at once if it already
    has. Linux only; elsewhere a child outlives its forkserver as the stdlib's do."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if os.getppid() != parent_pid:
        os._exit(1)


def noop() -> None:
    """The readiness probe's target: a fork that proves the server has imported and serves."""
