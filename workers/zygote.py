"""Zygote: one forkserver per node block, from which every rank's training process there forks.

Why: a forkserver imports torch, Ray and the engine (`PRELOAD`, 3-5 s of CPU). One per agent
paid that N times on a node of N ranks, all at once on the node's cores, at every placement.
The zygote imports once; each agent still starts, kills and reaps its own training process: the
stdlib forkserver's protocol hands its client the child's pid and, once reaped, its exit status
over a pipe, so any process on the node can be a client. A restart still forks warm.

What differs per rank travels with the request and is set by the child before anything touches
a device (workers/zygote_process.py): the agent's environment (CUDA_VISIBLE_DEVICES, Ray's
variables) and its stdout and stderr (so a rank's output stays in its agent's log). A training
process dies with the forkserver it was forked from.

A zygote whose forkserver died starts a new one when next asked (one import); Ray restarts a
zygote whose process died; an agent whose zygote does not answer forks from a forkserver of its
own (`ForkSource`). The snapshots the agents hold are never touched by any of these.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from dataclasses import asdict, replace
from multiprocessing import connection, spawn, util
from typing import Any, Callable

from tenax.workers.errors import ZygoteError
from tenax.workers.zygote_process import Endpoint, ZygoteProcess, noop

logger = logging.getLogger(__name__)

# "ray": each forked child re-runs its parent's main script (Ray's default_worker.py, which
# imports ray) as __mp_main__; with ray already imported that costs ~5 ms instead of ~0.5 s
# on every (re)start — the largest single piece of a warm recovery before this was preloaded.
# The checkpoint modules (torch.distributed.checkpoint under them) are another ~0.1 s each time,
# and the worker module (the child's entry point, unpickled by reference) 20 ms of every restart.
# Everything a training process imports, so that a restarted rank imports nothing: the modules
# imported lazily (inside functions, to keep the layers' import order) cost every new process
# ~0.06 s of CPU before its first step (numpy.ma alone, pulled in by np.unique, ~0.04 s).
# tests/test_imports.py checks that a train-and-resume imports nothing past this list.
PRELOAD = ["tenax.workers.import_pause", "ray", "torch", "torch.distributed",
           "torch.distributed.tensor.debug", "numpy.ma", "fsspec.implementations.chained",
           "tenax.workers.rank", "tenax.workers.trainer", "tenax.workers.events",
           "tenax.parallel.parallel_model", "tenax.parallel.expert_parallel",
           "tenax.checkpoint.manager", "tenax.checkpoint.load.reshard",
           "tenax.checkpoint.memory.snapshot", "tenax.checkpoint.memory.restore",
           "tenax.checkpoint.save.plan_codec", "tenax.workers.worker",
           "tenax.workers.evaluation", "tenax.workers.zygote", "tenax.workers.zygote_process"]
RESTART_WAIT_S = 30.0  # how long an agent asks a zygote that Ray is restarting before it gives up
RESTART_POLL_S = 0.2


# ---- the server side: the zygote (a Ray actor per node block) -------------------------------
class NodeForkServer:
    """A stdlib forkserver process started by this process (its "alive" pipe's only writer: the
    server exits when this process does), importing `preload`; it serves once imported."""

    def __init__(self, preload: list[str]) -> None:
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")
            listener.bind(address)
            os.chmod(address, 0o600)
            listener.listen()
            alive_r, self.alive_w = os.pipe()
            try:
                command = ("from multiprocessing.forkserver import main; "
                           f"main({listener.fileno()}, {alive_r}, {preload!r}, "
                           f"sys_path={sys.path!r})")
                executable = spawn.get_executable()
                pid = util.spawnv_passfds(executable, [executable, "-c", command],
                                          [listener.fileno(), alive_r])
            finally:
                os.close(alive_r)
        self.endpoint = Endpoint(address, pid)

    def close(self) -> None:
        os.close(self.alive_w)


def probe(endpoint: Endpoint, timeout_s: float) -> Endpoint:
    """`endpoint` with the time it served a fork (it has imported what it preloads by then)."""
    child = ZygoteProcess(endpoint, noop, name="tenax-zygote-probe")
    child.start()  # returns once the server has forked, i.e. imported
    ready = replace(endpoint, ready_at=time.time())
    child.join(timeout_s)
    return ready


def process_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not: a dead forkserver its parent has not reaped yet)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(") ", 1)[-1][:1] != "Z"
    except (ProcessLookupError, PermissionError):
        return False
    except OSError:  # no /proc: the signal's answer is all there is
        return True


class Zygote:
    """Ray actor body (made remote in `tenax.orchestrator.placement.worker_group`, one per node
    block, without resources of its own). Its forkserver starts importing at once, so the
    imports overlap the agents' start; or, on the node where `tenax run` started an embedded
    Ray, it adopts the forkserver the launcher started before Ray (`adopt`: {"node_id",
    "endpoint"}), whose imports overlapped Ray's start."""

    def __init__(self, timeout_s: float = 300.0, adopt: dict[str, Any] | None = None) -> None:
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._server: NodeForkServer | None = None  # the one this zygote started, if any
        self._endpoint: Endpoint | None = None  # the one it serves
        self._adopt = Endpoint(**adopt["endpoint"]) if adopt and _on_node(adopt["node_id"]) \
            else None
        self._error = ""
        threading.Thread(target=self._ensure, daemon=True).start()

    def _ensure(self) -> None:
        with self._lock:
            if self._endpoint is not None and process_alive(self._endpoint.pid):
                return
            if self._endpoint is not None:
                logger.warning("the zygote's forkserver (pid %d) died; starting a new one",
                               self._endpoint.pid)
            self._endpoint, adopt, self._adopt = None, self._adopt, None  # adopted once only
            if adopt is not None and self._adopted(adopt):
                return
            try:
                if self._server is not None:
                    self._server.close()
                self._server = NodeForkServer(PRELOAD)
                self._endpoint = probe(self._server.endpoint, self._timeout_s)
                self._error = ""
            except Exception as err:  # the agents fork from forkservers of their own then
                self._error = f"{type(err).__name__}: {err}"
                logger.warning("the zygote's forkserver did not start: %s", self._error)

    def _adopted(self, adopt: Endpoint) -> bool:
        """Serve the launcher's forkserver; False (this zygote starts its own) when it is gone
        or refuses the probe."""
        try:
            if process_alive(adopt.pid):
                self._endpoint = probe(adopt, self._timeout_s)
                logger.info("serving the launcher's forkserver (pid %d)", adopt.pid)
                return True
        except (OSError, EOFError) as err:
            logger.warning("the launcher's forkserver (pid %d) refused the probe (%s); starting "
                           "one of this zygote's own", adopt.pid, err)
        return False

    def endpoint(self, timeout_s: float) -> dict[str, Any]:
        """Where the forkserver listens, once it has imported PRELOAD (a dead one is replaced
        first); ZygoteError if it cannot start, TimeoutError after `timeout_s`."""
        if not self._lock.acquire(timeout=timeout_s):
            raise TimeoutError(f"the zygote's forkserver was not ready within {timeout_s:g} s")
        self._lock.release()
        self._ensure()
        endpoint = self._endpoint
        if endpoint is None:
            raise ZygoteError(f"the zygote's forkserver did not start: {self._error}")
        return asdict(endpoint)

    def pid(self) -> int:
        """The zygote's own process (tests and drills kill it)."""
        return os.getpid()


