"""Retention never deletes the newest good work; a read error is not damage.

Reads fail through `FlakyFileSystem`, a real local filesystem registered as `flakyfile://` that
raises EIO on reads of chosen files a chosen number of times: what a flaky NFS mount or an
object store's 503 looks like to fsspec.
"""
from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import fsspec
import pytest
from fsspec.implementations.local import LocalFileSystem

from tenax.checkpoint.errors import CatalogUnreachableError, CheckpointError
from tenax.checkpoint.format.catalog import Catalog, retention_plan
from tenax.checkpoint.format.storage import Storage
from tenax.checkpoint.manager import CheckpointManager
from tests.ckpt_jobs import DictState, ckpt_config


class FlakyFileSystem(LocalFileSystem):
    """Local files; opening a path containing a key of `failures` for reading fails that many
    more times (-1: always)."""

    protocol = "flakyfile"
    failures: dict[str, int] = {}

    def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        for key, left in FlakyFileSystem.failures.items():
            if "r" in mode and key in str(path) and left != 0:
                FlakyFileSystem.failures[key] = left - 1 if left > 0 else -1
                raise OSError(errno.EIO, f"Input/output error (flaky test storage): {path}")
        return super()._open(path, mode, *args, **kwargs)


fsspec.register_implementation("flakyfile", FlakyFileSystem, clobber=True)


@pytest.fixture(autouse=True)
def no_leftover_failures() -> Any:
    FlakyFileSystem.failures = {}
    yield
    FlakyFileSystem.failures = {}


def manager(uri: str, state: DictState, keep_last: int = 1) -> CheckpointManager:
    config = ckpt_config(uri, [f"checkpoint.keep_last={keep_last}"])
    return CheckpointManager(config, state, 0, 1, timeout_s=30, writer="sync")


def save_steps(uri: str, steps: list[int], keep_last: int = 3) -> DictState:
    state = DictState()
    with manager(uri, state, keep_last) as mgr:
        for step in steps:
            while state.step < step:
                state.train()
            mgr.save(step)
    return state


def rot(root: Path, step: int) -> None:
    shard = root / f"step-{step:08d}" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))


def test_retention_keeps_new_commits_after_the_newest_version_rots(tmp_path: Path) -> None:
    root, uri = tmp_path / "ckpt", f"file://{tmp_path}/ckpt"
    save_steps(uri, [10, 20, 30])
    rot(root, 30)
    state = DictState(seed=4)
    with manager(uri, state, keep_last=1) as mgr:
        assert mgr.load() == 20  # 30 is damaged
        for step in (21, 22):
            state.train()
            mgr.save(step)
    catalog = Catalog(Storage(uri))
    # 22 is the head (kept), 21 is older than keep_last=1 within the lineage, 20 was resumed
    # from, 30 is above the head: never retention's to delete
    assert catalog.committed_steps() == [20, 22, 30]
    with manager(uri, DictState(seed=5)) as mgr:
        assert mgr.load() == 22  # the restart resumes the new work, not step 20 or 0


def test_retention_plan_never_deletes_the_head_or_versions_above_it() -> None:
    plan = retention_plan({5, 30, 21}, set(), keep_last=1, keep_every=0, head=21)
    assert plan == {5: "committed, older than the last 1"}
    assert retention_plan({30, 21}, {22}, 1, 0, head=22) == {}  # head being committed: spared


def test_a_job_whose_checkpoints_are_all_damaged_does_not_start_over(tmp_path: Path) -> None:
    root, uri = tmp_path / "ckpt", f"file://{tmp_path}/ckpt"
    save_steps(uri, [10], keep_last=1)
    rot(root, 10)
    with manager(uri, DictState(seed=4)) as mgr, pytest.raises(CheckpointError) as err:
        mgr.load()
    assert "no usable checkpoint" in str(err.value) and "[10]" in str(err.value)
    assert Catalog(Storage(uri)).committed_steps() == [10]  # nothing deleted


def test_a_transient_read_error_is_retried_not_taken_for_damage(tmp_path: Path) -> None:
    uri = f"flakyfile://{tmp_path}/ckpt"
    save_steps(uri, [10, 20])
    FlakyFileSystem.failures = {"step-00000020/__0_0.distcp": 2}
    catalog = Catalog(Storage(uri), backoff_s=0.01)
    assert catalog.latest_committed().step == 20
    assert FlakyFileSystem.failures["step-00000020/__0_0.distcp"] == 0  # it did fail twice


def test_unreachable_storage_fails_the_load_and_deletes_nothing(tmp_path: Path) -> None:
    uri = f"flakyfile://{tmp_path}/ckpt"
    save_steps(uri, [10, 20])
    FlakyFileSystem.failures = {"step-00000020/__0_0.distcp": -1}
    catalog = Catalog(Storage(uri), backoff_s=0.01)
    health = catalog.check(20)
    assert health.unreachable and not health.damaged
    with pytest.raises(CatalogUnreachableError, match="not falling back"):
        catalog.latest_committed()
    with manager(uri, DictState(seed=4)) as mgr, pytest.raises(CheckpointError,
                                                               match="unreadable"):
        mgr.load()
    FlakyFileSystem.failures = {}
    assert catalog.committed_steps() == [10, 20] and catalog.verify(20) == []
