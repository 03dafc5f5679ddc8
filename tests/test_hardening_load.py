"""Verifying a checkpoint before a resume is shared by the ranks.

Each rank re-reads about 1/world of a version's bytes (`share_of`), and the ranks agree on the
worst verdict, so damage found in any rank's share makes every rank fall back together.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tenax.checkpoint.format.catalog import Catalog, FileEntry, share_of
from tenax.checkpoint.format.storage import Storage
from tests.ckpt_jobs import DictState, ckpt_config
from tests.distributed import run_ranks


def test_shares_cover_every_file_once_and_balance_bytes() -> None:
    files = {f"f{i}": FileEntry(size, "crc32:0") for i, size in
             enumerate([900, 500, 400, 300, 100, 100, 50, 7, 0])}
    shares = [share_of(files, r, 3) for r in range(3)]
    assert sorted(f for s in shares for f in s) == sorted(files)
    loads = [sum(files[f].size for f in s) for s in shares]
    assert max(loads) - min(loads) <= 900 and max(loads) <= sum(loads) // 3 + 900


def save_and_load_job(rank: int, world: int, uri: str, phase: str) -> Any:
    from tenax.checkpoint.manager import CheckpointManager

    state = DictState()
    with CheckpointManager(ckpt_config(uri), state, rank, world, timeout_s=60,
                           writer="sync") as mgr:
        if phase == "save":
            for step in (1, 2):
                state.train()
                mgr.save(step)
            return None
        return mgr.load()


def test_damage_in_one_ranks_share_makes_every_rank_fall_back(tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/ckpt"
    run_ranks(save_and_load_job, 2, uri, "save")
    catalog = Catalog(Storage(uri))
    manifest = catalog.manifest(2)
    victim = sorted(share_of(manifest.files, 1, 2))[0]  # a file only rank 1 re-reads
    path = tmp_path / "ckpt" / "step-00000002" / victim
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    assert catalog.check(2, share=(0, 2)).problems == []  # rank 0's share is intact
    assert catalog.check(2, share=(1, 2)).damaged
    assert run_ranks(save_and_load_job, 2, uri, "load") == [1, 1]


def load_failing_on_rank_job(rank: int, world: int, uri: str, failing: int) -> str:
    """Load with rank `failing`'s reads raising after the version was verified (storage lost
    mid-restore); returns what the load said on this rank."""
    from tenax.checkpoint.errors import CheckpointError, StorageError
    from tenax.checkpoint.load.raw_reader import RawReader
    from tenax.checkpoint.manager import CheckpointManager

    def unreadable(*_: Any) -> None:
        raise StorageError("injected: storage went away mid-read")

    if rank == failing:
        RawReader.read_data = unreadable  # this process only (a forked rank)
    with CheckpointManager(ckpt_config(uri), DictState(), rank, world, timeout_s=60) as mgr:
        try:
            return f"loaded step {mgr.load()}"
        except CheckpointError as exc:
            return str(exc)


def test_a_load_failing_on_one_rank_fails_on_every_rank(tmp_path: Path) -> None:
    """Ranks plan and read their parts on their own: without the agreement after the reads,
    rank 0 would report a good load and go on to train while rank 1 has no state."""
    uri = f"file://{tmp_path}/ckpt"
    run_ranks(save_and_load_job, 2, uri, "save")
    said = run_ranks(load_failing_on_rank_job, 2, uri, 1)
    assert "failed on another rank" in said[0], said
    assert "injected: storage went away mid-read" in said[1], said
