"""RankWorker: the Ray actor that runs one rank of a job.

Training runs in a thread of a *threaded* actor so that `heartbeat()` keeps answering while the
rank computes or sits in a collective: a silent heartbeat then really means a dead process or
node, and a heartbeat whose step does not advance means a hang. Step and checkpoint records
are buffered here and fetched by the controller with each heartbeat, so no rank ever blocks on
the controller.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


class StopTraining(Exception):
    """Raised inside the training thread when the controller asked this rank to stop."""


@dataclass
class RankRun:
    """Everything one rank needs to join a group and train (picklable, crosses Ray)."""
    spec: dict[str, Any]
    layout: dict[str, Any]
    rank: int
    world: int
    addr: str
    port: int
    gpus_per_node: int
    chaos: list[dict[str, Any]] = field(default_factory=list)
    ledger: Any = None


@dataclass
class RankStatus:
    rank: int
    state: str = "idle"  # idle | starting | training | done | failed | stopped
    step: int = 0
    step_changed_at: float = 0.0  # wall clock (time.time) of the last step change
    error: str | None = None
    tokens_per_s: float = 0.0
    rank_tokens_per_s: float = 0.0
    step_s: float = 0.0
    loss: float | None = None


class RankWorker:
    """Ray actor body (decorated in `orchestrator.worker_group` with resources per slot)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._status = RankStatus(rank=-1)
        self._events: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- identity and rendezvous -------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "hostname": socket.gethostname()}

    def free_port(self) -> int:
        """A free TCP port on this node's address, for rank 0's rendezvous store."""
        import ray

        with socket.socket() as s:
            s.bind((ray.util.get_node_ip_address(), 0))
            return s.getsockname()[1]

    # ---- training ----------------------------------------------------------------------------
    def start(self, run: RankRun) -> None:
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError(f"rank {run.rank}: already training")
        self._stop.clear()
        with self._lock:
            self._status = RankStatus(rank=run.rank, state="starting", step_changed_at=time.time())
            self._events = []
        self._thread = threading.Thread(target=self._train, args=(run,), daemon=True,
                                        name=f"tenax-rank-{run.rank}")
        self._thread.start()

    def _train(self, run: RankRun) -> None:
        from orchestrator.chaos import ChaosInjector
        from workers.launch import run_rank

        injector = ChaosInjector(run.chaos, run.rank, run.gpus_per_node, run.ledger,
                                 self._stop.is_set)
        try:
            run_rank(run.spec, run.layout, run.rank, run.world, run.addr, run.port,
                     on_step=lambda record: self._on_record(record, injector))
            self._set(state="done")
        except StopTraining:
            self._set(state="stopped")
        except BaseException as err:  # every failure reaches the controller with its cause
            logger.error("rank %d failed: %s", run.rank, traceback.format_exc())
            self._set(state="failed", error=f"{type(err).__name__}: {err}")

    def _on_record(self, record: dict[str, Any], injector: Any) -> None:
        if record.get("event") == "step":
            injector.after_step(record.get("step_s", 0.0))
            self._set(state="training", step=record["step"], step_changed_at=time.time(),
                      loss=record.get("loss"), tokens_per_s=record.get("tokens_per_s", 0.0),
                      rank_tokens_per_s=record.get("rank_tokens_per_s", 0.0),
                      step_s=record.get("step_s", 0.0))
        with self._lock:
            self._events.append(record)
        if self._stop.is_set():
            raise StopTraining()
        if record.get("event") in ("step", "started"):
            injector.before_step(record["step"] + 1)

    def _set(self, **changes: Any) -> None:
        with self._lock:
            for key, value in changes.items():
                setattr(self._status, key, value)

    def heartbeat(self, since: int = 0) -> dict[str, Any]:
        """Status plus the records after index `since`; answers even mid-collective."""
        with self._lock:
            return {**asdict(self._status), "events": self._events[since:],
                    "n_events": len(self._events), "time": time.time()}

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Ask the training thread to stop at its next step boundary; True if it did."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            return not self._thread.is_alive()
        return True
