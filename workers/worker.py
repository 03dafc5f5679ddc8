"""RankWorker: the Ray actor that owns one rank slot — an agent around a training process.

The actor is long-lived; the rank's training runs in a *child process* forked from a
forkserver that has torch and Tenax preloaded, one per node block (its zygote,
workers/zygote.py). Why:
- Fast recovery: when any rank fails, the survivors' children are killed at once (a gloo
  collective whose peer died would otherwise block until its timeout), and new children fork
  in well under a second with torch already imported — no new actor, no new interpreter. Only
  slots whose actor or node died need new actors (warm recovery).
- Honest health: the actor is threaded, so `heartbeat()` answers while the child computes or
  sits in a collective; a silent heartbeat means a dead process or node, a step that does not
  advance means a hang, and a child that exits is reported with its exit code or signal.
- A rank's process can die (Xid error, OOM kill, `kill rank` drill) without taking the slot's
  placement with it.

Step and checkpoint records flow child -> actor over a pipe and are fetched by the controller
with each heartbeat, so no rank ever blocks on the controller; a validation run's
`evaluating` records only bump the status's `progress` (the controller's hang clock). The child
runs the rank loop (workers/rank.py); only in a drill does it get a fault hook (`RankChaos`,
None in production), whose claims in the job's ledger go through this actor.
"""
from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from tenax.workers.chaos_injector import RankChaos
from tenax.workers.diagnostics import arm_stack_dump, dump_stacks, forget_stacks
from tenax.workers.memory_options import MemoryOptions
from tenax.workers.snapshot_keeper import ReplicaTerms, SnapshotKeeper
from tenax.workers.tracking.tracker import TrackingStart
from tenax.workers.zygote import ForkSource

logger = logging.getLogger(__name__)
NODE_IP_TIMEOUT_S = 10.0


@dataclass
class RankRun:
    """Everything one rank needs to join a group and train (picklable, crosses Ray)."""
    spec: dict[str, Any]
    layout: dict[str, Any]
    rank: int
    world: int
    addr: str
    port: int
    node_id: str = ""  # the Ray node this rank was placed on
    job_id: str = ""
    tracking: TrackingStart | None = None  # rank 0's W&B run id and restart totals
    generation: int = 0  # the controller's placement counter (snapshot series)
    snapshot_every: int = 0  # the placement's decision: a snapshot every N steps (0: none)
    restore_uri: str | None = None  # an assembled in-memory snapshot to resume from
    peer: Any = None  # the agent on the next node that holds this rank's replica
    replicas: ReplicaTerms | None = None  # the job's secret, the replica this agent holds
    chaos: RankChaos | None = None  # a drill's rank-side faults; None in production


@dataclass
class RankStatus:
    rank: int
    state: str = "idle"  # idle | starting | training | done | failed | stopped
    step: int = 0
    error: str | None = None
    tokens_per_s: float = 0.0
    rank_tokens_per_s: float = 0.0
    step_s: float = 0.0
    loss: float | None = None
    child_pid: int | None = None
    attempt: int = 0
    # `evaluating` records seen (workers/evaluation.py): a rank busy without stepping. The
    # controller restarts the rank's hang clock when this changes, as when its step does.
    progress: int = 0
    evaluating: str = ""  # "step S batch B/N" of the latest one; "" once a step follows

    def note_progress(self, record: dict[str, Any]) -> None:
        """An `evaluating` record: the rank is alive and working, though its step stays."""
        self.progress += 1
        self.evaluating = (f"step {record.get('step')} batch {record.get('batch')}/"
                           f"{record.get('batches')}")


def settle_inherited_heap() -> None:
    """The forkserver's preloaded heap (ray, torch: ~10^6 objects) is never freed in a
    training process, yet every full collection walked it: 0.3 s inside the first checkpoint
    load's pickling, and the walk touches (copies) the shared pages. Frozen, the collector
    skips it. The collector was off in the forkserver while that imported
    (workers/import_pause.py); the training process turns it on again."""
    gc.freeze()
    gc.enable()


