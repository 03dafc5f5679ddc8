"""The validation loop (workers/evaluation.py): the eval loss is the mean cross-entropy a plain
torch loop computes over the same windows with the same weights, under any layout, and leaves
training untouched; the `eval` event reaches the controller's events, console and metrics."""
from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
import textwrap
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tenax.orchestrator.job.job_policy import FailurePolicy, JobAction, JobSnapshot, Limits
from tenax.orchestrator.job.metrics import TenaxCollector
from tenax.orchestrator.placement.worker_group import RankHealth, progressed
from tenax.orchestrator.timeouts import Timeouts
from tenax.orchestrator.job.progress import JobProgress
from tenax.parallel import build_model
from tenax.workers import human
from tenax.workers.errors import SpecError
from tenax.workers.worker import RankStatus
from tests.distributed import run_ranks
from tests.engine_jobs import tiny_spec

logger = logging.getLogger(__name__)
torch.set_num_threads(1)

SEQ, G, VAL_STEPS = 32, 8, 3  # TINY's seq_len and global batch
REPO = Path(__file__).resolve().parents[1]


def write_val(path: Path, n_tokens: int = VAL_STEPS * G * SEQ + 50) -> str:
    """A flat uint16 token file whose windows the reference reads straight from disk."""
    rng = np.random.default_rng(9)
    rng.integers(0, 128, size=n_tokens).astype("<u2").tofile(path)
    return path.as_uri()


def val_extra(uri: str, more: list[str] | None = None) -> list[str]:
    return [f"data.validation={{uri: '{uri}', every_steps: 2, steps: {VAL_STEPS}}}",
            "train.lr=0.01"] + (more or [])


def plain_eval_loss(params: dict[str, torch.Tensor], uri: str, extra: list[str]) -> float:
    """Independent reference: the windows read with numpy, a plain model, F.cross_entropy."""
    spec = tiny_spec(extra)
    model = build_model(spec.model.args(), spec.train.seed)
    model.load_state_dict(params)  # strict: every weight trained, or it would score the init
    tokens = np.fromfile(uri.removeprefix("file://"), dtype="<u2").astype(np.int64)
    losses = []
    with torch.no_grad():
        for i in range(VAL_STEPS * G):
            window = torch.from_numpy(tokens[i * SEQ: i * SEQ + SEQ + 1])
            logits = model(window[None, :-1])[0]
            losses.append(F.cross_entropy(logits.double(), window[1:], reduction="none"))
    return float(torch.cat(losses).mean())


def eval_job(rank: int, world: int, layout: dict[str, Any], extra: list[str],
             evaluate: bool) -> dict[str, Any]:
    """2 steps, an evaluation (or not), 2 more steps: losses, eval, cursor, final params."""
    from tenax.parallel.layout import ParallelLayout
    from tenax.workers.evaluation import Validator
    from tenax.workers.trainer import Trainer

    spec = tiny_spec(extra)
    trainer = Trainer(spec, ParallelLayout(**layout))
    losses = [trainer.run_step().loss for _ in range(2)]
    result, cursor = None, trainer.loader.samples_consumed
    if evaluate:
        result = Validator(spec).run(trainer)
        assert trainer.loader.samples_consumed == cursor
    params = trainer.full_params()
    losses += [trainer.run_step().loss for _ in range(2)]
    return {"losses": losses, "eval": result, "params_at_eval": params if rank == 0 else None}


@pytest.mark.slow
def test_eval_loss_is_the_plain_torch_mean(tmp_path: Path) -> None:
    uri = write_val(tmp_path / "val.bin")
    extra = val_extra(uri)
    out = run_ranks(eval_job, 1, {"micro_batch_size": 2}, extra, True)[0]
    want = plain_eval_loss(out["params_at_eval"], uri, extra)
    assert out["eval"].loss == pytest.approx(want, rel=1e-5)
    assert out["eval"].tokens == VAL_STEPS * G * SEQ and out["eval"].step == 2
    plain = run_ranks(eval_job, 1, {"micro_batch_size": 2}, extra, False)[0]
    assert out["losses"] == plain["losses"]  # evaluating changed nothing in training


LAYOUTS = [dict(dp=2, zero=1, micro_batch_size=2), dict(tp=2, micro_batch_size=2),
           dict(pp=2, pp_schedule="1f1b", micro_batch_size=2)]


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "-".join(
    f"{k}{v}" for k, v in d.items() if k in ("dp", "tp", "pp")))
def test_eval_under_other_layouts(tmp_path: Path, layout: dict) -> None:
    uri = write_val(tmp_path / "val.bin")
    extra = val_extra(uri)
    ref = run_ranks(eval_job, 1, {"micro_batch_size": 2}, extra, True)[0]
    world = layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1)
    outs = run_ranks(eval_job, world, layout, extra, True)
    for out in outs:  # every rank reports the same, job-wide loss
        assert out["eval"].loss == pytest.approx(ref["eval"].loss, rel=1e-5)
    plain = run_ranks(eval_job, world, layout, extra, False)[0]
    assert outs[0]["losses"] == plain["losses"]


