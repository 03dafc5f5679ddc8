"""In-memory snapshots: torn ones are never used, and a snapshot reshards exactly like storage."""
from __future__ import annotations

import os
import signal

import pytest
import torch

from tenax.checkpoint.errors import SnapshotError
from tenax.checkpoint.format.catalog import Catalog, version_name
from tenax.checkpoint.format.storage import Storage
from tenax.checkpoint.memory.restore import assemble_version
from tenax.checkpoint.memory.snapshot_store import SnapshotDir, SnapshotStamp, crc32c_of
from tenax.orchestrator.placement.recovery_policy import SnapshotPiece, choose_recovery_source
from tests.distributed import rank_context, run_ranks
from tests.snapshot_jobs import (handed_plan_job, load_both_job, not_ready_job, reused_plan_job,
                                 snapshot_and_save_job)

pytestmark = pytest.mark.timeout(300)

COMMIT = {"layout": {"dp": 1}, "model_hash": "h", "data_cursor": 4, "seed": 0, "lr_step": 1,
          "extra": {"format": "tenax-raw-2"}}


def _stamp(step: int, files: dict[str, bytes], generation: int = 1) -> SnapshotStamp:
    from tenax.checkpoint.memory.snapshot_store import crc32c_of

    sums = {n: [len(d), crc32c_of([d])] for n, d in files.items()}
    return SnapshotStamp(generation, 0, 1, step, sums, COMMIT)


def _killed_mid_copy(root: str) -> None:
    """Begin step 2, write half its bytes, die by SIGKILL (no cleanup of any kind)."""
    store = SnapshotDir(root)
    partial = store.begin(1, 0, 2)
    with open(os.path.join(partial, "shard"), "wb") as f:
        f.write(b"x" * 1000)
        f.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_snapshot_torn_by_a_killed_process_is_never_used(tmp_path):
    store = SnapshotDir(str(tmp_path))
    store.write(_stamp(1, {"shard": b"a" * 2000}), {"shard": b"a" * 2000})
    proc = rank_context().Process(target=_killed_mid_copy, args=(str(tmp_path),))
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    assert [s.step for s in store.complete()] == [1]  # the torn step 2 is invisible
    stamp, files = store.read(1, 0, 1)
    assert files["shard"] == b"a" * 2000 and stamp.step == 1
    with pytest.raises(SnapshotError):
        store.read(1, 0, 2)
    # a damaged byte is caught by the checksum, a truncated file by its size
    path = os.path.join(store.series(1, 0), "s1", "shard")
    with open(path, "r+b") as f:
        f.write(b"b")
    with pytest.raises(SnapshotError, match="torn or damaged"):
        store.read(1, 0, 1)


def test_double_buffer_keeps_the_newest_two_by_write_order(tmp_path):
    store = SnapshotDir(str(tmp_path), keep=2)
    for step in (5, 6, 7, 3):  # 3 written last (a job that fell back to an older step)
        store.write(_stamp(step, {"shard": b"z"}), {"shard": b"z"})
    assert [s.step for s in store.complete()] == [3, 7]
    store.write(_stamp(1, {"shard": b"z"}, generation=4), {"shard": b"z"})
    assert {(s.generation, s.step) for s in store.complete()} == {(4, 1)}  # gens < 3 dropped


def _inode(store: SnapshotDir, step: int, name: str = "shard") -> int:
    return os.stat(os.path.join(store.series(1, 0), f"s{step}", name)).st_ino


def test_a_new_snapshot_rewrites_an_old_buffer_and_the_newest_stays_complete(tmp_path):
    local = SnapshotDir(str(tmp_path / "local"), keep=2)
    for step in (1, 2):
        local.write(_stamp(step, {"shard": bytes([step]) * 4096}), {"shard": bytes([step]) * 4096})
    oldest = _inode(local, 1)
    partial = local.begin(1, 0, 3)  # rewrites step 1's buffer: invisible at once
    assert [s.step for s in local.complete()] == [2]
    assert os.stat(os.path.join(partial, "shard")).st_ino == oldest
    local.write(_stamp(3, {"shard": b"c" * 100}), {"shard": b"c" * 100})  # shrinks: cut
    assert [s.step for s in local.complete()] == [3, 2] and _inode(local, 3) == oldest
    assert local.read(1, 0, 3)[1]["shard"] == b"c" * 100

    replica = SnapshotDir(str(tmp_path / "replica"), keep=1)  # rewrites its only buffer
    data = {"shard": b"r" * 4096, "extra": b"e"}
    replica.write(_stamp(1, data), data)
    first = _inode(replica, 1)
    replica.write(_stamp(3, {"shard": b"t" * 4096}), {"shard": b"t" * 4096})
    assert [s.step for s in replica.complete()] == [3] and _inode(replica, 3) == first
    assert sorted(os.listdir(os.path.join(replica.series(1, 0), "s3"))) == ["shard", "stamp.json"]
    stamp, views = replica.mapped(1, 0, 3)  # what a restore's piece is sent from: mapped
    assert stamp.step == 3 and bytes(views["shard"]) == b"t" * 4096


