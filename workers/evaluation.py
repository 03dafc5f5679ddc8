"""The validation loop: held-out loss every `data.validation.every_steps` steps.

Validation sample i is window i of the validation set's concatenated stream, in file order
(tokens [i*S, i*S + S + 1)), for i in [0, steps * global_batch_size): no permutation, so every
evaluation of a job, under any layout, reads exactly the same windows and the numbers are
comparable across steps and restarts. The eval loss is the mean token cross-entropy over all of
them, computed under the job's current layout (each dp rank its slice of every batch, pp/tp/cp
as in training), forward only under torch.no_grad: no optimizer step, and the training cursor,
RNG and losses are untouched. The loss counts every token (data.mask_eos_loss applies to the
training loss only); data.document_mask applies, as the model was trained with it.

Liveness: an evaluation takes no optimizer step, yet the controller declares a hang when a
rank's step does not advance for hang_timeout_s. So `run` reports its progress after each batch
(`EvalProgress`: an internal `evaluating` record, at most one per `PROGRESS_GAP_S` and always
the last batch) to a sink the rank's agent reads; the agent counts them in its status and the
controller restarts the rank's hang clock when that count changes. A validation set longer
than the timeout is then no hang, while a rank stuck inside one batch still is.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from tenax.parallel import cross_entropy_sum
from tenax.workers.data import check_document_ends, open_uri
from tenax.workers.spec import JobSpec

logger = logging.getLogger(__name__)

EVALUATING = "evaluating"  # the progress record's kind: consumed by the agent, never forwarded
PROGRESS_GAP_S = 1.0  # at most one progress record per this many seconds (fast batches)


@dataclass
class EvalResult:
    step: int  # optimizer steps completed when it ran
    loss: float  # mean token cross-entropy over every validation token
    tokens: int  # tokens evaluated
    seconds: float  # wall time of the evaluation

    def record(self) -> dict[str, Any]:
        """The `eval` event's fields."""
        return {"event": "eval", **asdict(self)}


class EvalProgress:
    """Hands `{"event": "evaluating", "step", "batch", "batches"}` records to `send`, rate
    limited: the first batch, then one per `gap_s`, and always the last batch (the hang clock
    then restarts when the evaluation ends, not up to `gap_s` before)."""

    def __init__(self, send: Callable[[dict[str, Any]], None], step: int, batches: int,
                 gap_s: float = PROGRESS_GAP_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.send, self.step, self.batches = send, step, batches
        self.gap_s, self.clock = gap_s, clock
        self.sent_at: float | None = None
        self.sent = 0  # records handed over (what a test compares with the batches)

    def batch_done(self, batch: int) -> None:
        """Batch `batch` (1-based) of the evaluation is done."""
        now = self.clock()
        due = self.sent_at is None or now - self.sent_at >= self.gap_s
        if not due and batch < self.batches:
            return
        self.sent_at, self.sent = now, self.sent + 1
        self.send({"event": EVALUATING, "step": self.step, "batch": batch,
                   "batches": self.batches})


class Validator:
    """Runs the validation batches of `data.validation` on one rank (collective: every rank)."""

    def __init__(self, spec: JobSpec) -> None:
        val = spec.data.validation
        if val is None:
            raise ValueError("Validator: the spec has no data.validation section")
        self.every, self.steps, self.at_start = val.every_steps, val.steps, val.at_start
        self.seq_len, self.g = spec.model.seq_len, spec.train.global_batch_size
        self.source = open_uri(val.uri, spec.data.token_dtype, self.seq_len,
                               spec.model.vocab_size, spec.train.seed, "data.validation.uri")
        needed = self.steps * self.g
        if self.source.num_samples < needed:
            raise ValueError(f"data.validation.uri: {val.uri!r} holds {self.source.num_samples} "
                             f"windows of model.seq_len+1={self.seq_len + 1} tokens, fewer than "
                             f"data.validation.steps * train.global_batch_size = {needed}")
        check_document_ends(spec.data, [self.source])  # its documents are masked alike

    @classmethod
    def from_spec(cls, spec: JobSpec) -> "Validator | None":
        return cls(spec) if spec.data.validation is not None else None

    def due(self, step: int) -> bool:
        """Evaluate after step `step` (completed steps); step 0 means before the first step."""
        return self.at_start if step == 0 else step % self.every == 0

    def batch(self, index: int, dp_rank: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank `dp_rank`'s slice of validation batch `index` (windows in file order)."""
        per_rank = self.g // dp_size
        first = index * self.g + dp_rank * per_rank
        rows = self.source.samples(np.arange(first, first + per_rank, dtype=np.int64))
        tokens = torch.from_numpy(rows)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def run(self, trainer: Any,
            on_progress: Callable[[dict[str, Any]], None] | None = None) -> EvalResult:
        """Mean cross-entropy over every validation batch under `trainer`'s layout;
        `on_progress` gets the rate-limited `evaluating` records (`EvalProgress`)."""
        start = time.perf_counter()
        total = 0.0
        progress = EvalProgress(on_progress, trainer.step, self.steps) \
            if on_progress is not None else None
        for index in range(self.steps):
            inputs, targets = self.batch(index, trainer.dp_rank, trainer.dp_size)
            total += float(eval_loss_sum(trainer, inputs, targets).item())
            if progress is not None:
                progress.batch_done(index + 1)
        tokens = self.steps * self.g * self.seq_len
        result = EvalResult(trainer.step, total / tokens, tokens,
                            round(time.perf_counter() - start, 6))
        logger.info("eval at step %d: loss %.4f over %d tokens in %.2fs", result.step,
                    result.loss, tokens, result.seconds)
        return result


@torch.no_grad()
def eval_loss_sum(trainer: Any, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy (float64) of a global batch given as this rank's dp slice,
    forward only under the trainer's layout, reduced over the job: the same on every rank."""
    inputs = trainer.local_tokens(inputs).to(trainer.device)
    targets = trainer.local_tokens(targets).to(trainer.device)
    total = torch.zeros((), dtype=torch.float64, device=trainer.device)
    pipeline = trainer.pipeline
    if pipeline is not None:
        losses: list[torch.Tensor] = []
        args = (inputs,) if pipeline.has_first else ()
        kwargs = {"target": targets} if pipeline.has_last else {}
        pipeline.schedule.eval(*args, **kwargs, losses=losses, return_outputs=False)
        for micro in losses:  # the pipeline's loss function scaled each sum by loss_scale
            total += micro.detach().double() / trainer.loss_scale
        dist.all_reduce(total, group=trainer.mesh["pp"].get_group())
    else:
        mb, model, dtype = trainer.layout.micro_batch_size, trainer.parts[0], \
            trainer.autocast_dtype
        for i in range(0, inputs.shape[0], mb):
            x, y = inputs[i:i + mb], targets[i:i + mb]
            with torch.autocast(trainer.device.type, dtype=dtype, enabled=dtype is not None):
                logits = model(x, **trainer.attention_inputs(x))
            total += cross_entropy_sum(logits, y)[0].double()
    dist.all_reduce(total, group=trainer.pm.groups.dp_cp)
    return total