def _child_main(run: RankRun, memory: MemoryOptions, conn: Any, control: Any) -> None:
    """Entry point of the training process (runs in a forkserver child).

    `memory`: the agent's side of the snapshots (its callbacks are added here, they send over
    `conn`). `control` carries requests from the actor: "stop" = commit a checkpoint at the
    next step boundary and exit (planned scale changes lose no steps). Every rank agrees on
    that boundary inside `run_rank` with a one-element all-reduce, whatever moment each rank
    got the request."""
    settle_inherited_heap()
    arm_stack_dump()  # hang evidence: the agent asks for every thread's stack (dump_stacks)
    from tenax.workers.rank import ControlChannel, RankHooks, RankOptions, run_rank

    lock = threading.Lock()  # the snapshot thread sends too; a Connection is not thread-safe

    def send(message: tuple[str, Any]) -> None:
        with lock:
            conn.send(message)

    def claim(key: str) -> bool:
        with lock:
            conn.send(("claim", key))
            return bool(conn.recv())

    memory = replace(memory, on_plan=lambda blob: send(("plan", blob)),
                     on_snapshot=lambda event: send(("record", {**event, "rank": run.rank})))
    channel = ControlChannel(control)  # "stop", and profile requests
    hooks = RankHooks(on_step=lambda record: send(("record", record)),
                      on_progress=lambda record: send(("progress", record)),
                      should_stop=channel.should_stop, profile_request=channel.profile_request,
                      faults=run.chaos.injector(run.rank, run.node_id, claim)
                      if run.chaos is not None else None)
    options = RankOptions(run.spec, run.layout, run.rank, run.world, run.addr, run.port,
                          memory=memory, tracking=run.tracking or TrackingStart(run.job_id))
    try:
        record = run_rank(options, hooks)
        send(("stopped" if record.get("event") == "stopped" else "done", None))
    except BaseException as err:  # every failure reaches the controller with its cause
        send(("error", f"{type(err).__name__}: {err}"))