def piece(holder, kind, rank, step, world=2, gen=1):
    return SnapshotPiece(holder, kind, gen, rank, world, step)


@pytest.mark.parametrize("pieces, storage, want", [
    ([], 10, ("storage", 10)),
    ([piece(0, "local", 0, 12), piece(1, "local", 1, 12)], 10, ("memory", 12)),
    ([piece(0, "local", 0, 12), piece(0, "local", 0, 11), piece(1, "replica", 1, 11)], 10,
     ("replica", 11)),  # rank 1's step 12 is nowhere: 11 is the newest complete step
    ([piece(0, "local", 0, 12), piece(1, "local", 1, 12)], 12, ("memory", 12)),  # tie: memory
    ([piece(0, "local", 0, 9), piece(1, "local", 1, 9)], 10, ("storage", 10)),
    ([piece(0, "local", 0, 12), piece(1, "local", 1, 12, gen=2)], None, ("storage", None)),
])
def test_recovery_source_picks_the_newest_complete_step(pieces, storage, want):
    decision = choose_recovery_source(pieces, storage)
    assert (decision.source, decision.step) == want, decision.reason


def test_recovery_source_prefers_a_local_piece_to_a_replica():
    d = choose_recovery_source([piece(1, "replica", 0, 5), piece(0, "local", 0, 5),
                                piece(1, "local", 1, 5)], None)
    assert d.source == "memory" and d.holders == ((0, 0, "local"), (1, 1, "local"))


def test_memory_backed_resharding_equals_storage_tensor_for_tensor(tmp_path):
    root = str(tmp_path)
    saved = run_ranks(snapshot_and_save_job, 2, root)
    assert [d["step"] for d in saved[0]["done"]] == [1]
    assert [r["planned"] for r in saved] == [1, 1]  # the snapshot took the save's plan
    pieces = [SnapshotDir(f"{root}/snap-{r}").read(7, r, 1) for r in range(2)]
    # Rank 1's piece is linked where it lies (what an agent on its node does), rank 0's written
    held = f"{root}/snap-1/g7-r1/s1"
    pieces[1] = (pieces[1][0], held)
    memory_uri = assemble_version(f"{root}/restore", pieces)
    shard = next(n for n in pieces[1][0].files if n != ".metadata")
    restored = os.stat(f"{root}/restore/{version_name(1)}/{shard}")
    assert restored.st_ino == os.stat(f"{held}/{shard}").st_ino
    # the stamps' checksums it committed without re-reading are the files' own
    assert Catalog(Storage(memory_uri, timeout_s=10)).verify(1) == []
    loaded = run_ranks(load_both_job, 2, f"file://{root}/storage", memory_uri)[0]
    storage, memory = loaded["storage"], loaded["memory"]
    assert storage["step"] == memory["step"] == 1 and storage["cursor"] == memory["cursor"]
    assert memory["source"] == ["memory"] and storage["source"] == ["storage"]
    at_save = saved[0]["at_save"]
    assert set(memory["state"]) == set(storage["state"]) == set(at_save)
    for key, tensor in storage["state"].items():
        assert torch.equal(memory["state"][key], tensor), key
        assert torch.equal(tensor, at_save[key]), key  # the later steps did not leak in


def test_snapshots_wait_for_the_replica_so_every_node_keeps_its_step(tmp_path):
    """With a peer, a new snapshot is taken only once the agent sent the last one: the step a
    replica holds is then still in every rank's double buffer (complete across nodes)."""
    from tenax.checkpoint.memory.snapshot import MemorySnapshotter
    from tests.ckpt_jobs import DictState, ckpt_config

    state, store = DictState(), SnapshotDir(str(tmp_path))
    snaps = MemorySnapshotter(ckpt_config(f"file://{tmp_path}/ckpt"), state, 0, 1, str(tmp_path),
                              3, lambda ok: ok, replicated=True)
    taken = []
    for step in range(1, 7):
        state.train()
        snaps.snapshot(step)
        snaps.wait()
        taken.append(store.complete()[0].step)  # newest written first; one series here
        if step in (2, 4):  # the agent's replica of the newest step arrived at the peer
            store.mark_sent(3, 0, taken[-1])
    assert taken == [1, 1, 3, 3, 5, 5] and snaps.skipped == 3
    assert {s.step for s in store.complete()} == {3, 5}  # the sent step 3 is still held
    stamp, files = store.read(3, 0, 5)
    assert stamp.commit["lr_step"] == 5 and stamp.nbytes == sum(len(d) for d in files.values())


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux only")
def test_a_rank_maps_its_two_buffers_once_and_unmaps_them_at_close(tmp_path):
    """The copying thread writes through mappings it keeps (checkpoint/memory/buffer_maps.py): the
    same two buffers step after step, nothing of a rewritten or closed one left mapped."""
    from tenax.checkpoint.memory.snapshot import MemorySnapshotter
    from tests.ckpt_jobs import DictState, ckpt_config

    def mapped() -> list[str]:
        with open("/proc/self/maps") as f:
            return [line.split()[-1] for line in f if str(tmp_path) in line]

    state, store = DictState(numel=200_003), SnapshotDir(str(tmp_path))  # > 3 copy chunks
    snaps = MemorySnapshotter(ckpt_config(f"file://{tmp_path}/ckpt"), state, 0, 1, str(tmp_path),
                              3, lambda ok: ok)
    for step in range(1, 6):
        state.train()
        snaps.snapshot(step)
        snaps.wait()
        stamp, files = store.read(3, 0, step)  # sizes and the chunked checksum verified
        assert stamp.commit["lr_step"] == step
        shard = next(data for name, data in files.items() if name != ".metadata")
        assert state.tensors["model.w"].numpy().tobytes() in shard
        assert len(mapped()) == min(step, 2), mapped()  # no third mapping: buffers reused
    snaps.close()
    assert mapped() == []


