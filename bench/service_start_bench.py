"""Service job start: submit -> first step of a job on `tenax serve`, when the job's training
processes fork from the service's own forkserver vs from a zygote that imports for the job.

    python -m bench.service_start_bench [--quick] [--json PATH] [--reps R] [--jobs J]

Why: every job a service runs pays its placement, its agents and the first fork; an embedded
service (`tenax serve` without `--address`) starts its node's forkserver before Ray, and every
job's zygote on that node adopts it, so no job imports the training stack. A service joined to
a cluster (`--address`) cannot: each job's zygote starts a forkserver of its own, whose imports
overlap the agents' start. Both run the same code in one run, interleaved: `tenax serve --gpus 2
--cpus 2` (embedded), then `tenax serve --address` of a `ray start --head` with the same
resources. Each service runs `--jobs` 2-rank tiny jobs one after the other (the first job is
the first on that Ray, the next ones find it warm). Figure: the median of joined ÷ embedded
submit -> first step (the clock: this process before SubmitJob; the first step: the `step`
event's wall time). Ray's own start is outside both clocks.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tenax.testing.scripts import exit_unless_run_as_module

exit_unless_run_as_module(__spec__, __file__)  # a path run stops here, before `bench.`

logger = logging.getLogger(__name__)

RAY_PORT, TIMEOUT_S = 6391, 300


def serve(args: list[str], tmp: Path) -> tuple[subprocess.Popen, int]:
    """`tenax serve` in a subprocess; (process, port) once its ready line came."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tenax.orchestrator.cli.main", "serve", "--port", "0",
         "--no-metrics", "--state-dir", str(tmp / f"state-{time.monotonic_ns()}"),
         "--storage-root", f"file://{tmp}", *args],
        stdout=subprocess.PIPE, stderr=open(tmp / "serve.log", "ab"), text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    try:
        line = lines.get(timeout=TIMEOUT_S)
    except queue.Empty:
        proc.kill()
        raise RuntimeError("tenax serve did not become ready") from None
    return proc, int(line.split("listening on ")[1].split(";")[0].rsplit(":", 1)[1])


def first_steps(port: int, tmp: Path, jobs: int) -> list[float]:
    """Submit `jobs` tiny 2-rank jobs one after the other: submit -> first step of each."""
    import grpc

    from tenax.proto import jobs_pb2 as pb
    from tenax.proto import jobs_pb2_grpc as pb_grpc
    from tenax.testing.jobs import job_overrides

    stub = pb_grpc.JobServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    seconds = []
    for k in range(jobs):
        overrides = job_overrides(tmp, f"svc{k}", ["train.steps=3", "resources.nodes=1",
                                                   "resources.gpus_per_node=2"])
        submitted = time.time()
        job_id = stub.SubmitJob(pb.SubmitJobRequest(spec_json="{}", overrides=overrides),
                                timeout=30).job_id
        first = None
        for message in stub.WatchJob(pb.WatchJobRequest(job_id=job_id), timeout=TIMEOUT_S):
            event = json.loads(message.json)
            if first is None and message.kind == "step":
                first = event["time"]
        if first is None:
            raise RuntimeError(f"job {job_id} ended without a step ({tmp / 'serve.log'})")
        seconds.append(first - submitted)
    return seconds


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()


def kill_mentioning(text: str) -> None:
    """SIGKILL the processes whose command line mentions `text` (this bench's Ray only)."""
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text.encode() in (entry / "cmdline").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue


def one_pair(tmp: Path, jobs: int) -> tuple[list[float], list[float]]:
    proc, port = serve(["--gpus", "2", "--cpus", "2"], tmp)
    try:
        embedded = first_steps(port, tmp, jobs)
    finally:
        stop(proc)
    ray_tmp = tempfile.mkdtemp(prefix="tx-ray-", dir="/tmp")  # short: Ray's socket paths
    subprocess.run(["ray", "start", "--head", "--num-gpus", "2", "--num-cpus", "2",
                    "--node-ip-address", "127.0.0.1", "--port", str(RAY_PORT), "--temp-dir",
                    ray_tmp, "--include-dashboard", "false"], check=True, capture_output=True,
                   timeout=TIMEOUT_S)
    try:
        proc, port = serve(["--address", f"127.0.0.1:{RAY_PORT}"], tmp)
        try:
            joined = first_steps(port, tmp, jobs)
        finally:
            stop(proc)
    finally:
        kill_mentioning(ray_tmp)
    return embedded, joined


def main() -> int:
    from bench.common import Report, compile_tenax, parse_args

    args = parse_args(__doc__, lambda p: (p.add_argument("--reps", type=int, default=0),
                                          p.add_argument("--jobs", type=int, default=2)))
    reps = args.reps or (1 if args.quick else 3)
    compile_tenax()  # as installed from a wheel (bench/common.py)
    embedded, joined = [], []
    with tempfile.TemporaryDirectory(prefix="tenax-svcstart-") as tmp:
        for rep in range(reps):
            e, j = one_pair(Path(tmp), args.jobs)
            embedded += e
            joined += j
            logger.info("rep %d: embedded %s, joined %s", rep, e, j)
    rep = Report("Service job start: submit → first step, the service's forkserver vs a "
                 "zygote's own")
    rep.add("joined ÷ embedded, submit → first step", statistics.median(joined)
            / statistics.median(embedded), ">= 1",
            f"embedded {statistics.median(embedded):.2f} s, joined "
            f"{statistics.median(joined):.2f} s (medians of {len(embedded)} jobs)")
    rep.add("embedded: first job on its Ray", embedded[0], unit="s")
    rep.add("joined: first job on its Ray", joined[0], unit="s")
    rep.context = {"quick": args.quick, "embedded_s": embedded, "joined_s": joined,
                   "jobs_per_service": args.jobs}
    rep.finish(args.json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