class RankWorker:
    """Ray actor body (made remote in `tenax.orchestrator.placement.worker_group` with its
    slot's resources)."""

    def __init__(self, zygote: Any = None, adopt: dict[str, Any] | None = None) -> None:
        """`zygote`: the node block's `Zygote` actor its training processes fork from; `adopt`:
        instead, the launcher's forkserver on this node ({"node_id", "endpoint"}); neither: a
        forkserver of this agent's own."""
        self._lock = threading.Lock()
        self._ended = threading.Condition(self._lock)  # notified when a training process ends
        self._ended_attempt = 0  # the newest attempt whose training process has ended
        self._status = RankStatus(rank=-1)
        self._events: list[dict[str, Any]] = []
        self._proc: Any = None
        self._ledger: Any = None
        self._warmed: Any = None  # the ledger this agent has called already (see start)
        self._control: Any = None
        self._attempt = 0
        self._plan: str | None = None  # the newest save plan a training process handed over
        self.snapshots = SnapshotKeeper()
        # What the agent imported (ray, the snapshot code) lives as long as it does: a full
        # collection walks all of it whenever one falls due, a recovery's verification or
        # assembly included. Frozen, it is skipped.
        gc.freeze()
        self._forks = ForkSource(zygote, adopt=adopt)

    def forkserver_ready(self, timeout_s: float) -> float:
        """Wall time the forkserver this agent forks from was ready (waits up to `timeout_s`;
        the time of asking when it is not ready by then): the cold start's
        `forkservers_ready`."""
        return self._forks.ready_at(timeout_s)

    # ---- identity and rendezvous -------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": self._node_ip(),
                "pid": os.getpid(), "hostname": socket.gethostname()}

    def _node_ip(self) -> str:
        """The address the node was started with (127.0.0.1 in local clusters), as the GCS
        records it; a worker's own guess may pick another interface."""
        import ray

        node_id = ray.get_runtime_context().get_node_id()
        box: dict[str, Any] = {}
        # ray.nodes() has no deadline of its own: a hung GCS must not hang this actor's calls
        reader = threading.Thread(target=lambda: box.update(nodes=ray.nodes()), daemon=True)
        reader.start()
        reader.join(NODE_IP_TIMEOUT_S)
        for node in box.get("nodes", ()):
            if node["NodeID"] == node_id:
                return node["NodeManagerAddress"]
        if "nodes" not in box:
            logger.warning("ray.nodes() did not answer within %g s; using this worker's own "
                           "idea of its node address", NODE_IP_TIMEOUT_S)
        return ray.util.get_node_ip_address()

    def ping(self) -> bool:
        """A node probe: this agent answers, so its node is alive."""
        return True

    def free_port(self) -> int:
        """A free TCP port on this node's address, for rank 0's rendezvous store."""
        with socket.socket() as s:
            s.bind((self._node_ip(), 0))
            return s.getsockname()[1]

    # ---- training ----------------------------------------------------------------------------
    def start(self, run: RankRun) -> int:
        """(Re)start this slot's training process for a new rendezvous; returns the attempt
        number, which tags every later heartbeat so stale answers can be told apart."""
        self.stop()
        self._attempt += 1
        self._ledger = run.chaos.ledger if run.chaos is not None else None
        if self._ledger is not None and run.chaos.events and self._ledger != self._warmed:
            self._warmed = self._ledger  # handles compare by actor: once per ledger, not per start
            threading.Thread(target=_warm_up_ledger, args=(self._ledger,), daemon=True).start()
        self.snapshots.configure(run.job_id, run.rank, run.peer, run.generation, run.replicas)
        where, unusable = self.snapshots.snapshot_target()
        memory = MemoryOptions(where, every_steps=run.snapshot_every, unusable=unusable,
                               generation=run.generation, restore_uri=run.restore_uri,
                               replicated=run.peer is not None, plan=self._plan)
        parent, child = mp.Pipe()
        control_read, self._control = mp.Pipe(duplex=False)
        # The ledger is a Ray handle, which only works in this (Ray worker) process: the child
        # asks us to claim chaos events over the pipe instead.
        chaos = replace(run.chaos, ledger=None) if run.chaos is not None else None
        proc = self._forks.start(_child_main, (replace(run, chaos=chaos, peer=None, replicas=None),
                                               memory, child, control_read),
                                 name=f"tenax-rank-{run.rank}")
        child.close()
        control_read.close()
        with self._lock:
            self._proc = proc
            self._status = RankStatus(rank=run.rank, state="starting", child_pid=proc.pid,
                                      attempt=self._attempt)
            self._events = []
        threading.Thread(target=self._read, args=(parent, proc, self._attempt),
                         daemon=True).start()
        return self._attempt

    def _read(self, conn: Any, proc: Any, attempt: int) -> None:
        """Pump the child's messages until it exits; then record how it ended."""
        while True:
            try:
                kind, payload = conn.recv()
            except (EOFError, OSError):
                break
            if attempt != self._attempt:
                break  # a newer attempt owns the status now (it ends this one's messages)
            self._handle(kind, payload, conn)
        proc.join(timeout=5)
        forget_stacks(proc.pid)
        with self._lock:
            if attempt == self._attempt and self._status.state in ("starting", "training"):
                self._status.state = "failed"
                self._status.error = _exit_reason(proc.exitcode)
                if getattr(proc, "forkserver_died", False):
                    self._status.error += (f": the node's forkserver it was forked from (pid "
                                           f"{proc.endpoint.pid}) died")
            self._ended_attempt = max(self._ended_attempt, attempt)
            self._ended.notify_all()

    def _handle(self, kind: str, payload: Any, conn: Any) -> None:
        if kind == "claim":
            import ray

            conn.send(bool(ray.get(self._ledger.claim.remote(payload), timeout=30)))
        elif kind == "record":
            self._on_record(payload)
        elif kind == "progress":  # liveness only: the status notes it, no event is kept
            with self._lock:
                self._status.note_progress(payload)
        elif kind == "plan":
            self._plan = payload
        elif kind == "done":
            self._set(state="done")
        elif kind == "stopped":
            self._set(state="stopped")
        elif kind == "error":
            self._set(state="failed", error=payload)

    def _on_record(self, record: dict[str, Any]) -> None:
        with self._lock:
            if record.get("event") == "step":
                s = self._status
                s.state, s.step, s.loss = "training", record["step"], record.get("loss")
                s.tokens_per_s = record.get("tokens_per_s", 0.0)
                s.rank_tokens_per_s = record.get("rank_tokens_per_s", 0.0)
                s.step_s = record.get("step_s", 0.0)
                s.evaluating = ""
            elif record.get("event") == "started":
                self._status.step = record["step"]
            self._events.append(record)
        if record.get("event") == "snapshot":
            self.snapshots.replicate(record["generation"], record["rank"], record["step"])

    def _set(self, **changes: Any) -> None:
        with self._lock:
            for key, value in changes.items():
                setattr(self._status, key, value)

    def heartbeat(self, since: int = 0) -> dict[str, Any]:
        """Status plus the records after index `since`; answers even mid-collective."""
        with self._lock:
            return {**asdict(self._status), "events": self._events[since:],
                    "n_events": len(self._events), "time": time.time(),
                    "replica_failures": self.snapshots.failure_counts()}

    def dump_stacks(self, timeout_s: float = 2.0) -> dict[str, Any]:
        """Every thread's Python stack of the training process (workers/diagnostics.py)."""
        with self._lock:
            rank, pid = self._status.rank, self._status.child_pid
        alive = self._proc is not None and self._proc.is_alive()
        text = dump_stacks(pid, timeout_s) if pid and alive else ""
        return {"rank": rank, "pid": pid, "text": text}

    def wait_ended(self, attempt: int, timeout_s: float) -> bool:
        """Block until training process `attempt` has ended (True) or `timeout_s` passed. The
        controller keeps one of these in flight per rank, so a process that exits wakes it at
        once instead of at its next heartbeat poll (up to heartbeat_interval_s later)."""
        with self._ended:
            return self._ended.wait_for(lambda: self._ended_attempt >= attempt, timeout_s)

    # ---- in-memory snapshots (workers/snapshot_keeper.py) ----------------------------------
    def snapshot_inventory(self) -> list[dict[str, Any]]:
        return self.snapshots.inventory()

    def read_snapshot(self, kind: str, generation: int, rank: int,
                      step: int) -> tuple[str, dict[str, Any]]:
        return self.snapshots.read(kind, generation, rank, step)

    def locate_snapshot(self, generation: int, rank: int, step: int) -> dict[str, str]:
        return self.snapshots.locate(generation, rank, step)

    def replica_endpoint(self) -> Any:
        """Where the peer's agent streams its rank's snapshots to this one."""
        return self.snapshots.endpoint(self._node_ip())

    def assemble_restore(self, job_id: str, generation: int, key: str, *pieces: Any) -> str:
        return self.snapshots.assemble(job_id, generation, key, list(pieces))

    def drop_snapshots(self) -> None:
        """The job ended: stop the training process (it must not write again), then drop."""
        self.stop()
        self.snapshots.drop_job()

    def request_stop(self) -> None:
        """Ask the training process to checkpoint at the next step boundary and exit."""
        if self._control is not None:
            self._control.send("stop")

    def request_profile(self, request: int, steps: int) -> bool:
        """Ask the training process for a torch.profiler trace of its next `steps` steps."""
        if self._control is None:
            return False
        self._control.send(("profile", request, steps))
        return True

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Kill the training process (it may be blocked in a collective); True when gone."""
        proc = self._proc
        if proc is None or not proc.is_alive():
            return True
        with self._lock:
            self._attempt += 1  # the reader of the old process must not overwrite the status
            self._status.state = "stopped"
        proc.kill()
        proc.join(timeout=timeout_s)
        return not proc.is_alive()


def _warm_up_ledger(ledger: Any) -> None:
    """One call on the chaos ledger now, so the drill's first claim does not pay for setting up
    the connection to it (0.2 s measured, between the step record and the kill: the first
    fault of every drill looked that much more expensive than a real one)."""
    import ray

    try:
        ray.get(ledger.fired_events.remote(), timeout=30)
    except Exception as exc:  # the claim will say what is wrong, if anything
        logger.debug("chaos ledger warm-up: %s", exc)


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "rank process did not exit"
    if code < 0:
        return f"rank process killed by signal {signal.Signals(-code).name}"
    return f"rank process exited with code {code}"