def _on_node(node_id: str) -> bool:
    import ray

    return ray.get_runtime_context().get_node_id() == node_id


# ---- the agent's side: where its training processes fork from --------------------------------
class ForkSource:
    """An agent's source of training processes: its node block's zygote, or the launcher's
    forkserver on the launcher's node, or, without either (or when it does not answer), a
    forkserver of the agent's own (the imports paid once more)."""

    def __init__(self, zygote: Any = None, timeout_s: float = 300.0,
                 adopt: dict[str, Any] | None = None) -> None:
        """`adopt`: the launcher's forkserver ({"node_id", "endpoint"}), which an agent on its
        node forks from directly; the block then has no zygote (`zygote` None)."""
        self._zygote, self._timeout_s = zygote, timeout_s
        self._lock = threading.Lock()
        self._endpoint: Endpoint | None = None
        self._own: Any = None  # the agent's own forkserver context, once it needs one
        self._own_ready = threading.Event()
        self._own_at = 0.0
        self._adopt_lock = threading.Lock()
        self._forked = threading.Event()  # a first start was tried (ready_at waits for it)
        self._adopt = Endpoint(**adopt["endpoint"]) if adopt and _on_node(adopt["node_id"]) \
            else None
        if zygote is None and self._adopt is None:
            self._start_own()

    def _start_own(self) -> None:
        import multiprocessing as mp

        with self._lock:
            if self._own is not None:
                return
            self._own = mp.get_context("forkserver")
            self._own.set_forkserver_preload(PRELOAD)
        threading.Thread(target=self._warm_own, daemon=True).start()

    def _warm_own(self) -> None:
        """Start the own forkserver now, so its imports overlap placement, not recovery."""
        proc = self._own.Process(target=noop, daemon=True)
        try:
            proc.start()  # returns once the forkserver has imported PRELOAD and forked
            self._own_at = time.time()
        finally:
            self._own_ready.set()  # a failed warm-up: `start` reports it, not this wait
        proc.join(timeout=self._timeout_s)

    def _ask(self, timeout_s: float) -> Endpoint | None:
        """The zygote's endpoint; None (and a forkserver of this agent's own from now on) when
        the zygote does not answer. A zygote that just died is being restarted by Ray: calls
        fail as "unavailable" until the new process runs. One whose restarts are spent fails as
        "died" at once: waiting longer would only delay the training process."""
        import ray

        if self._zygote is None:
            return self._launchers()
        deadline = time.monotonic() + RESTART_WAIT_S
        while True:
            try:
                answer = ray.get(self._zygote.endpoint.remote(timeout_s), timeout=timeout_s + 5)
                return Endpoint(**answer)
            except ray.exceptions.ActorDiedError as err:
                failure: Exception = err
            except ray.exceptions.RayActorError as err:
                if time.monotonic() < deadline:
                    logger.info("the node's zygote is restarting (%s); asking again", err)
                    time.sleep(RESTART_POLL_S)
                    continue
                failure = err
            except Exception as err:  # a timeout, a forkserver that did not start
                failure = err
            logger.warning("the node's zygote did not answer (%s: %s); this agent forks its "
                           "training processes from a forkserver of its own",
                           type(failure).__name__, failure)
            self._start_own()
            return None

    def _launchers(self) -> Endpoint | None:
        """The launcher's forkserver while it runs (a fork from it waits for its imports);
        None, and a forkserver of this agent's own from now on, once it is gone or refused a
        fork. Nothing replaces it: the launcher started it, and only a zygote starts another."""
        with self._adopt_lock:
            adopt = self._adopt
            if adopt is not None and not process_alive(adopt.pid):
                adopt = self._adopt = None
        if adopt is None:
            logger.warning("the launcher's forkserver is gone; this agent forks its training "
                           "processes from a forkserver of its own")
            self._start_own()
        return adopt

    def ready_at(self, timeout_s: float) -> float:
        """Wall time the forkserver this agent forks from had imported PRELOAD (waits up to
        `timeout_s`; the time of asking when not ready by then). The launcher's is not probed
        (a probe's fork would delay the first real one): it was ready by the time its first
        fork for this agent returned."""
        if self._own is None and self._zygote is None:
            self._forked.wait(timeout_s)
            if self._endpoint is not None and self._endpoint.ready_at:
                return self._endpoint.ready_at
        elif self._own is None:
            endpoint = self._endpoint or self._ask(timeout_s)
            if endpoint is not None:
                self._endpoint = endpoint
                return endpoint.ready_at
        self._own_ready.wait(timeout_s)
        return self._own_at or time.time()

    def start(self, target: Callable[..., Any], args: tuple, name: str) -> Any:
        """A started training process; a refused connection asks the zygote again once (it
        replaces a dead forkserver) before this agent falls back on its own."""
        try:
            return self._start(target, args, name)
        finally:
            self._forked.set()

    def _start(self, target: Callable[..., Any], args: tuple, name: str) -> Any:
        for _ in range(2):
            if self._own is not None:
                break
            if self._endpoint is None:
                self._endpoint = self._ask(self._timeout_s)
                if self._endpoint is None:
                    break
            proc = ZygoteProcess(self._endpoint, target, args, name)
            try:
                proc.start()
                if not self._endpoint.ready_at:  # the launcher's: ready by now
                    self._endpoint = replace(self._endpoint, ready_at=time.time())
                return proc
            except (OSError, EOFError) as err:
                logger.warning("the forkserver at %s refused a fork (%s); asking again",
                               self._endpoint.address, err)
                self._endpoint = None
                with self._adopt_lock:  # the launcher's is not asked again
                    self._adopt = None
        if self._own is None:
            self._start_own()
        proc = self._own.Process(target=target, args=args, daemon=True, name=name)
        proc.start()
        return proc
