"""What the caller decides about a job's controller, handed over once at construction.

Why a record: `tenax run`, `tenax serve` and the test harness each build controllers with
different collaborators (an event sink, drills, the scheduler's allotment, where capacity is
counted). Passing them in one frozen record at construction, instead of assigning controller
fields afterwards, keeps every field of the controller its own.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from tenax.orchestrator.placement.capacity import Capacity, cluster_capacity

if TYPE_CHECKING:
    from tenax.orchestrator.chaos.faults import ChaosEvent

logger = logging.getLogger(__name__)

__all__ = ["ControllerOptions", "Observer", "Subscriber"]

Subscriber = Callable[[dict[str, Any]], None]  # an event (a dict) for each thing that happens
Observer = Callable[[Any, list[dict[str, Any]]], None]  # (controller, records) after each poll


@dataclass(frozen=True)
class ControllerOptions:
    """A job controller's collaborators and options, fixed for its life."""
    job_id: str | None = None  # default: the spec's name and a random suffix
    # What names the job's W&B run (logging.wandb) on every attempt; default: the job id.
    # `tenax run` gives one derived from the spec, so running it again resumes the same run.
    tracking_id: str | None = None
    on_event: Subscriber | None = None  # the job's event sink (more listeners: `subscribe`)
    chaos: Sequence["ChaosEvent"] = ()  # drills (`tenax run --chaos`); none in production
    capacity_limit: Callable[[], int] | None = None  # tenax serve: nodes the scheduler allots
    # Where GPUs are counted: (gpus_per_node, slots known lost) -> whole job nodes. Ray's view
    # of the cluster; a test gives its own to run the loop without a cluster.
    cluster_capacity: Callable[[int, Mapping[str, int]], Capacity] = cluster_capacity
    # Wall time the cold-start breakdown counts from (`tenax run`: the process's start, so Ray's
    # start is in it); None: the controller's construction.
    launched_at: float | None = None
    # A forkserver the launcher started on its own node before an embedded Ray ({"node_id",
    # "endpoint"}): the agents on that node fork from it, with no zygote there (workers/zygote.py);
    # None: each node block's zygote starts one.
    forkserver: dict[str, Any] | None = None
