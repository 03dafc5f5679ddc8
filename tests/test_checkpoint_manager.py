"""CheckpointManager: commits, crash safety, damage, retention, failures, storages, resume.

Fast cases run in this process with `DictState` (a tiny StateProvider, no process group);
cases that need a trainer, several ranks or a process to kill run in spawned processes. Kills
are deterministic: the writer pauses itself (TENAX_CKPT_FAULT=pause:DIR) and the test waits
for it to say so before sending SIGKILL. No test sleeps for a fixed time or asserts timings.
"""
from __future__ import annotations

import errno
import json
import os
import pickle
import signal
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from tenax.checkpoint.errors import CheckpointError, ModelMismatchError
from tenax.checkpoint.format.catalog import Catalog, version_name
from tenax.checkpoint.format.storage import Storage
from tenax.checkpoint.manager import CheckpointManager
from tenax.orchestrator.cli.main import main as tenax
from tests import test_storage
from tests.ckpt_jobs import (DictState, ckpt_config, ckpt_spec, killable_job, load_and_step_job,
                             rank_failure_job, roundtrip_job, save_modes_job, snapshot_job,
                             train_losses)
from tests.distributed import rank_context, run_ranks

DEADLINE_S = 120.0

# test_storage's moto S3 server fixture; pytest finds a fixture by the module's attribute name.
s3_options = test_storage.s3_options


