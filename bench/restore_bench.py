"""Restore from memory ÷ restore from storage of the same step, side by side on 2 gloo ranks.

    python -m bench.restore_bench [--quick] [--reps N] [--no-s3] [--json PATH]

Why: in-memory snapshots are only worth their host RAM if resuming from them is much
faster than resuming from the storage checkpoint of the same step (expect well below 1). Both
copies of step 1 come from the same processes: a dp2 ZeRO-1 trainer takes one step, then
`CheckpointManager.save(1)` writes storage and `MemorySnapshotter.snapshot(1)` the per-rank
snapshot into tmpfs (/dev/shm: what each rank's agent holds). Then, in fresh processes with the
same layout (and, as a second pair, resharded into tp2), reps alternate the sources:
- memory: rank 0 locates every rank's piece where it lies (sizes, what the agents' `locate`
  does) and assembles them into a committed version under /dev/shm by hard-linking them
  (checkpoint/memory/restore.py, what the agent of a node holding the pieces does; pieces from
  another node would be copied), then every rank runs `load(source_uri=<that>)`, which checks
  each rank's share of the crc32c while it reads;
- storage: every rank runs `load()` from checkpoint.uri: a local-disk `file://` directory,
  timed *warm* (its files still in the page cache: the node that wrote it, moments later) and
  *cold* (the files' pages dropped with posix_fadvise DONTNEED first, as a replacement node
  reading local disk would see), and the same files on `s3://` served by moto on 127.0.0.1
  (an object store, what checkpoint.uri is in production; moto on 2 shared cores is far
  slower than a real object store, so that ratio says only that a remote store pays per byte).
Times are the slowest rank's, between barriers.
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Iterator

from tenax.testing.scripts import exit_unless_run_as_module

exit_unless_run_as_module(__spec__, __file__)  # a path run stops here, before `bench.`

from bench.common import Report, parse_args, ratio

logger = logging.getLogger(__name__)

FULL = ["model.dim=512", "model.n_layers=6", "model.ffn_hidden=1376", "model.vocab_size=8192"]
QUICK = ["model.dim=256", "model.n_layers=4", "model.ffn_hidden=688", "model.vocab_size=4096"]
COMMON = ["model.n_heads=8", "model.n_kv_heads=4", "model.seq_len=64",
          "train.global_batch_size=4", "train.warmup_steps=0", "train.steps=100",
          "parallel.micro_batch_size=1", "checkpoint.keep_last=2"]
GENERATION = 1


def _spec(dims: list[str], uri: str) -> Any:
    from tenax.orchestrator.spec import load_spec

    return load_spec(overrides=dims + COMMON + [f"checkpoint.uri={uri}"])


def save_both_job(rank: int, world: int, root: str, dims: list[str],
                  snaps: str) -> dict[str, Any]:
    """One dp2 ZeRO-1 step, then step 1 to storage and to this rank's snapshot directory."""
    from tenax.checkpoint.collectives import all_ranks_agree
    from tenax.checkpoint.manager import CheckpointManager
    from tenax.checkpoint.memory.snapshot import MemorySnapshotter
    from tenax.parallel.layout import ParallelLayout
    from tenax.workers.checkpoint_config import checkpoint_config
    from tenax.workers.trainer import Trainer

    spec = _spec(dims, f"file://{root}/storage")
    trainer = Trainer(spec, ParallelLayout(dp=2, zero=1, micro_batch_size=1))
    trainer.run_step()
    done: list[dict[str, Any]] = []
    with CheckpointManager(checkpoint_config(spec), trainer, rank, world, timeout_s=300) as mgr:
        snapshotter = MemorySnapshotter(mgr.config, mgr.state, rank, world, f"{snaps}/snap-{rank}",
                                        GENERATION, all_ranks_agree, done.append)
        mgr.save(1)
        snapshotter.snapshot(1)
        snapshotter.close()
        mgr.wait()
    return {"snapshot": done}


