"""A job's runs across its attempts: the controller's relay of a backend switched off, the
restart totals W&B gets, a redone step read back once, TensorBoard's framing and fsspec paths, and
the controller's own `job` run."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from tenax.workers.tracking import TensorBoardWriter, TrackingStart, tfrecord
from tests.test_tracking import SPEC, f32, step_record, wait_until
from tests.tracking_readers import tensorboard_scalars, tensorboard_texts


def test_the_controller_relays_tracking_off_and_the_console_prints_it():
    import io

    from rich.console import Console

    from tenax.orchestrator.cli.runner import EventSink
    from tenax.orchestrator.job.progress import JobProgress
    from tenax.workers.events import human

    off = {"event": "tracking_off", "backend": "wandb", "reason": "open failed: x", "step": 0,
           "rank": 0, "time": 5.0}
    progress = JobProgress("j")
    notices = list(progress.absorb([off], None, SimpleNamespace(stopped=False, old=None),
                                   SimpleNamespace(failed_at=None)))
    assert [(n.event, n.fields) for n in notices] == [
        ("tracking_off", {"backend": "wandb", "reason": "open failed: x", "step": 0,
                          "time": 5.0})]
    out = io.StringIO()
    EventSink(None, Console(file=out, width=200), None, None, 10)(off)
    assert human(off) in out.getvalue()
    assert human(off) == ("Tracking to wandb is off from step 0 and training goes on: "
                          "open failed: x.")


def test_a_restart_tells_wandb_the_controllers_totals():
    # resumed at step 10 after steps up to 12 ran: 2 more lost, as the controller will count
    start = TrackingStart("r", restarts=2, lost_steps=3, reached_step=12)
    assert start.figures(10) == {"job/restarts": 2.0, "job/lost_steps": 5.0}
    assert TrackingStart("r", reached_step=12).figures(12) == {}  # a first start: nothing
    assert TrackingStart("r", restarts=1, reached_step=12).figures(15) == {
        "job/restarts": 1.0, "job/lost_steps": 0.0}


def test_wandb_gets_the_restart_totals_in_the_attempts_first_row(monkeypatch):
    import sys

    from tenax.workers.tracking import open_tracker

    logged, inits = [], []
    run = SimpleNamespace(log=lambda row, step: logged.append((step, dict(row))),
                          finish=lambda: None)
    fake = SimpleNamespace(Settings=lambda **kw: kw, init=lambda **kw: inits.append(kw) or run)
    monkeypatch.setitem(sys.modules, "wandb", fake)  # the calls, not a W&B run directory
    spec = {**SPEC, "logging": {"wandb": {"mode": "offline"}}}
    tracker = open_tracker(spec, TrackingStart("run-1", 1, 0, 12), rank=0, first_step=10)
    tracker.submit(step_record(11, 3.0))
    assert tracker.close().failed == []
    assert [kw["id"] for kw in inits] == ["run-1"]
    assert logged[0][0] == 11 and logged[0][1]["train/loss"] == 3.0
    assert (logged[0][1]["job/restarts"], logged[0][1]["job/lost_steps"]) == (1.0, 2.0)


def write_attempt(logdir: Path, first_step: int, losses: dict[int, float]) -> None:
    writer = TensorBoardWriter(str(logdir))
    writer.open(first_step, SPEC)
    for step, loss in sorted(losses.items()):
        writer.scalars(step, {"train/loss": loss}, 1000.0 + step)
    writer.close()


def test_a_redone_step_reads_back_once_with_its_final_value(tmp_path):
    logdir = tmp_path / "tb"
    first = {s: 10.0 + s for s in range(1, 8)}  # died after step 7
    second = {s: 20.0 + s for s in range(6, 11)}  # resumed from step 5: 6..10 again
    write_attempt(logdir, 0, first)
    write_attempt(logdir, 5, second)  # in the same second: names still sort by creation
    assert len(list(logdir.iterdir())) == 2
    want = {**first, **second}
    assert tensorboard_scalars(logdir)["train/loss"] == [(s, f32(want[s])) for s in range(1, 11)]
    texts = tensorboard_texts(logdir)
    assert [step for step, _ in texts["spec"]] == [1]  # written once, by the fresh start
    assert [step for step, _ in texts["attempts"]] == [1, 6]


def test_tfrecord_framing_matches_tensorboards_reader(tmp_path):
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter

    class Sink:
        def __init__(self) -> None:
            self.data = b""

        def write(self, data: bytes) -> None:
            self.data += data

        def flush(self) -> None:
            pass

    payload = Event(step=3, wall_time=1.5, file_version="brain.Event:2").SerializeToString()
    sink = Sink()
    RecordWriter(sink).write(payload)
    assert tfrecord(payload) == sink.data


def test_tensorboard_dir_may_be_an_fsspec_uri():
    import fsspec

    writer = TensorBoardWriter("memory://tenax-tracking-test/tb")
    writer.open(0, SPEC)
    writer.scalars(1, {"train/loss": 2.5}, 1001.0)
    writer.close()
    fs = fsspec.filesystem("memory")
    names = fs.ls("/tenax-tracking-test/tb", detail=False)
    assert len(names) == 1 and "tfevents" in names[0]
    assert fs.cat(names[0])[:8] != b""  # the records are there; the local tests read them back
    fs.rm("/tenax-tracking-test", recursive=True)


def test_the_controllers_run_switched_off_is_told_as_an_event_of_the_job(tmp_path):
    from tenax.workers.events import human
    from tenax.workers.tracking import job_events

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    told: list[dict] = []
    writer = job_events({"logging": {"tensorboard_dir": str(blocker / "tb")}}, told.append)
    writer.on_event({"event": "recovered", "step": 10, "lost_steps": 2, "seconds": 3.5})
    assert wait_until(lambda: writer.on_event({"event": "state", "state": "RUNNING"}) or told)
    writer.on_event({"event": "tracking_off", **told[0]})  # published back: not a loop
    writer.close()
    assert len(told) == 1, told
    off = told[0]
    assert off["event"] == "tracking_off" and off["backend"] == "tensorboard"
    assert off["run"] == "job" and off["reason"].startswith("open failed: ")
    assert "(the job's own run) is off" in human(off)


def test_the_controllers_events_form_a_run_that_is_never_purged(tmp_path):
    from tenax.workers.tracking import job_events

    tb = tmp_path / "tb"
    writer = job_events({"logging": {"tensorboard_dir": str(tb)}})
    events = [{"event": "failure", "step": 12, "rank": 1, "cause": "SIGKILL", "time": 1.0},
              {"event": "recovered", "step": 10, "lost_steps": 2, "seconds": 3.5, "time": 2.0},
              {"event": "step", "step": 11, "loss": 1.0},  # rank 0's run has these
              {"event": "failure", "step": 14, "rank": 0, "cause": "hung", "time": 3.0},
              {"event": "recovered", "step": 13, "lost_steps": 1, "seconds": 2.5, "time": 4.0}]
    for event in events:
        writer.on_event(event)
    writer.close()
    scalars = tensorboard_scalars(tb / "job")
    assert scalars["job/restarts"] == [(10, 1.0), (13, 2.0)]
    assert scalars["job/lost_steps"] == [(10, 2.0), (13, 3.0)]
    assert scalars["job/recovery_s"] == [(10, 3.5), (13, 2.5)]
    assert "train/loss" not in scalars
    texts = tensorboard_texts(tb / "job")
    assert [step for step, _ in texts["failures"]] == [12, 14]  # the later resume hid none
    assert [step for step, _ in texts["recoveries"]] == [10, 13]
    assert job_events({"logging": {"tensorboard_dir": None}}) is None