def wait_for(condition: Callable[[], Any], what: str, timeout_s: float = DEADLINE_S) -> Any:
    """Poll `condition` until it returns something truthy; fail naming `what` on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}")


def manager(uri: str, state: DictState, **spec_extra: Any) -> CheckpointManager:
    extra = [f"checkpoint.{k}={v}" for k, v in spec_extra.items()]
    return CheckpointManager(ckpt_config(uri, extra), state, 0, 1, timeout_s=30, writer="sync")


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


# ---- commits ---------------------------------------------------------------------------------
def test_async_and_sync_saves_commit_with_a_manifest(tmp_path: Path) -> None:
    writers = ["thread", "sync", "fork"]
    events = run_ranks(save_modes_job, 2, str(tmp_path), writers)[0]
    for writer in writers:
        catalog = Catalog(Storage(f"file://{tmp_path}/{writer}"))
        assert catalog.committed_steps() == [1, 2], writer
        for step in (1, 2):
            m = catalog.manifest(step)
            assert (m.world_size, m.data_cursor, m.lr_step) == (2, 12 * step, step)
            assert m.layout["dp"] == 2 and m.layout["zero"] == 1
            assert m.extra["writer"] == writer and catalog.verify(step) == []
            assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(m.files)
        commits = [e for e in events[writer] if e["event"] == "checkpoint"]
        assert [e["step"] for e in commits] == [1, 2], events[writer]
        for e in commits:  # true timings: total_s runs until the manifest was written
            assert 0 <= e["blocked_s"] <= e["total_s"] and e["mode"] == writer


def test_a_save_is_a_snapshot_while_training_goes_on(tmp_path: Path) -> None:
    out = run_ranks(snapshot_job, 2, str(tmp_path), ["thread", "fork"])[0]
    for writer, res in out.items():
        assert res["step"] == 1 and res["event"]["event"] == "checkpoint", (writer, res)
        assert res["changed"] > 0, "the steps after save() must change the state"
        assert res["max_diff"] == 0.0, f"{writer}: loaded state differs from the state at save()"


# ---- crashes mid-save ------------------------------------------------------------------------
def _start_paused_save(tmp_path: Path, writer: str) -> tuple[Any, Any, int, str]:
    uri, pause = f"file://{tmp_path}/ckpt", tmp_path / "pause"
    pause.mkdir()
    ctx = rank_context()
    queue = ctx.Queue()
    proc = ctx.Process(target=killable_job, args=(uri, str(pause), writer, queue), daemon=True)
    proc.start()
    marker = pause / "writer-r0-s2.pid"
    wait_for(lambda: marker.exists() or proc.exitcode is not None, "the writer to pause")
    assert marker.exists(), f"job exited with {proc.exitcode} before pausing"
    return proc, queue, int(marker.read_text()), uri


def _assert_only_step_1_loads(uri: str) -> None:
    catalog = Catalog(Storage(uri))
    assert catalog.versions()[-1].step == 2 and not catalog.versions()[-1].committed
    assert catalog.latest_committed().step == 1
    out = run_ranks(load_and_step_job, 1, uri, {})[0]
    assert (out["step"], out["cursor"]) == (1, 12)
    assert abs(out["loss"] - run_ranks(train_losses, 1, 2, [])[0][1]) < 1e-6


def test_killed_writer_process_fails_the_save_and_training_goes_on(tmp_path: Path) -> None:
    proc, queue, pid, uri = _start_paused_save(tmp_path, "fork")
    assert pid != proc.pid  # the forked writer, not the rank
    first = queue.get(timeout=DEADLINE_S)["first"]
    assert first["event"] == "checkpoint" and first["step"] == 1
    os.kill(pid, signal.SIGKILL)
    report = queue.get(timeout=DEADLINE_S)
    proc.join(timeout=DEADLINE_S)
    assert report["second"]["event"] == "checkpoint_failed"
    assert "killed by signal 9" in report["second"]["cause"]
    assert report["step"] == 3  # it kept training
    _assert_only_step_1_loads(uri)


def test_rank_killed_mid_write_leaves_no_loadable_partial_version(tmp_path: Path) -> None:
    proc, queue, pid, uri = _start_paused_save(tmp_path, "thread")
    assert pid == proc.pid  # the thread writer runs inside the rank: kill the whole rank
    os.kill(pid, signal.SIGKILL)
    proc.join(timeout=DEADLINE_S)
    assert proc.exitcode == -signal.SIGKILL
    _assert_only_step_1_loads(uri)


# ---- damage ------------------------------------------------------------------------------------
def test_flipped_byte_is_caught_by_verify_and_skipped_on_load(tmp_path: Path, capsys) -> None:
    uri, state = f"file://{tmp_path}/ckpt", DictState()
    with manager(uri, state) as mgr:
        for _ in range(2):
            state.train()
            mgr.save(state.step)
    at_step_1 = {k: v - 1 for k, v in state.tensors.items()}
    assert tenax(["ckpt", "verify", uri]) == 0
    flip_byte(tmp_path / "ckpt" / version_name(2) / "__0_0.distcp")
    capsys.readouterr()
    assert tenax(["ckpt", "verify", uri]) == 1
    out = capsys.readouterr().out
    assert "step        2: DAMAGED" in out and "checksum mismatch" in out
    assert f"{version_name(2)}/__0_0.distcp" in out and "step        1: ok" in out
    fresh = DictState(seed=1)
    with manager(uri, fresh) as mgr:
        assert mgr.load() == 1
    for key, want in at_step_1.items():
        assert torch.allclose(fresh.tensors[key], want), key


def test_ckpt_list_and_inspect(tmp_path: Path, capsys) -> None:
    uri, state = f"file://{tmp_path}/ckpt", DictState()
    with manager(uri, state) as mgr:
        state.train()
        mgr.save(1)
    (tmp_path / "ckpt" / version_name(7)).mkdir()  # an uncommitted leftover
    capsys.readouterr()
    assert tenax(["ckpt", "list", uri, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["versions"]
    assert [(r["step"], r["committed"]) for r in rows] == [(1, True), (7, False)]
    assert rows[0]["layout"]["dp"] == 1 and rows[0]["bytes"] > 0
    assert tenax(["ckpt", "inspect", uri, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["step"] == 1 and doc["extra"]["format"] == "tenax-raw-2" and doc["files"]
    assert tenax(["ckpt", "inspect", uri]) == 0 and tenax(["ckpt", "list", uri]) == 0
    assert tenax(["ckpt", "inspect", uri, "--step", "5"]) == 2


# ---- retention -------------------------------------------------------------------------------
def test_retention_keeps_exactly_what_it_should_over_20_saves(tmp_path: Path) -> None:
    uri, state = f"file://{tmp_path}/ckpt", DictState()
    catalog = Catalog(Storage(uri))
    with manager(uri, state, keep_last=3, keep_every=7) as mgr:
        for step in range(1, 21):
            state.train()
            mgr.save(step)
            want = sorted(set(range(max(1, step - 2), step + 1)) | set(range(7, step + 1, 7)))
            assert [v.step for v in catalog.versions()] == want, f"after save {step}"
    # resume from 18 (19 and 20 damaged), then save 4 more: 18 is protected although
    # keep_last would drop it, and the damaged versions are replaced or pruned
    for step in (19, 20):
        flip_byte(tmp_path / "ckpt" / version_name(step) / "__0_0.distcp")
    state = DictState()
    with manager(uri, state, keep_last=3, keep_every=7) as mgr:
        assert mgr.load() == 18
        for step in range(19, 23):
            state.train()
            mgr.save(step)
    assert catalog.committed_steps() == [7, 14, 18, 20, 21, 22]
    assert all(catalog.verify(s) == [] for s in catalog.committed_steps())


# ---- failures ----------------------------------------------------------------------------------
class BrokenMemoryFS(MemoryFileSystem):
    """memory:// whose file writes fail with EIO while `broken` is set."""

    protocol = "brokenmem"
    broken = False

    def pipe_file(self, path: str, value: bytes, *args: Any, **kwargs: Any) -> None:
        if type(self).broken:
            raise OSError(errno.EIO, "injected I/O error")
        super().pipe_file(path, value, *args, **kwargs)


