"""The validation loop (workers/evaluation.py): the eval loss is the mean cross-entropy a plain
torch loop computes over the same windows with the same weights, under any layout, and leaves
training untouched; the `eval` event reaches the controller's events, console and metrics."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tenax.orchestrator.job.metrics import TenaxCollector
from tenax.orchestrator.job.progress import JobProgress
from tenax.parallel import build_model
from tenax.workers import human
from tenax.workers.errors import SpecError
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
    model.load_state_dict(params, strict=False)
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


RANK_SCRIPT = """
import json, sys
from tenax.workers.rank import RankHooks, RankOptions, run_rank
from tenax.workers.rendezvous import free_port
from tests.ckpt_jobs import ckpt_spec
spec = ckpt_spec({ckpt!r}, {extra!r}).to_dict()
events = []
hooks = RankHooks(on_step=lambda r: None, on_event=events.append)
run_rank(RankOptions(spec, {{"dp": 1}}, 0, 1, "127.0.0.1", free_port(), resume=False), hooks)
print(json.dumps([e for e in events if e["event"] == "eval"]))
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
    events = json.loads(done.stdout.strip().splitlines()[-1])
    assert [e["step"] for e in events] == [0, 2, 4]
    for e in events:
        assert {"step", "loss", "tokens", "seconds", "rank", "time"} <= set(e)
        assert e["tokens"] == 2 * 12 * SEQ and np.isfinite(e["loss"])