def test_validation_spec_errors(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="data.validation.every_steps"):
        tiny_spec(["data.validation={uri: x, every_steps: 0}"])
    with pytest.raises(SpecError, match="data.validation.uri"):
        tiny_spec(["data.validation={steps: 2}"])
    from tenax.workers.evaluation import Validator

    short = write_val(tmp_path / "short.bin", n_tokens=SEQ * 5)
    with pytest.raises(ValueError, match=r"data.validation.uri: .* holds 4 windows .* fewer than "
                                         r"data.validation.steps \* train.global_batch_size"):
        Validator(tiny_spec(val_extra(short)))


def test_eval_event_reaches_progress_console_and_metrics() -> None:
    record = {"event": "eval", "step": 4, "loss": 3.5, "tokens": 768, "seconds": 0.2,
              "rank": 0, "time": 1.7e9}
    notices = list(JobProgress("j").absorb([record, {**record, "rank": 1}], None,
                                           _Closed(), _Closed()))
    assert [(n.event, n.fields["loss"], n.fields["step"]) for n in notices] == [("eval", 3.5, 4)]
    assert human(record) == "Validation at step 4: loss 3.5000 over 768 tokens in 0.20 s."
    collector = TenaxCollector()
    job = collector.add_job("j")
    job.on_event({"event": "eval", "job": "j", "step": 4, "loss": 3.5})
    samples = [s for m in collector.collect() if m.name == "tenax_job_eval_loss"
               for s in m.samples]
    assert [s.value for s in samples] == [3.5]


class _Closed:
    """Neither a rescale nor a recovery is open."""
    stopped, old, failed_at, source = False, None, None, ""


HANG_S, STEP_S, POLL_S = 10.0, 8.0, 1.0  # hang_timeout_s; a training step; heartbeat poll


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Controller:
    """The controller's side of one rank: heartbeats of the agent's status every POLL_S, the
    hang clock they restart (`progressed`), and the failure policy's decision."""

    def __init__(self, status: Any, clock: FakeClock) -> None:
        self.status, self.clock = status, clock
        self.seen, self.seen_at = asdict(status), clock.now
        self.decisions: list[Any] = []

    def wait(self, seconds: float) -> None:
        """`seconds` pass, with a heartbeat poll after each POLL_S."""
        for _ in range(round(seconds / POLL_S)):
            self.clock.now += POLL_S
            reply = asdict(self.status)
            if progressed(self.seen, reply):
                self.seen_at = self.clock.now
            self.seen = reply
            health = RankHealth(0, "n0", None, 0.1, reply["state"], reply["step"],
                                self.clock.now - self.seen_at, None)
            limits = Limits(3, 1, timeouts=Timeouts(hang_timeout_s=HANG_S))
            self.decisions.append(FailurePolicy().make_decision(
                JobSnapshot((health,), 0, limits)))

    def hangs(self) -> list[str]:
        return [d.reason for d in self.decisions if d.action != JobAction.CONTINUE]