@pytest.mark.parametrize("how", ["disk-full", "storage-error"])
def test_failed_save_is_reported_and_training_goes_on(tmp_path: Path, monkeypatch,
                                                      how: str) -> None:
    if how == "disk-full":
        uri = f"file://{tmp_path}/ckpt"
        break_it = lambda on: monkeypatch.setenv("TENAX_CKPT_FAULT", "fail" if on else "")  # noqa
    else:
        fsspec.register_implementation("brokenmem", BrokenMemoryFS, clobber=True)
        uri = f"brokenmem://tenax-tests/{uuid.uuid4().hex}"
        break_it = lambda on: setattr(BrokenMemoryFS, "broken", on)  # noqa: E731
    state = DictState()
    mgr = CheckpointManager(ckpt_config(uri), state, 0, 1, timeout_s=30, writer="thread")
    try:
        for step in (1, 2, 3):
            state.train()
            break_it(step == 2)
            mgr.save(step)
            event = mgr.wait()
            if step == 2:
                assert event["event"] == "checkpoint_failed" and event["step"] == 2
                assert ("No space left" in event["cause"]) == (how == "disk-full")
                assert Catalog(Storage(uri)).latest_committed().step == 1
            else:
                assert event["event"] == "checkpoint"
    finally:
        break_it(False)
        mgr.close()
    assert Catalog(Storage(uri)).committed_steps() == [1, 3]
    fresh = DictState(seed=5)
    with manager(uri, fresh) as loader:
        assert loader.load() == 3


