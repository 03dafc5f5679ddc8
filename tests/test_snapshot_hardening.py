"""In-memory snapshots on a tmpfs that fills up: a clean ENOSPC and snapshots off, never a
SIGBUS that kills the job; the tmpfs's room is part of the placement's memory plan."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import types
from pathlib import Path
from typing import Any

import pytest

from tests.distributed import run_ranks
from tests.snapshot_hardening_jobs import out_of_space_job

pytestmark = pytest.mark.timeout(300)


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str, extra: str = ""):
    """A tmpfs of `size` mounted at `path` (skips the test where mounting is not permitted);
    `extra`: more mount options (",nr_inodes=N")."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700{extra}",
                           "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture
def tmpfs_1m(tmp_path):
    with small_tmpfs(tmp_path / "tmpfs", "1m") as path:
        yield path


MAP_AND_WRITE = """
import errno, sys
from tenax.checkpoint.memory.buffer_maps import BufferMaps
maps = BufferMaps(limit=2)
try:
    view = maps.mapping(sys.argv[1], 4 << 20)
    view[:] = b"x" * (4 << 20)
    print("written")
except OSError as exc:
    print("ENOSPC" if exc.errno == errno.ENOSPC else f"other {exc}")
"""


def test_a_buffer_larger_than_the_tmpfs_is_a_clean_enospc_not_a_sigbus(tmpfs_1m):
    target = tmpfs_1m / "buffer"
    done = subprocess.run([sys.executable, "-c", MAP_AND_WRITE, str(target)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"the writer died ({done.returncode}): {done.stderr[-500:]}"
    assert done.stdout.split() == ["ENOSPC"]
    assert target.stat().st_size == 0  # a refused buffer holds no pages
    st = os.statvfs(tmpfs_1m)
    assert st.f_bfree == st.f_blocks  # the tmpfs is empty again


@pytest.mark.slow
def test_a_full_tmpfs_turns_every_ranks_snapshots_off_and_training_goes_on(tmpfs_1m, tmp_path):
    """Rank 0's second buffer does not fit its tmpfs; at the next snapshot every rank (rank 1
    has room) agrees to stop, says so once, and takes no snapshot, local ones included."""
    roots = [str(tmpfs_1m / "r0"), str(tmp_path / "r1")]
    results = run_ranks(out_of_space_job, 2, roots, 150_000, 6)  # ~600 KB a snapshot
    for rank, result in enumerate(results):
        off = [e for e in result["events"] if e["event"] == "snapshots_off"]
        assert len(off) == 1 and off[0]["step"] == 3, result["events"]
        assert result["stopped"] and result["partials"] == []
        later = [e for e in result["events"] if e["event"] == "snapshot" and e["step"] >= 3]
        assert later == []
        assert result["held"][2:] == [result["held"][2]] * 4  # nothing new from step 3 on
        assert off[0]["dir"] and "free" in off[0]["reason"]
    assert results[0]["held"][-1] == [1]  # step 2 found no room and was removed
    assert results[1]["held"][-1] == [1, 2]
    assert str(tmpfs_1m) in results[0]["events"][-1]["reason"]


@pytest.mark.slow
def test_a_tmpfs_out_of_inodes_turns_snapshots_off_and_training_goes_on(tmp_path):
    """Bytes free, inodes not (nr_inodes): the next snapshot's directory fails with ENOSPC
    on the training thread, which killed the rank; now it turns snapshots off like a full
    buffer does, and the reason says how many inodes were left."""
    with small_tmpfs(tmp_path / "tmpfs", "4m", ",nr_inodes=7") as tmpfs:
        roots = [str(tmpfs / "r0"), str(tmp_path / "r1")]  # step 1 takes the 7th inode
        results = run_ranks(out_of_space_job, 2, roots, 1000, 5)
    for result in results:
        off = [e for e in result["events"] if e["event"] == "snapshots_off"]
        assert len(off) == 1 and off[0]["step"] == 3 and result["stopped"], result["events"]
    assert results[0]["held"] == [[1]] * 5 and results[0]["partials"] == []
    assert "0 inodes" in results[0]["events"][-1]["reason"]


def test_the_plan_turns_snapshots_off_when_the_tmpfs_is_too_small():
    from tenax.orchestrator.placement.host_memory import plan_snapshot_memory
    from tenax.orchestrator.spec import load_spec
    from tenax.parallel import ParallelLayout

    spec = load_spec(overrides=["resources.nodes=1", "resources.gpus_per_node=2"])
    layout = ParallelLayout(dp=2, zero=1, micro_batch_size=2)
    roomy = plan_snapshot_memory(spec, layout, 64e9, ("/dev/shm", 1 << 40))
    assert roomy.enabled
    tight = plan_snapshot_memory(spec, layout, 64e9, lambda: ("/mnt/small", 1000))
    assert not tight.enabled and tight.every_steps == 0
    assert "/mnt/small" in tight.reason and "1000 B" in tight.reason
    assert tight.per_node_peak_bytes == roomy.per_node_peak_bytes
    assert plan_snapshot_memory(spec, layout, 64e9, None).enabled  # unknown: not checked


def test_the_room_counts_the_jobs_own_buffers_as_free(tmpfs_1m, monkeypatch):
    from tenax.checkpoint.memory.snapshot_store import SNAPSHOT_ENV, job_dir
    from tenax.orchestrator.placement.host_memory import snapshot_tmpfs_room

    monkeypatch.setenv(SNAPSHOT_ENV, str(tmpfs_1m))
    before = snapshot_tmpfs_room("job-a")
    os.makedirs(job_dir("job-a"))
    Path(job_dir("job-a"), "buffer").write_bytes(b"x" * 256 * 1024)
    after = snapshot_tmpfs_room("job-a")
    assert after is not None and before is not None
    assert abs(after[1] - before[1]) <= 8192  # its own bytes are rewritten in place
    other = snapshot_tmpfs_room("job-b")
    assert other is not None and other[1] <= before[1] - 256 * 1024


def test_a_hung_gcs_costs_one_thread_however_many_placements_ask(monkeypatch):
    """Each placement reads the nodes' memory with a deadline; while ray.nodes() hangs every
    later placement waits on that one call instead of leaving a blocked thread of its own."""
    from tenax.orchestrator.placement.host_memory import ray_node_memory_bytes

    hold, calls = threading.Event(), []

    def nodes() -> list:
        calls.append(threading.current_thread().name)
        hold.wait(60)
        return [{"NodeID": "a", "Alive": True, "Resources": {"memory": 8e9}}]

    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(nodes=nodes))
    try:
        for _ in range(5):
            assert ray_node_memory_bytes(timeout_s=0.01) is None  # late: unknown
        assert len(calls) == 1, calls
    finally:
        hold.set()
    assert ray_node_memory_bytes(timeout_s=30) == {"a": 8e9}  # answered: read again


@pytest.mark.slow
def test_a_job_on_a_tiny_tmpfs_finishes_with_the_clean_losses_and_one_snapshots_off(tmp_path):
    from tenax.testing.jobs import job_overrides, make_spec, reference_losses, run_cli

    with small_tmpfs(tmp_path / "tmpfs", "256k") as tmpfs:
        log = tmp_path / "events.jsonl"
        sets = job_overrides(tmp_path, "tiny-tmpfs", ["train.steps=8", "resources.nodes=1",
                                                      "resources.gpus_per_node=2"])
        args = ["run", "--log-json", str(log)]
        for item in sets:
            args += ["--set", item]
        done = run_cli(args, env={"TENAX_SNAPSHOT_DIR": str(tmpfs)}, timeout_s=400)
        assert done.returncode == 0, done.stderr[-3000:]
        events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    off = [e for e in events if e["event"] == "snapshots_off"]
    assert len(off) == 1 and str(tmpfs) in off[0]["reason"], off
    losses = {e["step"]: e["loss"] for e in events if e["event"] == "step"}
    want = reference_losses(make_spec(tmp_path, ["train.steps=8"]))
    assert sorted(losses) == sorted(want)
    assert all(abs(losses[s] - want[s]) <= 1e-5 * abs(want[s]) for s in want)


def test_only_rank_0s_snapshots_off_is_told_and_it_closes_the_snapshots():
    from tenax.orchestrator.job.facts import Recovery, Rescaling
    from tenax.orchestrator.job.progress import JobProgress

    records = [{"event": "snapshots_off", "rank": r, "step": 3, "reason": "no space in /x",
                "dir": "/x", "free_bytes": 0, "time": 1.0} for r in (1, 0)]
    notices = list(JobProgress("j").absorb(records, None, Rescaling(), Recovery()))
    assert [(n.event, n.closes) for n in notices] == [("snapshots_off", "snapshots")]
    assert notices[0].fields["reason"] == "no space in /x" and notices[0].fields["step"] == 3


def job_with_agents_on(tmpfs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                       steps: int) -> tuple[Any, Any]:
    """A 2-rank job on an embedded Ray whose agents keep their snapshots on `tmpfs` while the
    controller plans with /dev/shm; (the finished job, its spec)."""
    import ray

    from tenax.testing.clusters import start_local_ray
    from tenax.testing.jobs import make_spec, run_job

    monkeypatch.setenv("TENAX_SNAPSHOT_DIR", str(tmpfs))
    start_local_ray(gpus=2)  # its agents inherit the tmpfs
    monkeypatch.delenv("TENAX_SNAPSHOT_DIR")  # the controller plans with /dev/shm
    try:
        spec = make_spec(tmp_path, [f"train.steps={steps}", "resources.nodes=1",
                                    "resources.gpus_per_node=2"])
        return run_job(spec), spec
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_a_tmpfs_that_fills_while_the_job_runs_turns_snapshots_off_once(tmp_path, monkeypatch):
    """The controller's host has room (its plan keeps snapshots on); the agents' tmpfs has
    none: the ranks find out at their first buffer, turn snapshots off together, the
    controller says so once and keeps them off; the job's losses are the clean run's."""
    from tenax.testing.jobs import assert_same_losses, reference_losses

    with small_tmpfs(tmp_path / "tmpfs", "64k") as tmpfs:
        job, spec = job_with_agents_on(tmpfs, tmp_path, monkeypatch, 8)
    assert job.controller.state.value == "SUCCEEDED", job.controller.cause
    off = job.of("snapshots_off")
    assert len(off) == 1 and str(tmpfs) in off[0]["reason"] and off[0]["free_bytes"] >= 0, off
    assert job.controller.placer.snapshots.enabled  # the plan had room: the ranks found none
    assert_same_losses(job.losses(), reference_losses(spec))


def test_a_replica_that_does_not_fit_the_tmpfs_is_refused_before_its_bytes(tmpfs_1m, tmp_path,
                                                                           monkeypatch):
    """The receiver allocates the whole replica before it says GO: no room is a refusal
    (`no_space`), the sender's bytes never go out, and no file is left."""
    from tenax.checkpoint.memory.snapshot_store import (SNAPSHOT_ENV, SnapshotDir, SnapshotStamp,
                                                        crc32c_of)
    from tenax.workers.replica_stream import send_snapshot
    from tenax.workers.snapshot_keeper import ReplicaTerms, SnapshotKeeper

    monkeypatch.setenv(SNAPSHOT_ENV, str(tmpfs_1m))
    keeper = SnapshotKeeper()
    keeper.configure("full", 0, None, 1, ReplicaTerms("s" * 64, 2, (1,), ("127.0.0.1",)))
    data = {"shard": bytes(2 << 20)}
    stamp = SnapshotStamp(1, 1, 2, 5, {"shard": [2 << 20, crc32c_of([data["shard"]])]}, {})
    local = SnapshotDir(str(tmp_path / "sender"))
    local.write(stamp, data)
    _, paths = local.paths(1, 1, 5)
    try:
        with pytest.raises(Exception, match="no_space"):
            send_snapshot(keeper.endpoint("127.0.0.1"), stamp, paths, 10.0,
                          secret=b"s" * 64, job_id="full")
        assert keeper.failure_counts() == {"no_space": 1}
        leftovers = [name for _, _, names in os.walk(keeper.replica_dir) for name in names]
        assert leftovers == [] and keeper.inventory() == []
    finally:
        keeper.drop_job()


@pytest.mark.slow
def test_agents_that_cannot_make_the_jobs_directory_start_the_ranks_with_snapshots_off(
        tmp_path, monkeypatch):
    """The agents' tmpfs has no inode left when the ranks start (the job's directory cannot
    be made): the ranks start all the same, agree at their first snapshot that snapshots are
    off, the controller says so once naming the directory, and the losses are the clean run's."""
    from tenax.testing.jobs import assert_same_losses, reference_losses

    with small_tmpfs(tmp_path / "tmpfs", "4m", ",nr_inodes=16") as tmpfs:
        filled = 0
        with pytest.raises(OSError):  # every inode taken: not even the tree's root fits
            while True:
                (tmpfs / f"fill{filled}").mkdir()
                filled += 1
        job, spec = job_with_agents_on(tmpfs, tmp_path, monkeypatch, 6)
        assert sorted(p.name for p in tmpfs.iterdir()) == sorted(f"fill{i}"
                                                                  for i in range(filled))
    assert job.controller.state.value == "SUCCEEDED", job.controller.cause
    off = job.of("snapshots_off")
    assert len(off) == 1 and "cannot make the snapshot directory" in off[0]["reason"], off
    assert str(tmpfs) in off[0]["reason"] and "0 inodes" in off[0]["reason"], off
    assert off[0]["step"] == 1
    assert_same_losses(job.losses(), reference_losses(spec))
