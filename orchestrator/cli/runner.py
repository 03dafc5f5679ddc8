"""`tenax run`: run one job in the foreground on Ray, with a progress bar and a JSON log.

Without `--address` an embedded local Ray is started (on 127.0.0.1, private temp dir, one fake
GPU slot per rank when the machine has none) and shut down afterwards. Exit code 0 only when
the job reached train.steps. Ctrl-C or SIGTERM (what a batch scheduler or `kill` sends) stops
the workers; committed checkpoints stay intact, so running the same command again resumes.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import logging
import sys
import threading
from typing import Any, Iterator, TextIO

from rich.markup import escape

from tenax.orchestrator.chaos.faults import parse_chaos, validate_for_job
from tenax.orchestrator.cli.signals import handling_sigterm
from tenax.orchestrator.spec import JobSpec
from tenax.workers import human, layout_text

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def ray_session(address: str | None, spec: JobSpec) -> Iterator[dict[str, Any] | None]:
    """Connect to a cluster, or start (and later stop) an embedded one on loopback. Yields the
    forkserver to adopt ({"node_id", "endpoint"}; None when connecting): for an embedded Ray,
    this node's training stack is imported by a forkserver started before Ray, so that the
    imports (3-5 s of CPU) overlap Ray's start instead of following it."""
    ray_module = sys.modules.get("ray")  # maybe half imported yet, by `importing_beside`
    if ray_module is not None and getattr(ray_module, "is_initialized", bool)():
        yield None
        return
    if address:
        import ray

        ray.init(address=address, log_to_driver=False)
        try:
            yield None
        finally:
            ray.shutdown()
        return
    from tenax.orchestrator.service.submission import connect_ray

    # The forkserver starts before Ray: it imports while Ray starts.
    link = connect_ray(None, spec.resources.max_nodes * spec.resources.gpus_per_node, None)
    try:
        yield link.forkserver
    finally:
        import ray

        ray.shutdown()
        link.close()


@contextlib.contextmanager
def sigterm_interrupts(controller: Any) -> Iterator[None]:
    """SIGTERM stops the job the way Ctrl-C does (a KeyboardInterrupt the controller turns into
    CANCELLED after stopping the workers) instead of killing this process before it can stop
    them. Why not rely on SIGINT alone: a job started in the background (`nohup ... &`) has
    SIGINT ignored, and schedulers send SIGTERM. A second SIGTERM while stopping is logged,
    not raised, so the stop itself is never cut short."""
    fired = threading.Event()

    def handler(signum: int, frame: Any) -> None:
        if fired.is_set():
            logger.warning("already stopping the job (SIGTERM ignored); SIGKILL stops at once")
            return
        fired.set()
        # The name travels through the controller, not on the exception: one raised inside a
        # Ray call comes out of it as a plain KeyboardInterrupt (the cause would then read
        # "Ctrl-C"). `note_interrupt` stores one attribute, which is safe in a handler;
        # posting to the inbox would take a lock the interrupted loop may hold.
        controller.note_interrupt("SIGTERM")
        raise KeyboardInterrupt

    with handling_sigterm(handler):
        yield


class EventSink:
    """Fans each event out to the JSON log, the console and an optional extra callback."""

    def __init__(self, log_json: str | None, console: Any, progress: Any, task: Any,
                 steps: int) -> None:
        self.file: TextIO | None = open(log_json, "a") if log_json else None
        self.console, self.progress, self.task, self.steps = console, progress, task, steps
        self.extra: list[Any] = []

    def __call__(self, event: dict[str, Any]) -> None:
        if self.file:
            self.file.write(json.dumps({k: v for k, v in event.items() if k != "job"}) + "\n")
            self.file.flush()
        for callback in self.extra:
            callback(event)
        kind = event.get("event")
        if kind == "step" and self.progress is not None:
            self.progress.update(self.task, completed=event["step"],
                                 description=f"loss {event['loss']:.4f} | "
                                 f"{event['tokens_per_s']:.0f} tok/s | "
                                 f"{layout_text(event['layout'])}")
        elif kind == "done" and self.progress is not None:
            # a job resumed at its last step never steps: the bar must still say where it is
            self.progress.update(self.task, completed=event["step"],
                                 description="already complete" if event.get("already_complete")
                                 else "done")
        ended = kind == "state" and event["state"] in ("FAILED", "CANCELLED", "SUCCEEDED")
        if kind in LOUD or ended:
            self.console.print(_styled(event))
        elif kind == "checkpoint":
            self.console.print(f"[dim]{escape(human(event))}[/dim]")
        elif kind == "eval":
            self.console.print(f"[cyan]{escape(human(event))}[/cyan]")

    def close(self) -> None:
        if self.file:
            self.file.close()