def drop_page_cache(path: str) -> None:
    """Evict the clean pages of every file under `path` (only these files; nobody else's)."""
    for base, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(base, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _assemble(snaps: str, world: int, rep: int) -> tuple[str, float]:
    """Locate every rank's piece where it lies (sizes; the ranks check the checksums while
    they load) and commit them as one version in /dev/shm, linking the pieces: what an agent
    does for pieces held on its own node."""
    from tenax.checkpoint.memory.restore import assemble_version
    from tenax.checkpoint.memory.snapshot_store import SnapshotDir, snapshot_root

    t0 = time.perf_counter()
    pieces = []
    for r in range(world):
        store = SnapshotDir(f"{snaps}/snap-{r}")
        stamp, _ = store.paths(GENERATION, r, 1)
        pieces.append((stamp, os.path.join(store.series(GENERATION, r), "s1")))
    target = os.path.join(snapshot_root(), f"bench-restore-{os.getpid()}-{rep}")
    return assemble_version(target, pieces), time.perf_counter() - t0


def _timed(fn: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def load_reps_job(rank: int, world: int, root: str, dims: list[str], layout: dict[str, Any],
                  reps: int, snaps: str, s3: dict[str, Any] | None) -> dict[str, Any]:
    """Alternate memory / storage (warm, cold, s3) loads of step 1 into `layout`."""
    from tenax.checkpoint.manager import CheckpointManager
    from tenax.parallel.layout import ParallelLayout
    from tenax.workers.checkpoint_config import checkpoint_config
    from tenax.workers.trainer import Trainer

    spec = _spec(dims, f"file://{root}/storage")
    trainer = Trainer(spec, ParallelLayout.from_dict(layout))
    order = ["memory", "storage_warm", "storage_cold"] + (["storage_s3"] if s3 else [])
    times: dict[str, list[float]] = {k: [] for k in ["assemble", *order]}
    with CheckpointManager(checkpoint_config(spec), trainer, rank, world, timeout_s=300) as mgr:
        remote = CheckpointManager(checkpoint_config(_spec(dims, s3["uri"])), trainer, rank,
                                   world, timeout_s=300,
                                   storage_options=s3["options"]) if s3 else None
        for rep in range(reps):
            for kind in order if rep % 2 == 0 else order[::-1]:
                if kind == "memory":
                    _memory_rep(mgr, rank, world, snaps, rep, times)
                    continue
                if kind == "storage_cold" and rank == 0:
                    drop_page_cache(f"{root}/storage")
                times[kind].append(_timed(remote.load if kind == "storage_s3" else mgr.load))
        events = mgr.drain_events() + (remote.drain_events() if remote else [])
        if remote is not None:
            remote.close()
    sources = sorted({e.get("source") for e in events if e["event"] == "checkpoint_loaded"})
    return {"times": times, "sources": sources, "step": trainer.step} if rank == 0 else {}


def _memory_rep(mgr: Any, rank: int, world: int, snaps: str, rep: int,
                times: dict[str, list[float]]) -> None:
    import shutil

    import torch.distributed as dist

    box: list[Any] = [None, 0.0]
    if rank == 0:
        box = list(_assemble(snaps, world, rep))
    dist.broadcast_object_list(box, src=0)
    times["assemble"].append(box[1])
    times["memory"].append(_timed(lambda: mgr.load(source_uri=box[0])))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(box[0][len("file://"):], ignore_errors=True)


def _tmpfs() -> str:
    """Where agents keep snapshots (tmpfs): the assembly links pieces, so the same filesystem."""
    from tenax.checkpoint.memory.snapshot_store import snapshot_root

    os.makedirs(snapshot_root(), exist_ok=True)
    return snapshot_root()


@contextlib.contextmanager
def moto_s3(wanted: bool) -> Iterator[dict[str, Any] | None]:
    """A moto S3 server on 127.0.0.1 (an object store, what checkpoint.uri is in production;
    every byte still stays on this machine); None if not wanted or not installed."""
    try:
        from moto.server import ThreadedMotoServer
    except ImportError as exc:
        logger.warning("no s3 case: %s", exc)
        wanted = False
    if importlib.util.find_spec("s3fs") is None:  # fsspec's s3:// needs it in every rank
        logger.warning("no s3 case: s3fs is not installed")
        wanted = False
    if not wanted:
        yield None
        return
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    fake = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    for key, value in fake.items():
        os.environ.setdefault(key, value)  # the rank processes inherit them
    options = {"endpoint_url": f"http://{host}:{port}", "key": "testing", "secret": "testing",
               "skip_instance_cache": True}
    try:
        yield {"uri": "s3://tenax-bench/restore", "options": options}
    finally:
        server.stop()


def upload(local: str, s3: dict[str, Any]) -> None:
    import fsspec

    fs = fsspec.filesystem("s3", **s3["options"])
    fs.mkdir("tenax-bench")
    fs.put(f"{local}/", "tenax-bench/restore/", recursive=True)


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def add_rows(report: Report, name: str, t: dict[str, list[float]]) -> None:
    mem_total = [a + m for a, m in zip(t["assemble"], t["memory"])]
    for storage in [k for k in ("storage_warm", "storage_cold", "storage_s3") if t.get(k)]:
        label = storage.split("_")[1]
        report.add(f"{name}: memory load ÷ storage load ({label})",
                   ratio(_med(t["memory"]), _med(t[storage])), "<= 1",
                   f"median {_med(t['memory']):.3f} s vs {_med(t[storage]):.3f} s")
        report.add(f"{name}: memory read+assemble+load ÷ storage load ({label})",
                   ratio(_med(mem_total), _med(t[storage])), "<= 1",
                   f"{_med(t['assemble']):.3f} s read+assemble + {_med(t['memory']):.3f} s load "
                   f"vs {_med(t[storage]):.3f} s")


def main() -> int:
    def extra(p: Any) -> None:
        p.add_argument("--reps", type=int, default=0)
        p.add_argument("--no-s3", action="store_true", help="skip the s3:// (moto) storage case")

    args = parse_args(__doc__, extra)
    from tenax.testing.ranks import run_ranks

    dims = QUICK if args.quick else FULL
    reps = args.reps or (4 if args.quick else 8)
    report = Report("Restore from memory vs from storage, same step, side by side")
    context: dict[str, Any] = {"quick": args.quick, "dims": dims, "reps": reps,
                               "load_avg_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="tenax-restore-", dir="/var/tmp") as root, \
            tempfile.TemporaryDirectory(prefix="bench-", dir=_tmpfs()) as snaps, \
            moto_s3(not args.no_s3) as s3:
        saved = run_ranks(save_both_job, 2, root, dims, snaps, timeout_s=900)
        sizes = [e["bytes"] for r in saved for e in r["snapshot"]]
        report.add("snapshot of one rank (dp2 ZeRO-1)", max(sizes) / 2**20, unit="MiB",
                   note=f"ranks: {[round(s / 2**20, 1) for s in sizes]} MiB")
        if s3:
            upload(f"{root}/storage", s3)
        for name, layout in (("same layout dp2", {"dp": 2, "zero": 1, "micro_batch_size": 1}),
                             ("resharded into tp2", {"tp": 2, "micro_batch_size": 1})):
            out = run_ranks(load_reps_job, 2, root, dims, layout, reps, snaps, s3,
                            timeout_s=1800)[0]
            if out["step"] != 1 or out["sources"] != ["memory", "storage"]:
                raise RuntimeError(f"{name}: loaded step {out['step']} from {out['sources']}")
            add_rows(report, name, out["times"])
            context[name] = out
    context["load_avg_after"] = os.getloadavg()
    report.context = context
    report.finish(args.json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
