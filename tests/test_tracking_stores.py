"""Tracking on the stores users point it at: TensorBoard on an object store (an s3:// bucket,
here a moto server on 127.0.0.1) shows its records while the job runs and keeps them when rank
0 is killed without closing; a W&B run's file is flushed often enough that a killed attempt
keeps its steps; an unwritable `tensorboard_dir` is reported naming the key and the path."""
from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from tenax.workers.tracking import TensorBoardWriter, Tracker
from tests.tracking_readers import tensorboard_scalars, tensorboard_texts

SPEC = {"name": "stores", "train": {"steps": 4}}


@pytest.fixture(scope="module")
def bucket() -> Iterator[str]:
    """s3://<bucket> on a moto server; s3fs finds it through AWS_ENDPOINT_URL, as a user's
    job finds a non-AWS S3 endpoint."""
    server_mod = pytest.importorskip("moto.server", reason="moto[server] is not installed")
    pytest.importorskip("s3fs", reason="s3fs is not installed")
    import fsspec

    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    name = f"tenax-tracking-{uuid.uuid4().hex[:8]}"
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
                           "AWS_ENDPOINT_URL": f"http://{host}:{port}"}.items():
            mp.setenv(key, value)
        fsspec.get_filesystem_class("s3").clear_instance_cache()
        fsspec.filesystem("s3").mkdir(name)
        yield f"s3://{name}"
        fsspec.get_filesystem_class("s3").clear_instance_cache()
    server.stop()


def download(uri: str, to: Path) -> list[str]:
    """The event files under `uri` as they are in the store now, copied into `to`."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(uri)
    fs.invalidate_cache()
    names = sorted(n for n in fs.find(root) if "tfevents" in n.rsplit("/", 1)[-1])
    to.mkdir(parents=True, exist_ok=True)
    for name in names:
        (to / name.rsplit("/", 1)[1]).write_bytes(fs.cat_file(name))
    return names


def test_s3_records_are_readable_before_the_writer_closes(bucket, tmp_path):
    uri = f"{bucket}/runs/{uuid.uuid4().hex}"
    writer = TensorBoardWriter(uri, object_flush_s=0.0)
    writer.open(0, SPEC)
    for step in (1, 2, 3):
        writer.scalars(step, {"train/loss": 1.0 / step}, 1000.0 + step)
    writer.flush()
    # No close: this is what a rank 0 killed by a failure leaves behind.
    assert len(download(uri, tmp_path / "tb")) == 1
    assert tensorboard_scalars(tmp_path / "tb")["train/loss"] == \
        [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    writer.close()


def test_s3_segments_roll_and_a_redone_step_reads_back_once(bucket, tmp_path):
    uri = f"{bucket}/runs/{uuid.uuid4().hex}"
    first = TensorBoardWriter(uri, object_flush_s=0.0, segment_bytes=200)
    first.open(0, SPEC)
    for step in (1, 2, 3):
        first.scalars(step, {"train/loss": float(step), "train/lr": 0.1}, 1000.0 + step)
        first.flush()
    # killed at step 3, never closed; the next attempt resumes at step 2 and redoes step 3
    second = TensorBoardWriter(uri, object_flush_s=0.0, segment_bytes=200)
    second.open(2, SPEC)
    for step in (3, 4):
        second.scalars(step, {"train/loss": 10.0 * step, "train/lr": 0.2}, 2000.0 + step)
    second.close()
    assert len(download(uri, tmp_path / "tb")) > 2  # the segments rolled
    scalars = tensorboard_scalars(tmp_path / "tb")
    assert scalars["train/loss"] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    assert [s for s, _ in scalars["train/lr"]] == [1, 2, 3, 4]
    texts = tensorboard_texts(tmp_path / "tb")
    assert [s for s, _ in texts["attempts"]] == [1, 3] and len(texts["spec"]) == 1


def test_the_tracker_flushes_an_idle_object_store_writer(bucket, tmp_path):
    """A hung job sends no more records: its last steps must still reach the store."""
    uri = f"{bucket}/runs/{uuid.uuid4().hex}"
    tracker = Tracker([TensorBoardWriter(uri, object_flush_s=0.05)], 0, SPEC)
    for step in (1, 2, 3):
        tracker.submit({"event": "step", "step": step, "loss": float(step)})
    seen: dict = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # waits on the condition; fails only if it never holds
        download(uri, tmp_path / "tb")
        seen = tensorboard_scalars(tmp_path / "tb")
        if len(seen.get("train/loss", [])) == 3:
            break
        time.sleep(0.05)
    assert seen["train/loss"] == [(1, 1.0), (2, 2.0), (3, 3.0)]
    tracker.close()


def test_an_unwritable_tensorboard_dir_names_the_key_and_the_path(tmp_path):
    from tenax.workers.tracking.errors import TensorBoardDirError

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    writer = TensorBoardWriter(str(blocker / "tb"))
    with pytest.raises(TensorBoardDirError) as info:
        writer.open(0, SPEC)
    assert "logging.tensorboard_dir" in str(info.value) and str(blocker / "tb") in str(info.value)


def test_a_wandb_run_flushes_its_file_every_second(tmp_path, monkeypatch):
    """wandb's default (15 s) left a killed attempt's offline run directory empty."""
    pytest.importorskip("wandb")
    from tenax.workers.tracking.wandb_writer import TRANSACTION_LOG_FLUSH_S, WandbWriter

    for key, value in {"WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
                       "WANDB_DISABLE_GIT": "true", "WANDB_API_KEY": ""}.items():
        monkeypatch.setenv(key, value)
    writer = WandbWriter({"project": "tenax-test", "mode": "offline"}, "flush-test", "stores")
    writer.open(0, SPEC)
    try:
        assert writer.run.settings.x_transaction_log_flush_interval == TRANSACTION_LOG_FLUSH_S
        assert TRANSACTION_LOG_FLUSH_S <= 1.0
    finally:
        writer.close()