def test_one_rank_failing_fails_the_save_on_rank_0_and_training_goes_on(tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/ckpt"
    out = run_ranks(rank_failure_job, 2, uri)
    assert [o["step"] for o in out] == [3, 3]
    kinds = [(e["event"], e["step"]) for e in out[0]["events"]]
    assert kinds == [("checkpoint", 1), ("checkpoint_failed", 2), ("checkpoint", 3)]
    cause = out[0]["events"][1]["cause"]
    assert "rank 1 failed" in cause and "No space left" in cause
    assert Catalog(Storage(uri)).committed_steps() == [1, 3]


def test_model_hash_mismatch_is_refused_clearly(tmp_path: Path) -> None:
    uri, state = f"file://{tmp_path}/ckpt", DictState()
    with manager(uri, state) as mgr:
        state.train()
        mgr.save(1)
    other = CheckpointManager(ckpt_config(uri, ["model.dim=128"]), DictState(), 0, 1,
                              timeout_s=30)
    with pytest.raises(ModelMismatchError) as err:
        other.load()
    message = str(err.value)
    assert "another model" in message and "model_hash" in message and version_name(1) in message
    assert str(pickle.loads(pickle.dumps(err.value))) == message  # crosses Ray boundaries


def test_misuse_is_refused(tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/ckpt"
    with pytest.raises(CheckpointError, match="process group"):
        CheckpointManager(ckpt_config(uri), DictState(), 0, 2).save(0)
    with pytest.raises(CheckpointError, match="memory://"):
        CheckpointManager(ckpt_config(f"memory://x/{uuid.uuid4().hex}"), DictState(), 0, 2)
    mgr = manager(uri, DictState())
    with pytest.raises(CheckpointError, match="must match"):
        mgr.save(5)
    mgr.close()
    with pytest.raises(CheckpointError, match="closed"):
        mgr.save(0)


# ---- storages --------------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", ["file", "memory", "s3"])
def test_storages_work_alike(protocol: str, tmp_path: Path, request) -> None:
    options = None
    if protocol == "file":
        uri = f"file://{tmp_path}/ckpt"
    elif protocol == "memory":  # per-process: save and load happen inside the one rank
        uri = f"memory://tenax-tests/{uuid.uuid4().hex}"
    else:
        options = request.getfixturevalue("s3_options")
        uri = f"s3://tenax-test/{uuid.uuid4().hex}"
    out = run_ranks(roundtrip_job, 1, uri, options, "thread")[0]
    assert out["event"]["event"] == "checkpoint" and out["step"] == 2 and out["keys_equal"]
    assert max(out["diffs"].values()) == 0.0
    assert out["losses"][0] == out["losses"][1]


# ---- resume through the launcher -------------------------------------------------------------
def test_resumed_launcher_run_equals_uninterrupted(tmp_path: Path) -> None:
    from tenax.workers.launch import launch
    from tenax.workers.spec import layout_from_spec

    spec = ckpt_spec(f"file://{tmp_path}/ckpt", ["train.steps=6", "checkpoint.every_steps=2"])

    def run(nproc: int) -> list[dict]:
        events: list[dict] = []
        layout = layout_from_spec(spec, nproc)
        assert launch(spec.to_dict(), layout.to_dict(), nproc, events.append, DEADLINE_S,
                      rank_context())
        return events

    first = run(2)
    losses = {e["step"]: e["loss"] for e in first if e["event"] == "step"}
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert [e["step"] for e in first if e["event"] == "checkpoint"] == [2, 4, 6]
    # A fresh start initialises its weights after finding nothing to load (a resuming rank
    # skips that): the same run as a trainer built initialised, in one process.
    reference = run_ranks(train_losses, 1, 6, ["train.steps=6"])[0]
    for step, loss in losses.items():
        assert abs(loss - reference[step - 1]) / abs(loss) < 1e-5, (step, loss, reference)
    Catalog(Storage(spec.checkpoint.uri)).delete(6)  # as if the job died after step 5
    second = run(1)  # and came back with fewer ranks
    started = next(e for e in second if e["event"] == "started")
    assert started["step"] == 4 and started["resumed_from"] == 4
    resumed = {e["step"]: e["loss"] for e in second if e["event"] == "step"}
    assert sorted(resumed) == [5, 6]
    for step, loss in resumed.items():
        assert abs(loss - losses[step]) / abs(losses[step]) < 1e-5, (step, loss, losses[step])
    assert [e["step"] for e in second if e["event"] == "checkpoint"] == [6]