def slow_evaluation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, report: bool,
                    state: str, step: int, batch_s: float
                    ) -> tuple[Controller, list[dict[str, Any]]]:
    """A rank in `state` at `step` runs a validation of VAL_STEPS batches of `batch_s` each
    (its agent noting the progress records when `report`), then takes a step of STEP_S."""
    from tenax.workers import evaluation

    clock = FakeClock()
    status = RankStatus(rank=0, state=state, step=step)
    controller = Controller(status, clock)

    def batch_loss(trainer: Any, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        controller.wait(batch_s)  # the forward passes of one batch
        return torch.tensor(float(inputs.numel()), dtype=torch.float64)

    monkeypatch.setattr(evaluation, "eval_loss_sum", batch_loss)
    monkeypatch.setattr(evaluation, "EvalProgress",
                        functools.partial(evaluation.EvalProgress, clock=clock))
    records: list[dict[str, Any]] = []

    def agent(record: dict[str, Any]) -> None:  # what RankWorker does with a "progress" message
        records.append(record)
        status.note_progress(record)

    validator = evaluation.Validator(tiny_spec(val_extra(write_val(tmp_path / "val.bin"))))
    trainer = SimpleNamespace(step=step, dp_rank=0, dp_size=1)
    result = validator.run(trainer, agent if report else None)
    assert result.step == step and result.loss == pytest.approx(1.0)  # numel / tokens
    controller.wait(STEP_S)  # the next training step
    status.state, status.step = "training", step + 1
    controller.wait(POLL_S)
    return controller, records


# (state, step, seconds per batch, limit): an evaluation after step 10 against hang_timeout_s;
# an `at_start` one while the rank is still starting, against the start-up limit (2x)
CASES = [("training", 10, 4.0, HANG_S), ("starting", 0, 8.0, 2 * HANG_S)]


@pytest.mark.parametrize("state,step,batch_s,limit", CASES, ids=[c[0] for c in CASES])
def test_a_validation_longer_than_the_hang_timeout_is_no_hang(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, state: str, step: int, batch_s: float,
        limit: float) -> None:
    assert VAL_STEPS * batch_s + STEP_S > limit > batch_s  # together too long; a batch is not
    controller, records = slow_evaluation(tmp_path, monkeypatch, True, state, step, batch_s)
    assert controller.hangs() == []
    assert [(r["event"], r["step"], r["batch"]) for r in records] == \
        [("evaluating", step, b) for b in range(1, VAL_STEPS + 1)]  # batches >= 1 s apart
    assert controller.status.progress == VAL_STEPS and controller.status.evaluating
    # the reference: without the progress records the same run is declared hung
    monkeypatch.undo()
    silent, _ = slow_evaluation(tmp_path, monkeypatch, False, state, step, batch_s)
    what = "step" if state == "training" else "start-up"
    assert silent.hangs() and f"rank 0 hung: {what} did not advance" in silent.hangs()[0]


def test_progress_records_are_rate_limited_but_the_last_batch_is_sent() -> None:
    from tenax.workers.evaluation import EvalProgress

    clock, sent = FakeClock(), []
    progress = EvalProgress(sent.append, 7, 50, gap_s=1.0, clock=clock)
    for batch in range(1, 51):
        clock.now += 0.3
        progress.batch_done(batch)
    batches = [r["batch"] for r in sent]
    assert batches[0] == 1 and batches[-1] == 50  # the first, and the end of the evaluation
    assert all(b - a == 4 for a, b in zip(batches, batches[1:-1]))  # 4 x 0.3 s >= 1 s
    assert progress.sent == len(sent) < 20


RANK_SCRIPT = """
import json, sys
from tenax.workers.rank import RankHooks, RankOptions, run_rank
from tenax.workers.rendezvous import free_port
from tests.ckpt_jobs import ckpt_spec
spec = ckpt_spec({ckpt!r}, {extra!r}).to_dict()
events, progress = [], []
hooks = RankHooks(on_step=lambda r: None, on_event=events.append, on_progress=progress.append)
run_rank(RankOptions(spec, {{"dp": 1}}, 0, 1, "127.0.0.1", free_port(), resume=False), hooks)
print(json.dumps({{"eval": [e for e in events if e["event"] == "eval"], "progress": progress,
                  "kinds": sorted({{e["event"] for e in events}})}}))
"""


@pytest.mark.slow
def test_rank_loop_emits_eval_events(tmp_path: Path) -> None:
    uri = write_val(tmp_path / "val.bin", n_tokens=12 * 2 * SEQ + 1)
    extra = ["train.steps=4", "checkpoint.every_steps=4", "checkpoint.memory_every_steps=0",
             f"data.validation={{uri: '{uri}', every_steps: 2, steps: 2, at_start: true}}"]
    script = RANK_SCRIPT.format(ckpt=(tmp_path / "ck").as_uri(), extra=extra)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    events = out["eval"]
    assert [e["step"] for e in events] == [0, 2, 4]
    # liveness: each evaluation's first and last batch (2 fast batches), never an event
    assert [(r["event"], r["step"], r["batch"], r["batches"]) for r in out["progress"]] == \
        [("evaluating", s, b, 2) for s in (0, 2, 4) for b in (1, 2)]
    assert "evaluating" not in out["kinds"]
    for e in events:
        assert {"step", "loss", "tokens", "seconds", "rank", "time"} <= set(e)
        assert e["tokens"] == 2 * 12 * SEQ and np.isfinite(e["loss"])


@pytest.mark.slow  # a forkserver with torch preloaded, and a 4-step rank
def test_the_agent_counts_evaluation_progress_and_forwards_no_record(tmp_path: Path) -> None:
    """The real path: training process -> pipe -> agent status (`progress`, which restarts
    the controller's hang clock), while the agent's events stay the pinned kinds."""
    import gc

    from tenax.workers.rendezvous import free_port
    from tenax.workers.worker import RankRun, RankWorker
    from tests.ckpt_jobs import ckpt_spec

    uri = write_val(tmp_path / "val.bin", n_tokens=12 * 2 * SEQ + 1)
    extra = ["train.steps=4", "checkpoint.every_steps=4", "checkpoint.memory_every_steps=0",
             f"data.validation={{uri: '{uri}', every_steps: 2, steps: 2, at_start: true}}"]
    spec = ckpt_spec((tmp_path / "ck").as_uri(), extra).to_dict()
    agent = RankWorker()  # its own forkserver: no Ray needed
    try:
        attempt = agent.start(RankRun(spec, {"dp": 1}, 0, 1, "127.0.0.1", free_port()))
        assert agent.wait_ended(attempt, 300)
        beat = agent.heartbeat()
    finally:
        agent.stop()
        gc.unfreeze()  # the agent froze this test process's heap
    assert beat["state"] == "done", beat["error"]
    assert beat["progress"] == 6  # 3 evaluations x (first + last of 2 batches)
    assert beat["evaluating"] == "step 4 batch 2/2"  # the last evaluation followed step 4
    kinds = {e["event"] for e in beat["events"]}
    assert "eval" in kinds and "evaluating" not in kinds