LOUD = {"queued": "yellow", "admitted": "green", "failure": "red", "recovered": "green",
        "checkpoint_failed": "yellow", "done": "bold", "chaos": "magenta", "scaled": "cyan",
        "straggler": "yellow", "profile": "cyan", "tracking_off": "yellow",
        "snapshots_off": "yellow"}


def _styled(event: dict[str, Any]) -> str:
    """The event's sentence, coloured by kind for the console."""
    text = escape(human(event))
    style = LOUD.get(event.get("event", ""))
    return f"[{style}]{text}[/{style}]" if style else text


def _queue(spec: JobSpec, sink: EventSink) -> str | None:
    """Wait for the job's GPUs on a shared cluster (orchestrator/service/scheduler.py)."""
    from tenax.orchestrator.service.scheduler import wait_for_gpus
    from tenax.workers import Event

    return wait_for_gpus(spec, lambda kind, **f: sink(Event.make(kind, **f).to_dict()))


def tracking_id(spec: JobSpec) -> str:
    """What names `tenax run`'s W&B run: the spec's name and checkpoint URI, not the job id
    (random per process), so running the job again on its checkpoint resumes the same run."""
    from tenax.workers.tracking import wandb_run_id

    return wandb_run_id("", spec.to_dict())


CONTROLLER_MODULES = ("tenax.orchestrator.job.controller", "tenax.orchestrator.cli.preflight")


def importing_beside(modules: tuple[str, ...]) -> threading.Thread:
    """`modules` imported on a thread. While an embedded Ray starts, this process mostly waits
    for Ray's processes, so the controller's imports (~0.15 s beyond Ray's own) overlap that
    start instead of delaying it. A module that fails to import fails again, and is reported,
    where the caller imports it."""

    def run() -> None:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception as err:  # the caller's own import raises it
                logger.debug("importing %s beside Ray's start: %s", name, err)
                return

    thread = threading.Thread(target=run, name="tenax-imports", daemon=True)
    thread.start()
    return thread


def progress_bar(console: Any) -> Any:
    """The job's bar: name, steps done of train.steps, the newest event, time elapsed."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[bold]{task.fields[name]}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                    transient=False)


def run_job(spec: JobSpec, chaos_spec: str | None = None, log_json: str | None = None,
            address: str | None = None, metrics_port: int | None = None,
            preflight: bool = False) -> int:
    from rich.console import Console

    controller_imports = importing_beside(CONTROLLER_MODULES)
    chaos = parse_chaos(chaos_spec)
    validate_for_job(chaos, spec.resources.world_size, spec.resources.nodes, spec.train.steps)
    if spec.model.init_from is not None:  # bad weights refuse the job (exit 2), before Ray
        from tenax.workers.hf import check_init_from

        check_init_from(spec)
    console = Console(stderr=True)
    progress = progress_bar(console)
    with ray_session(address, spec) as forkserver, progress:
        controller_imports.join()
        from tenax.orchestrator.cli.preflight import preflight_gate
        from tenax.orchestrator.job.controller import Controller, ControllerOptions, JobState
        from tenax.orchestrator.job.goodput_cold_start import process_started_at

        task = progress.add_task("starting", total=spec.train.steps, name=spec.name)
        sink = EventSink(log_json, console, progress, task, spec.train.steps)
        if address and (why := _queue(spec, sink)) is not None:  # a shared cluster: queue
            sink.close()
            console.print(f"Job {spec.name} not started: {escape(why)}.")
            return 1
        if (why := preflight_gate(spec, preflight, sink, console, forkserver)) is not None:
            sink.close()
            console.print(f"Job {spec.name} not started: {escape(why)}.")
            return 1
        controller = Controller(spec, ControllerOptions(on_event=sink, chaos=chaos,
                                                        launched_at=process_started_at(),
                                                        forkserver=forkserver,
                                                        tracking_id=tracking_id(spec)))
        metrics = None
        if metrics_port:
            from tenax.orchestrator.job.metrics import serve_metrics

            metrics = serve_metrics(controller, metrics_port, sink)
        try:
            with sigterm_interrupts(controller):
                state = controller.run()
        finally:
            sink.close()
            if metrics is not None:
                metrics.close()
    console.print(f"Job {controller.job_id} ended {state.value} at step {controller.step}"
                  + (f": {escape(controller.cause)}" if controller.cause else "") + ".")
    return 0 if state == JobState.SUCCEEDED and controller.step >= spec.train.steps else 1
