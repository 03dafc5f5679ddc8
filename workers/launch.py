"""Launch a job on local gloo ranks without Ray, for tests and debugging.

    python -m tenax.workers.launch JOB.yaml --nproc 4 [--set KEY=VALUE ...] [--log-json PATH]

Each process runs the rank loop (workers/rank.py `run_rank`, the same code `tenax run`'s agents
fork). The launcher only spawns processes on 127.0.0.1 and fails fast: when any rank dies, the
others are killed at once instead of waiting out a collective timeout.
"""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import sys
import time
from typing import Any, Callable

from tenax.workers.rank import RankHooks, RankOptions, run_rank
from tenax.workers.rendezvous import free_port

logger = logging.getLogger(__name__)


def _rank_process(spec_dict: dict, layout_dict: dict, rank: int, world: int, port: int,
                  queue: Any) -> None:
    def report(record: dict[str, Any]) -> None:
        if rank == 0:
            queue.put(record)

    try:
        run_rank(RankOptions(spec_dict, layout_dict, rank, world, "127.0.0.1", port),
                 RankHooks(on_step=report))
        queue.put({"event": "rank_done", "rank": rank})
    except BaseException as err:  # report every failure with its cause, DCP errors included
        queue.put({"event": "failure", "rank": rank, "cause": f"{type(err).__name__}: {err}"})
        raise


def launch(spec_dict: dict[str, Any], layout_dict: dict[str, Any], nproc: int,
           on_event: Callable[[dict[str, Any]], None], timeout_s: float,
           context: Any = None) -> bool:
    """Spawn `nproc` ranks; True when every rank finished. Kills all ranks on the first failure.
    `context`: the multiprocessing context to start them from (default: spawn)."""
    ctx = context or mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_process, args=(spec_dict, layout_dict, r, nproc, port, queue))
             for r in range(nproc)]
    for p in procs:
        p.start()
    done, ok, deadline = 0, True, time.monotonic() + timeout_s
    try:
        while done < nproc:
            event = _next_event(queue, procs, deadline)
            if event["event"] == "rank_done":
                done += 1
                continue
            on_event(event)
            if event["event"] == "failure":
                ok = False
                break
    finally:
        for p in procs:
            p.join(timeout=5 if ok else 0.1)
            if p.is_alive():
                p.kill()
    return ok


def _next_event(queue: Any, procs: list, deadline: float) -> dict[str, Any]:
    import queue as queue_mod

    while True:
        try:
            return queue.get(timeout=0.5)
        except queue_mod.Empty:
            pass
        dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if dead:
            return {"event": "failure", "rank": dead[0],
                    "cause": f"process exited with code {procs[dead[0]].exitcode}"}
        if time.monotonic() > deadline:
            return {"event": "failure", "rank": -1, "cause": "launcher timeout"}


def main(argv: list[str] | None = None) -> int:
    from tenax.parallel import LayoutError
    from tenax.workers.errors import SpecError
    from tenax.workers.events import human
    from tenax.workers.spec import layout_from_spec, load_spec

    parser = argparse.ArgumentParser(prog="python -m tenax.workers.launch",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("spec", nargs="?",
                        help="job spec (YAML/JSON); default: the embedded tiny job")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--log-json", help="write one JSON object per line to this path")
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        spec = load_spec(args.spec, args.overrides)
        layout = layout_from_spec(spec, args.nproc)
    except (SpecError, LayoutError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    sink = open(args.log_json, "a") if args.log_json else None

    def on_event(event: dict[str, Any]) -> None:
        print(human(event), flush=True)
        if sink:
            sink.write(json.dumps(event) + "\n")
            sink.flush()

    ok = launch(spec.to_dict(), layout.to_dict(), args.nproc, on_event, args.timeout_s)
    if sink:
        sink.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
