"""Running the job itself for a few steps, on scratch checkpoints, and reading what it did.

`run_preflight(spec, steps)` (Ray must already run): the data row in this process; the
planner's per-rank memory for the layout vs the budget, before any rank starts; then the job
itself, on its own placement and layout, for `steps` steps with its checkpoints under
`<checkpoint.uri>/preflight-<time>` (removed afterwards, so the real run starts at step 0 as
if no preflight had run). The smoke job runs with max_restarts=0, so a hang or a dead rank
ends it and fails the progress row (naming the rank, the kind and where a hang's stacks are
kept: those stay under the scratch location's `diagnostics/`). It saves at steps-1 and steps;
the recovery row (recovery.py) resumes steps-1 into another layout and restores one in-memory
snapshot. Between the two, the links probes (links_probe.py) time each parallel dimension's
collective on the slots the smoke job used. With `resources.exclude_slow_nodes` a node the
rows single out is held from the job and everything runs once more (screening.py). The
scratch jobs' own events stay here; only the `preflight` event is published.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ContextManager, Sequence

from tenax.orchestrator.errors import PreflightInterrupted
from tenax.orchestrator.preflight.data import data_row
from tenax.orchestrator.preflight.recovery import recovery_check
from tenax.orchestrator.preflight.rows import (Row, memory_plan_row, memory_row, overall,
                                               progress_row, slow_ranks, throughput_row)
from tenax.orchestrator.timeouts import Timeouts

logger = logging.getLogger(__name__)

DEFAULT_STEPS = 20  # without --steps and without spec.preflight
Guard = Callable[[Any], ContextManager[None]]  # wraps a scratch Controller's run


@dataclass
class Report:
    """The rows and the verdict of one preflight."""
    rows: list[Row]
    scratch_uri: str = ""
    slow_node: str = ""  # the Ray node the rows single out ("" none; see screening.py)
    slow_node_name: str = ""  # as the rows name it: "node K (id)"
    kept: str = ""  # a hang's stacks under the scratch location, kept when it is removed
    cordon: Any = None  # exclude_slow_nodes: the hold that keeps the job off slow_node

    @property
    def held_node(self) -> str:
        """The node this preflight keeps from every job ("" when none)."""
        return self.cordon.node_id if self.cordon is not None else ""

    def release(self) -> None:
        """Give back a node this preflight kept from the job (call when the job ends)."""
        if self.cordon is not None:
            self.cordon.release()
            self.cordon = None

    @property
    def verdict(self) -> str:
        return overall(self.rows)

    def failing(self) -> list[Row]:
        return [r for r in self.rows if r.verdict == "fail"]

    def cause(self) -> str:
        """The failing rows, as one line (the cause a job that required the preflight ends
        with)."""
        return "preflight failed: " + "; ".join(f"{r.name}: {r.detail or r.measured}"
                                                for r in self.failing())

    def summary(self) -> str:
        """The verdict and every row that did not pass, in words (a job's status shows it)."""
        flagged = [f"{r.name} {r.verdict}: {r.detail or r.measured}" for r in self.rows
                   if r.verdict != "pass"]
        return "; ".join([self.verdict, *flagged])

    def to_dict(self) -> dict[str, Any]:
        return {"rows": [r.to_dict() for r in self.rows], "verdict": self.verdict}


@dataclass(frozen=True)
class ScratchOptions:
    """How the scratch jobs run: the caller's guard, a drill's faults, the allotted nodes, the
    launcher's forkserver (`ControllerOptions.forkserver`)."""
    guard: Guard | None = None
    chaos: tuple[Any, ...] = ()
    capacity_limit: Callable[[], int] | None = None
    forkserver: dict[str, Any] | None = None


@dataclass
class Watch:
    """What one scratch job did: rank 0's losses by step, and per rank its peak memory and
    its throughput samples (every rank's step records, from the controller's polls); the
    controller's `failure` and `recovered` events, and why snapshots were off (if they were)."""
    losses: dict[int, float] = field(default_factory=dict)
    peaks: dict[int, int] = field(default_factory=dict)
    throughput: dict[int, list[float]] = field(default_factory=dict)
    resumed_from: int | None = None
    cuda: bool = False
    node_ids: list[str] = field(default_factory=list)  # per rank, of the newest placement
    failures: list[dict[str, Any]] = field(default_factory=list)
    recovered: list[dict[str, Any]] = field(default_factory=list)
    snapshots_off: str = ""

    def on_event(self, doc: dict[str, Any]) -> None:
        """The controller's events (a subscriber): failures, recoveries, snapshots off."""
        kind = doc.get("event")
        if kind == "failure":
            self.failures.append(doc)
        elif kind == "recovered":
            self.recovered.append(doc)
        elif kind == "snapshots_off":
            self.snapshots_off = str(doc.get("reason", "")) or "no reason given"

    def observe(self, controller: Any, records: list[dict[str, Any]]) -> None:
        group = getattr(controller, "group", None)
        if group is not None and group.ranks:
            self.node_ids = [h.node_id for h in group.ranks]
        for r in records:
            rank = int(r.get("rank", 0))
            if r.get("event") == "started" and rank == 0:
                self.resumed_from = r.get("resumed_from")
            if r.get("event") != "step" or r.get("loss") is None:
                continue
            if rank == 0:
                self.losses[int(r["step"])] = float(r["loss"])
            self.cuda = self.cuda or "peak_allocated_bytes" in r
            peak = int(r.get("peak_allocated_bytes", r.get("max_rss_bytes", 0)))
            self.peaks[rank] = max(self.peaks.get(rank, 0), peak)
            self.throughput.setdefault(rank, []).append(float(r.get("rank_tokens_per_s", 0.0)))

    def rank_tokens_per_s(self) -> dict[int, float]:
        """Mean per rank, the first step left out when there are more (start-up, warm-up)."""
        return {rank: sum(v[1:] or v) / len(v[1:] or v) for rank, v in self.throughput.items()}


def preflight_steps(spec: Any, steps: int | None) -> int:
    """--steps, else spec.preflight.steps, else DEFAULT_STEPS."""
    if steps is not None:
        if steps < 1:
            raise ValueError(f"--steps: must be at least 1, got {steps}")
        return steps
    return spec.preflight.steps if spec.preflight is not None else DEFAULT_STEPS


def scratch_spec(spec: Any, steps: int, uri: str) -> Any:
    """The job as it will run, for `steps` steps on scratch checkpoints saved at steps-1 and
    steps, without the run's experiment tracking, and without restarts: a hang or a dead rank
    must end the smoke job (and fail the progress row), not be recovered from."""
    from tenax.orchestrator.spec import spec_from_dict

    raw = spec.to_dict()
    raw["train"]["steps"] = steps
    ckpt = raw["checkpoint"]
    ckpt.update(uri=uri, every_steps=max(1, steps - 1), keep_last=max(2, ckpt["keep_last"]),
                keep_every=0)
    raw["logging"] = {"tensorboard_dir": None, "wandb": None}
    raw["fault_tolerance"]["max_restarts"] = 0
    raw["preflight"] = None
    return spec_from_dict(raw)


def run_preflight(spec: Any, steps: int | None = None,
                  publish: Callable[[str, dict[str, Any]], None] | None = None,
                  guard: Guard | None = None, chaos: Sequence[Any] = (),
                  capacity_limit: Callable[[], int] | None = None,
                  forkserver: dict[str, Any] | None = None) -> Report:
    """Smoke-test `spec` (see the module doc); `publish(kind, fields)` gets the event;
    `guard(controller)` wraps each scratch job's run (e.g. SIGTERM handling); `chaos`: a
    drill's faults (`ChaosEvent`s) for the smoke job and the links probes; `capacity_limit`:
    the nodes a scheduler allots the job (the scratch jobs never plan for more); `forkserver`:
    the one `tenax run` started beside its embedded Ray, for the scratch jobs' agents."""
    from tenax.orchestrator.preflight.screening import screened

    options = ScratchOptions(guard, tuple(chaos), capacity_limit, forkserver)
    n = preflight_steps(spec, steps)
    report = preflight_once(spec, n, options)
    if spec.resources.exclude_slow_nodes and report.slow_node:
        report = screened(report, lambda: preflight_once(spec, n, options),
                          Timeouts.from_spec(spec).hang_timeout_s)
    if publish is not None:
        publish("preflight", report.to_dict())
    return report


def preflight_once(spec: Any, n: int, options: ScratchOptions) -> Report:
    """Every row once (see the module doc), without publishing."""
    report = Report([data_row(spec, n)])
    estimate = _plan_rows(spec, report)
    if not report.failing():
        root = spec.checkpoint.uri.rstrip("/")
        uri = f"{root}/preflight-{time.strftime('%Y%m%dT%H%M%S')}"
        report.scratch_uri = uri
        root_existed = exists(root)
        try:
            _run_rows(scratch_spec(spec, n, uri), n, estimate, report, options)
        finally:
            remove_tree(uri, keep=("diagnostics",) if report.kept else ())
            if not root_existed:  # leave the job's root as the preflight found it
                remove_tree(root, only_if_empty=True)
    return report


def _plan_rows(spec: Any, report: Report) -> Any:
    """The memory row before any rank starts; the planner's estimate (None if none fits)."""
    from tenax.orchestrator.spec import plan_for_spec
    from tenax.parallel import PlanError

    from tenax.orchestrator.placement import cluster_gpus

    r = spec.resources
    try:  # the memory the controller will plan with: Ray may name the GPUs
        plan = plan_for_spec(spec, r.world_size, r.gpus_per_node, pin_zero=True,
                             detected=cluster_gpus(r.gpus_per_node))
    except PlanError as err:
        report.rows.append(Row("memory", "no layout fits", f"a layout of {r.world_size} ranks",
                               "fail", str(err).splitlines()[0]))
        return None
    best = plan.best
    report.rows.append(memory_plan_row(best.memory.total, best.budget_bytes,
                                       plan.layout.describe()))
    return best


def _run_rows(spec: Any, steps: int, estimate: Any, report: Report,
              options: "ScratchOptions") -> None:
    """Progress, throughput and memory of the scratch job; the links; the recovery row."""
    watch, controller = run_scratch(spec, options)
    report.rows.pop()  # the plan-time memory row: the measured one replaces it
    losses = [watch.losses[s] for s in sorted(watch.losses)]
    report.rows.append(memory_row(watch.peaks, estimate.memory.total, estimate.budget_bytes,
                                  watch.cuda, layout_name(controller, estimate)))
    failures = [{**f, "odd": odd_ranks(f["diagnostics"])} if f.get("diagnostics") else f
                for f in watch.failures]
    report.rows.append(progress_row(losses, steps, controller.state.value, controller.cause,
                                    failures))
    report.kept = next((f["diagnostics"] for f in watch.failures if f.get("diagnostics")), "")
    _node_rows(spec, watch, controller.layout or estimate.layout, estimate, report, options)
    if steps < 2:
        report.rows.append(Row("recovery", "not run", "--steps >= 2", "warn",
                               "one step leaves no earlier checkpoint to resume from"))
    elif controller.state.value == "SUCCEEDED" and not watch.failures:
        ran = controller.layout or estimate.layout
        report.rows.append(recovery_check(spec, steps, watch.losses, ran,
                                          functools.partial(run_with, options)))
    else:
        report.rows.append(Row("recovery", "not run", f"step {steps - 1} resumed", "warn",
                               "the smoke run did not finish (see progress)"))


def _node_rows(spec: Any, watch: Watch, layout: Any, estimate: Any, report: Report,
               options: ScratchOptions) -> None:
    """Throughput and links, and the node they single out (if one)."""
    from tenax.orchestrator.preflight.links import node_names
    from tenax.orchestrator.preflight.links_probe import measure_links
    from tenax.orchestrator.preflight.screening import singled_out

    names = node_names(watch.node_ids, spec.resources.gpus_per_node)
    per_rank = watch.rank_tokens_per_s()
    planned = estimate.tokens_per_s if watch.cuda else None  # the ranks ran on GPUs
    report.rows.append(throughput_row(per_rank, planned, names))
    row, slow_groups = measure_links(spec, layout, options.chaos, watch.node_ids)
    report.rows.append(row)
    slow = [watch.node_ids[r] for r in slow_ranks(per_rank) if r < len(watch.node_ids)]
    report.slow_node = singled_out(slow_groups, slow, set(watch.node_ids))
    if report.slow_node:
        report.slow_node_name = names[watch.node_ids.index(report.slow_node)]


def odd_ranks(location: str) -> list[int]:
    """The ranks a hang's stacks single out (`tenax diagnose`); [] when they cannot be read
    (the row still names where they are)."""
    from tenax.workers import diagnose, read_stacks

    try:
        return list(diagnose(read_stacks(location)).odd)
    except (OSError, ValueError) as err:
        logger.warning("could not read the stacks at %s: %s", location, err)
        return []


def layout_name(controller: Any, estimate: Any) -> str:
    """The layout the job ran, saying so when the planner's figure is for another one (the
    controller steps down to fewer GPUs when not all of them are there)."""
    ran = controller.layout or estimate.layout
    if ran.to_dict() != estimate.layout.to_dict():
        return f"{ran.describe()} (the planner's figure is for {estimate.layout.describe()})"
    return ran.describe()


def run_with(options: ScratchOptions, spec: Any, faults: tuple[Any, ...] | None) -> Watch:
    """`run_scratch` with `faults` in place of the drill's (None: the drill's)."""
    chaos = options.chaos if faults is None else faults
    return run_scratch(spec, replace(options, chaos=chaos))[0]


def run_scratch(spec: Any, options: ScratchOptions = ScratchOptions()) -> tuple[Watch, Any]:
    """Run the scratch job to its end in this thread (its events are not relayed)."""
    from tenax.orchestrator.job.controller import Controller, ControllerOptions

    watch = Watch()
    controller = Controller(spec, ControllerOptions(chaos=options.chaos,
                                                    capacity_limit=options.capacity_limit,
                                                    forkserver=options.forkserver))
    controller.add_observer(watch.observe)
    controller.subscribe(watch.on_event)
    guard = options.guard
    with guard(controller) if guard is not None else contextlib.nullcontext():
        controller.run()
    if controller.state.value == "CANCELLED":
        why = controller.cause or "interrupted (Ctrl-C or SIGTERM)"
        raise PreflightInterrupted(f"the preflight job was stopped: {why}")
    logger.info("preflight job %s ended %s at step %d", controller.job_id,
                controller.state.value, controller.step)
    return watch, controller


def exists(uri: str) -> bool:
    import fsspec

    fs, path = fsspec.core.url_to_fs(uri)
    return bool(fs.exists(path))


def remove_tree(uri: str, only_if_empty: bool = False, keep: Sequence[str] = ()) -> None:
    """Delete the scratch checkpoints, but for the children named in `keep` (a hang's
    stacks); a failure is logged (the run itself is unaffected)."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(uri)
    try:
        if not fs.exists(path) or (only_if_empty and fs.ls(path)):
            return
        if not keep:
            fs.rm(path, recursive=True)
            return
        for child in fs.ls(path, detail=False):
            if child.rstrip("/").rsplit("/", 1)[-1] not in keep:
                fs.rm(child, recursive=True)
    except OSError as err:
        logger.warning("could not remove the preflight checkpoints at %s: %s", uri, err)