@pytest.mark.parametrize("layout", [{"dp": 2, "zero": 1}, {"dp": 2, "zero": 0}, {"tp": 2},
                                    {"dp": 2, "zero": 3}], ids=["zero1", "zero0", "tp2", "zero3"])
def test_a_reused_save_plan_writes_what_a_fresh_plan_writes(tmp_path, layout):
    out = run_ranks(reused_plan_job, 2, str(tmp_path), {**layout, "micro_batch_size": 1})
    for rank in out:
        assert rank["mismatches"] == [], rank
        # steps 2, 3 and 5 reused the plan and its views as they were (and 4 where the load
        # wrote into the live moments in place, as zero 0 does: the identity held)
        assert rank["fast"] >= 3


def test_a_save_any_rank_is_not_ready_for_is_planned_by_none_in_the_plans_own_all_reduce(
        tmp_path):
    out = run_ranks(not_ready_job, 2, str(tmp_path))
    for rank in out:
        assert rank["refused"] == [True, True, True] and rank["planned"] == 1, rank
        assert not rank["first_reused"] and rank["reused"], rank
    assert sorted(s for rank in out for s in rank["steps"]) == [2.0]  # the step, agreed


@pytest.mark.parametrize("layout", [{"dp": 2, "zero": 1}, {"tp": 2}], ids=["zero1", "tp2"])
def test_a_plan_handed_to_a_restarted_process_is_reused_only_from_one_round(tmp_path, layout):
    out = run_ranks(handed_plan_job, 2, str(tmp_path), {**layout, "micro_batch_size": 1})
    for rank in out:
        assert all(rank["roundtrip"]) and rank["blobs"] == 1, rank
        assert rank["handed_reused"] and rank["handed_equal"], rank
        assert not rank["mixed_reused"] and rank["mixed_equal"], rank


def test_a_handed_plan_of_another_rank_or_size_is_refused():
    from tenax.checkpoint.errors import PlanFormatError
    from tenax.checkpoint.save.plan_codec import decode_plan, encode_plan
    from tenax.checkpoint.save.planning import PlanCache

    blob = encode_plan(PlanCache([], [], [], "__1_0.distcp", 0, None, token=7), 1, 2)
    assert decode_plan(blob, 1, 2).file == "__1_0.distcp"
    for rank, world in ((0, 2), (1, 4)):
        with pytest.raises(PlanFormatError, match="rank 1 of 2"):
            decode_plan(blob, rank, world)
    for junk in ("[]", "{}", blob.replace("tenax-save-plan-1", "x"), 7):
        with pytest.raises(PlanFormatError):
            decode_plan(junk, 1, 2)


def test_a_replica_keeps_its_previous_step_so_a_node_lost_mid_send_leaves_a_complete_one(
        tmp_path, monkeypatch):
    """Ranks 2 and 3 live on the lost node; rank 2's replica of step 12 arrived, rank 3's did not.
    Step 11 must still be whole: every rank's piece of it is somewhere (replicas keep two)."""
    from tenax.checkpoint.memory.snapshot_store import SNAPSHOT_ENV
    from tenax.workers.snapshot_keeper import ReplicaTerms, SnapshotKeeper

    monkeypatch.setenv(SNAPSHOT_ENV, str(tmp_path))
    survivor = SnapshotKeeper()  # the agent holding ranks 2 and 3's replicas (one per slot here)
    survivor.configure("mid-send", 0, None, 1, ReplicaTerms("s" * 64, 4, (2, 3)))
    data = {"s.distcp": b"y" * 64}

    def fill(name: str, view: memoryview) -> int:
        view[:] = data[name]
        return crc32c_of([view])

    for rank, steps in ((2, (11, 12)), (3, (11,))):
        for step in steps:
            stamp = SnapshotStamp(1, rank, 4, step, _stamp(step, data).files, COMMIT)
            survivor.land_replica(stamp, fill)
    held = [SnapshotPiece(5, h["kind"], h["generation"], h["rank"], h["world"], h["step"])
            for h in survivor.inventory()]
    local = [SnapshotPiece(r, "local", 1, r, 4, s) for r in (0, 1) for s in (11, 12)]
    decision = choose_recovery_source(local + held, 10)
    assert (decision.source, decision.step) == ("replica", 11), decision.reason
    survivor.drop_job()
