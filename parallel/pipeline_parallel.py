"""Pipeline parallelism on `torch.distributed.pipelining`: split by layer, run a schedule.

A stage is the same `Transformer` class with the blocks it does not own deleted (the ModuleDict
keeps the survivors' keys, so parameter names — and with them init and checkpoints — do not
depend on the split). The first stage keeps the embedding, the last the final norm and head.

The split can be uneven: the first and last stages also run the embedding and the (vocab-wide)
head + loss, so `uneven=True` gives them one block fewer where the count allows.

Schedules: gpipe, 1f1b, interleaved_1f1b (v stages per rank, looped placement) and zero_bubble
(v=2: the V-shaped ZBV schedule, stage r and 2p-1-r on rank r; v=1: the interleaved zero-bubble
schedule with one stage per rank). Gradients are not scaled by the schedule: the loss function
already divides by the global token count, like every other parallelism here.

Each stage records its busy time (forward + backward compute) per step, so the measured bubble
(1 - busy / step time) can be compared with the cost model's formula for the schedule.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                                          ScheduleZBVZeroBubble)

from tenax.parallel.config import ModelArgs
from tenax.parallel.model import Transformer

logger = logging.getLogger(__name__)


def split_layers(n_layers: int, n_stages: int, uneven: bool = False) -> list[list[int]]:
    """Contiguous layer ids per stage; with `uneven`, first and last stages get fewer blocks."""
    if n_stages > n_layers:
        raise ValueError(f"{n_stages} pipeline stages exceed model.n_layers={n_layers}")
    weights = [1.0] * n_stages
    if uneven and n_stages > 2 and n_layers >= 2 * n_stages:
        weights[0] = weights[-1] = 0.5  # they also carry the embedding / the head and loss
    sizes = [max(1, round(n_layers * w / sum(weights))) for w in weights]
    sizes[n_stages // 2] += n_layers - sum(sizes)  # rounding remainder to a middle stage
    out, start = [], 0
    for size in sizes:
        out.append(list(range(start, start + size)))
        start += size
    return out


def stage_ids(pp_rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    """Stage indices held by one pp rank: looped (r, r+p, ...) or V-shaped for ZBV."""
    if schedule == "zero_bubble" and virtual == 2:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual)]


def build_stage_module(spec: ModelArgs, layer_ids: list[int], first: bool,
                       last: bool) -> Transformer:
    """A Transformer that keeps only `layer_ids` (built on the current default device)."""
    model = Transformer(spec)
    for key in list(model.layers.keys()):
        if int(key) not in layer_ids:
            del model.layers[key]
    if not first:
        model.tok_embeddings = None
    if not last:
        model.norm = None
        model.output = None
    return model


class TimedStage(PipelineStage):
    """A PipelineStage that adds its compute (forward, input- and weight-backward) to `busy`.

    Sends and receives are issued by the schedule outside these methods, so `busy` is compute
    only and wall - busy is this rank's bubble plus communication wait.
    """

    def __init__(self, *args: Any, busy: list[float], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.busy = busy

    def _timed(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.busy[0] += time.perf_counter() - start

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(super().backward_one_chunk, *args, **kwargs)

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(super().backward_weight_one_chunk, *args, **kwargs)


class PipelineRunner:
    """Runs one optimizer step's micro-batches through the schedule on this pp rank."""

    def __init__(self, parts: list[nn.Module], ids: list[int], num_stages: int, schedule: str,
                 n_microbatches: int, group: dist.ProcessGroup, device: torch.device,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.busy = [0.0]
        self.ids, self.num_stages = ids, num_stages
        stages = [TimedStage(part, sid, num_stages, device, group=group, busy=self.busy)
                  for part, sid in zip(parts, ids)]
        self.schedule = _make_schedule(schedule, stages, n_microbatches, loss_fn)
        self.has_first = 0 in ids
        self.has_last = num_stages - 1 in ids

    def step(self, inputs: torch.Tensor,
             targets: torch.Tensor) -> tuple[list[torch.Tensor], float, float]:
        """Run all micro-batches: (per-micro-batch losses on the last stage, busy s, wall s)."""
        self.busy[0] = 0.0
        start = time.perf_counter()
        args = (inputs,) if self.has_first else ()
        kwargs = {"target": targets} if self.has_last else {}
        losses: list[torch.Tensor] = []
        self.schedule.step(*args, **kwargs, losses=losses, return_outputs=False)
        return losses, self.busy[0], time.perf_counter() - start


def _make_schedule(name: str, stages: list[PipelineStage], n_micro: int,
                   loss_fn: Callable) -> object:
    common = dict(n_microbatches=n_micro, loss_fn=loss_fn, scale_grads=False)
    if name in ("gpipe", "1f1b"):
        if len(stages) != 1:
            raise ValueError(f"parallel.pp_schedule {name!r} runs one stage per rank, "
                             f"got {len(stages)}")
        cls = ScheduleGPipe if name == "gpipe" else Schedule1F1B
        return cls(stages[0], **common)
    if name == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, **common)
    if name == "zero_bubble":
        cls = ScheduleZBVZeroBubble if len(stages) == 2 else ScheduleInterleavedZeroBubble
        return cls(stages, **common)
    raise ValueError(f"parallel.pp_schedule: unknown schedule {name!r}")
