"""Placing the links probes on the job's slots and running them (Ray must already run).

The probes are placed the way the job's ranks are (one STRICT_PACK block of
`resources.gpus_per_node` slots per node, rank r in block r // gpus_per_node), block k on the
Ray node where the smoke job's block k ran, after the smoke job has released its slots, so
each group's figure is that of the links the job's group used.
A drill's `slow` fault aimed at a rank holds that rank's collectives too.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any, Sequence

from tenax.orchestrator.preflight.links import (SLOW_GROUP_SHARE, assumed_Bps, group_figures,
                                                link_tasks, links_row, node_names,
                                                planner_sizes)
from tenax.orchestrator.preflight.rows import Row
from tenax.orchestrator.timeouts import Timeouts
from tenax.workers import LinkProbe

logger = logging.getLogger(__name__)

CPUS_PER_PROBE = 0.5  # as a rank's slot
# A slow group is measured again before it is reported, each group keeping its better figure:
# a link that is really slow stays slow, a neighbour's burst of CPU on a shared host does not.
CONFIRMATIONS = 1


def slow_factors(chaos: Sequence[Any], world: int, gpus_per_node: int) -> list[float]:
    """Per rank: the factor of the drill's `slow` faults aimed at it (1.0: none)."""
    factors = [1.0] * world
    for event in chaos:
        if event.kind != "slow":
            continue
        for rank in range(world):
            if event.targets(rank, gpus_per_node):
                factors[rank] = max(factors[rank], event.factor)
    return factors


def links_check(spec: Any, layout: Any, chaos: Sequence[Any] = (),
                job_nodes: Sequence[str] = ()) -> Row:
    """The links row for `layout` on `spec`'s slots (a fail row when the probes cannot run)."""
    return measure_links(spec, layout, chaos, job_nodes)[0]


def measure_links(spec: Any, layout: Any, chaos: Sequence[Any] = (), job_nodes: Sequence[str] = ()
                  ) -> tuple[Row, list[tuple[str, ...]]]:
    """The links row, and the Ray node ids of each group below SLOW_GROUP_SHARE.

    `job_nodes`: the Ray node of each rank where the job ran; probe block k is placed on rank
    k * gpus_per_node's node when Ray can (so groups are measured on the job's own links)."""
    tasks = link_tasks(spec.model.args(), layout, spec.train.global_batch_size, spec.train.dtype)
    if not tasks:
        return links_row([], {}, {}), []
    gpn = spec.resources.gpus_per_node
    targets = [job_nodes[k] if k < len(job_nodes) else ""
               for k in range(0, layout.world_size, gpn)]
    sizes = planner_sizes(spec.model.args(), layout, spec.train.global_batch_size,
                          spec.train.dtype)
    seconds: dict[int, dict[str, float]] = {}
    before: list[str] = []
    for _ in range(CONFIRMATIONS + 1):
        try:
            results, node_ids = run_probes(
                layout.world_size, gpn, [t.to_dict() for t in tasks],
                Timeouts.from_spec(spec).hang_timeout_s,
                slow_factors(chaos, layout.world_size, gpn), spec.resources.device, targets)
        except Exception as err:  # noqa: BLE001 - any probe failure is the row's finding
            logger.warning("links probe failed: %s", err)
            return Row("links", "not measured", "every group's collective", "fail",
                       f"the probes failed: {(str(err).splitlines() or [repr(err)])[0]}"), []
        seconds = best_of(seconds if node_ids == before else {}, results)
        before = node_ids
        cuda = any(r["cuda"] for r in results)
        figures = group_figures(tasks, seconds, node_names(node_ids, gpn))
        row = links_row(figures, {t.dim: assumed_Bps(cuda, layout, t.dim, gpn) for t in tasks},
                        sizes)
        if row.verdict == "pass":
            break
    slow = [tuple(dict.fromkeys(node_ids[r] for r in f.ranks)) for f in figures
            if f.ratio < SLOW_GROUP_SHARE]
    return row, slow


def best_of(seconds: dict[int, dict[str, float]],
            results: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Per rank and dimension, the faster of an earlier measurement and this one."""
    return {rank: {dim: min(t, seconds.get(rank, {}).get(dim, t))
                   for dim, t in r["seconds"].items()} for rank, r in enumerate(results)}


def run_probes(world: int, gpus_per_node: int, tasks: list[dict[str, Any]], timeout_s: float,
               factors: list[float], device: str, targets: Sequence[str] = ()
               ) -> tuple[list[dict[str, Any]], list[str]]:
    """Every probe's result, in rank order, and each rank's Ray node id; block k goes to the
    Ray node `targets[k]` ("" or none: anywhere; see `place_blocks`)."""
    import ray
    from ray.util.placement_group import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pgs = place_blocks(math.ceil(world / gpus_per_node), gpus_per_node, targets, timeout_s)
    actors: list[Any] = []
    try:
        probe = ray.remote(LinkProbe)
        actors = [probe.options(num_gpus=1, num_cpus=CPUS_PER_PROBE,
                                scheduling_strategy=PlacementGroupSchedulingStrategy(
                                    placement_group=pgs[r // gpus_per_node],
                                    placement_group_bundle_index=r % gpus_per_node)).remote()
                  for r in range(world)]
        infos = ray.get([a.info.remote() for a in actors], timeout=timeout_s)
        port = ray.get(actors[0].free_port.remote(), timeout=timeout_s)
        refs = [a.run.remote(r, world, infos[0]["ip"], port, tasks, timeout_s, factors[r],
                             device) for r, a in enumerate(actors)]
        results = ray.get(refs, timeout=timeout_s * (1 + len(tasks)))
        return results, [i["node_id"] for i in infos]
    finally:
        for actor in actors:
            ray.kill(actor)
        for pg in pgs:
            remove_placement_group(pg)


def place_blocks(blocks: int, gpus_per_node: int, targets: Sequence[str],
                 timeout_s: float) -> list[Any]:
    """Ready placement groups, block k on the Ray node `targets[k]` (a hard label selector:
    the smoke job's slots there may take a moment to come free); if that does not finish in
    `timeout_s` (a node gone), anywhere. TimeoutError when neither does."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    tries = [list(targets)[:blocks], []] if any(targets) else [[]]
    for pinned in tries:
        pgs = [placement_group(
            [{"GPU": 1.0, "CPU": CPUS_PER_PROBE}] * gpus_per_node, strategy="STRICT_PACK",
            name=f"tenax-links-{time.monotonic_ns()}-{k}",
            bundle_label_selector=([{"ray.io/node-id": pinned[k]}] * gpus_per_node
                                   if k < len(pinned) and pinned[k] else None))
            for k in range(blocks)]
        ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=blocks, timeout=timeout_s)
        if len(ready) == blocks:
            return pgs
        for pg in pgs:
            remove_placement_group(pg)
        logger.warning("links probes: %d of %d blocks placed in %.0f s%s", len(ready), blocks,
                       timeout_s, " on the job's nodes; placing anywhere" if pinned else "")
    raise TimeoutError(f"placing {blocks} blocks of probes did not finish within "
                       f"{timeout_s:.0f} s")
