"""The train loop of one rank: gradient accumulation to the fixed global batch, AdamW, warmup +
cosine LR, global grad-norm clipping over sharded grads, and honest per-rank timing.

The loss of a step is the mean over every token of the global batch, whatever the layout: each
rank backpropagates `sum of its token losses * dp / global tokens`, and every data-parallel
implementation averages gradients over dp, which gives exactly the gradient of the global mean.
So a run in any layout follows the single-process run step for step.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from tenax.parallel import (ParallelLayout, ParallelModel, adamw_impl, cross_entropy_sum,
                            engine_recompute, init_weights, local, parallelize)
from tenax.workers.chaos_injector import slow_down
from tenax.workers.data import (IGNORE_INDEX, TokenDataLoader, document_mask, document_positions,
                                documents_eos_id, mask_eos_targets)
from tenax.workers.spec import JobSpec

if TYPE_CHECKING:
    from tenax.parallel import PipelineRunner

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class StepResult:
    step: int  # optimizer steps completed after this one
    loss: float  # mean token loss over the global batch
    grad_norm: float  # before clipping
    lr: float
    step_s: float  # wall time of the step
    busy_s: float  # this rank's compute time: step time minus waits in explicit collectives
    tokens: int  # tokens of the global batch
    rank_tokens: int  # tokens this rank processed

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s if self.step_s > 0 else 0.0

    @property
    def rank_tokens_per_s(self) -> float:
        return self.rank_tokens / self.busy_s if self.busy_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s,
                "rank_tokens_per_s": self.rank_tokens_per_s}


def lr_at(step: int, spec: JobSpec) -> float:
    """Linear warmup to train.lr, then cosine decay to 10% of it at train.steps."""
    t = spec.train
    if t.warmup_steps and step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    return t.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def pick_device(spec: JobSpec) -> torch.device:
    want = spec.resources.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Trainer:
    """Owns one rank's model, optimizer and data cursor; `train_step()` runs one optimizer step."""

    def __init__(self, spec: JobSpec, layout: ParallelLayout, optimizer: str = "adamw",
                 device: torch.device | None = None, initialise: bool = True) -> None:
        """`initialise=False`: for a rank about to load a checkpoint, which overwrites every
        parameter — the weights are initialised only by `initialise_weights()` (~45 ms per
        restart saved here); until then they hold whatever the allocation held."""
        self.spec, self.layout = spec, layout
        model_args = spec.model.args()  # the engine takes its own plain config
        layout.validate(model_args, dist.get_world_size(), spec.train.global_batch_size)
        self.device = device or pick_device(spec)
        self.mesh = layout.build_mesh(self.device.type)
        recompute = engine_recompute(spec.parallel.recompute, model_args, layout,
                                     spec.train.global_batch_size, spec.train.dtype, self.device,
                                     spec.resources.gpus_per_node)
        # Params stay fp32 (master weights); low precision comes from autocast on GPUs.
        init_from = spec.model.init_from  # HF weights replace the seeded init
        self.pm: ParallelModel = parallelize(model_args, layout, self.mesh, spec.train.seed,
                                             self.device,
                                             initialise=initialise and init_from is None,
                                             recompute=recompute, compile=spec.train.compile)
        self.parts = self.pm.parts
        self.optimizer = self._build_optimizer(optimizer)
        self.loader = TokenDataLoader.from_job_spec(spec)
        self.step = 0
        self.coords = layout.coords(dist.get_rank())
        self.dp_rank, self.dp_size = self.coords["dp"], layout.dp
        self.accum = layout.accumulation_steps(spec.train.global_batch_size)
        self.autocast_dtype = _DTYPES[spec.train.dtype] if self.device.type == "cuda" else None
        self.global_tokens = spec.train.global_batch_size * spec.model.seq_len
        # Each rank's loss is scaled so that averaging grads over the dp*cp ranks gives the
        # gradient of the global-batch mean loss.
        self.loss_scale = layout.dp * layout.cp / self.global_tokens
        self.step_tokens = self.global_tokens  # tokens the loss counts (fewer with mask_eos_loss)
        self.eos_id = documents_eos_id(spec.data, layout.cp, layout.pp)
        self._set_positions()
        self.pipeline = self._build_pipeline() if layout.pp > 1 else None
        self.last_moe_stats: dict[str, Any] = {}
        self.slow_factor = 1.0  # chaos `slow`: compute takes this many times as long
        # Called with (micro-batch index, is last) once the engine is ready for that
        # micro-batch: benches and tests read held memory there without patching the trainer.
        self.on_micro_batch: Callable[[int, bool], None] | None = None
        if initialise and init_from is not None:
            self.initialise_weights()

    def initialise_weights(self) -> None:
        """The values `Trainer(initialise=True)` starts from: each a function of (seed, name)
        alone, written in place, so ZeRO's shard views and FSDP's shards see them too. With
        `model.init_from`, the HF weights instead (checked before any is written)."""
        if self.spec.model.init_from is not None:
            from tenax.workers.hf.load import load_hf_into

            load_hf_into(self.parts, self.spec.model.args(), self.spec.model.init_from)
            return
        for part in self.parts:
            init_weights(part, self.spec.train.seed)

    def checkpoint_facts(self) -> dict[str, Any]:
        """What a manifest records of the job (plain values: the checkpoint layer does not
        read this layer's spec model): its seed, and the spec (`tenax export hf` reads it)."""
        return {"seed": self.spec.train.seed,
                "spec": self.spec.model_dump(mode="json", by_alias=True)}

    def attention_inputs(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Keyword inputs of the model for tokens `x`: per-document positions and block-causal
        mask with data.document_mask, else none (the layout's positions, plain causal)."""
        if not self.spec.data.document_mask:
            return {}
        return {"positions": document_positions(x, self.eos_id),
                "attn_mask": document_mask(x, self.eos_id)}

    def local_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of a batch of sequences: its zig-zag chunks under CP."""
        return self._local_tokens(x)

    def _count_step_tokens(self, targets: torch.Tensor) -> None:
        """With EOS targets ignored, the loss is the mean over the counted tokens of the whole
        global batch: one all-reduce of this rank's count over dp x cp sets the scale."""
        count = (targets != IGNORE_INDEX).sum().to(torch.float64).to(self.device)
        dist.all_reduce(count, group=self.pm.groups.dp_cp)
        self.step_tokens = max(1, int(count.item()))
        self.loss_scale = self.layout.dp * self.layout.cp / self.step_tokens

    def _set_positions(self) -> None:
        s, cp = self.spec.model.seq_len, self.layout.cp
        if cp > 1:
            from tenax.parallel import zigzag_indices

            positions = zigzag_indices(s, cp, self.coords["cp"]).to(self.device)
        else:
            positions = torch.arange(s, device=self.device)
        for part in self.parts:
            part.positions = positions

    def _build_pipeline(self) -> "PipelineRunner":
        from tenax.parallel import PipelineRunner

        n_stages = self.layout.pp * self.layout.pp_virtual_stages
        return PipelineRunner(self.parts, self.pm.stage_ids, n_stages, self.layout.pp_schedule,
                              self.accum, self.mesh["pp"].get_group(), self.device,
                              self._pipeline_loss)

    def _pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        micro_sum, _ = cross_entropy_sum(logits, targets)
        return micro_sum * self.loss_scale

    def _local_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of a batch of sequences: its zig-zag chunks under CP."""
        if self.layout.cp == 1:
            return x
        from tenax.parallel import zigzag_split

        return zigzag_split(x, self.layout.cp, self.coords["cp"])

    def _build_optimizer(self, kind: str) -> torch.optim.Optimizer:
        params, t = self.pm.optimizer_params(), self.spec.train
        if kind == "adamw":
            return torch.optim.AdamW(params, lr=t.lr, betas=(0.9, 0.95), eps=1e-8,
                                     weight_decay=t.weight_decay,
                                     **adamw_impl(self.device))
        if kind == "sgd":  # exact across layouts; used by parity tests on parameters
            return torch.optim.SGD(params, lr=t.lr, foreach=False)
        raise ValueError(f"optimizer: {kind!r} must be 'adamw' or 'sgd'")

    # ---- one step --------------------------------------------------------------------------
    def train_step(self) -> StepResult:
        start = time.perf_counter()
        inputs, targets = self.loader.next_batch(self.dp_rank, self.dp_size)
        if self.spec.data.mask_eos_loss:
            targets = mask_eos_targets(inputs, targets, self.eos_id)
        inputs = self._local_tokens(inputs).to(self.device)
        targets = self._local_tokens(targets).to(self.device)
        if self.spec.data.mask_eos_loss:
            self._count_step_tokens(targets)
        if self.pipeline is not None:
            loss_sum, busy = self._pipeline_step(inputs, targets)
        else:
            loss_sum, busy = self._forward_backward(inputs, targets)
        if self.slow_factor > 1.0:  # a slow device: this rank's own work stretches, not its waits
            extra = (self.slow_factor - 1.0) * (time.perf_counter() - start)
            slow_down(extra)
            busy += extra
        t0 = time.perf_counter()
        # The loss sum is final now: reduce it behind the gradient buckets instead of as one
        # more blocking collective at the end of the step (waited for after the optimizer).
        loss_work = None if self.pipeline is not None else dist.all_reduce(
            loss_sum, group=self.pm.groups.dp_cp, async_op=True)
        for dp in self.pm.dps:
            dp.finish_grads()
        norm = self.clip_grads()
        waited = time.perf_counter() - t0
        lr = lr_at(self.step, self.spec)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        t0 = time.perf_counter()
        self.optimizer.step()
        busy += time.perf_counter() - t0
        t0 = time.perf_counter()
        for dp in self.pm.dps:
            dp.after_optimizer_step()
        loss = self._global_loss(loss_sum, loss_work)
        waited += time.perf_counter() - t0
        self.step += 1
        step_s = time.perf_counter() - start
        busy = busy if self.pipeline is not None else max(step_s - waited, 1e-9)
        return StepResult(self.step, loss, norm, lr, step_s, busy, self.global_tokens,
                          inputs.numel())

    def _global_loss(self, loss_sum: torch.Tensor, work: dist.Work | None) -> float:
        """Mean token loss of the global batch; under PP only last-stage ranks hold a sum."""
        if work is not None:
            work.wait()
            return loss_sum.item() / self.step_tokens
        if self.layout.pp > 1:
            dist.all_reduce(loss_sum, group=self.mesh["pp"].get_group())
        dist.all_reduce(loss_sum, group=self.pm.groups.dp_cp)
        return loss_sum.item() / self.step_tokens

    def _pipeline_step(self, inputs: torch.Tensor,
                       targets: torch.Tensor) -> tuple[torch.Tensor, float]:
        losses, busy, _ = self.pipeline.step(inputs, targets)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for micro in losses:
            loss_sum += micro.detach().double() / self.loss_scale
        return loss_sum, busy

    def _forward_backward(self, inputs: torch.Tensor,
                          targets: torch.Tensor) -> tuple[torch.Tensor, float]:
        from tenax.parallel import moe_aux_loss, moe_stats

        mb, model = self.layout.micro_batch_size, self.parts[0]
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        start = time.perf_counter()
        for i in range(self.accum):
            self._begin_micro_batch(i == self.accum - 1)
            if self.on_micro_batch is not None:
                self.on_micro_batch(i, i == self.accum - 1)
            x, y = inputs[i * mb:(i + 1) * mb], targets[i * mb:(i + 1) * mb]
            with torch.autocast(self.device.type, dtype=self.autocast_dtype,
                                enabled=self.autocast_dtype is not None):
                logits = model(x, **self.attention_inputs(x))
            micro_sum, n_tokens = cross_entropy_sum(logits, y)
            objective = micro_sum
            if self.spec.model.moe is not None:  # aux loss per token, like the cross-entropy
                objective = micro_sum + moe_aux_loss(model) * n_tokens
                self.last_moe_stats = {k: v for k, v in moe_stats(model).items()}
            (objective * self.loss_scale).backward()
            loss_sum += micro_sum.detach().double()
        return loss_sum, time.perf_counter() - start

    def _begin_micro_batch(self, last: bool) -> None:
        for dp in self.pm.dps:
            dp.begin_micro_batch(last)
        if self.pm.fsdp:  # FSDP2: reduce-scatter only once, after the last micro-batch
            for part in self.parts:
                part.set_requires_gradient_sync(last)

    # ---- grad norm -------------------------------------------------------------------------
    def _owned_grads(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.pm.dps:
            return [item for dp in self.pm.dps for item in dp.owned_grads()]
        return [(p, local(p.grad)) for p in self.pm.parameters() if p.grad is not None]

    def _grads_to_scale(self) -> list[torch.Tensor]:
        if self.pm.dps and self.layout.zero in (1, 2):  # the optimizer steps the shards' grads
            return [g for dp in self.pm.dps for _, g in dp.owned_grads()]
        return [local(p.grad) for p in self.pm.parameters() if p.grad is not None]

    @torch.no_grad()
    def clip_grads(self) -> float:
        """Global L2 norm over every rank's grads, counted once each, then clip to grad_clip.

        Each rank sums the squares of the grad pieces it owns; a piece replicated over a mesh
        dimension is weighted by 1/size of it, so one all-reduce over the world counts every
        element exactly once, whatever mix of DP chunks, TP shards and FSDP shards there is.
        """
        lay = self.layout
        if lay.zero == 0 and lay.tp == lay.pp == lay.ep == 1:
            # Plain DDP: every rank holds every averaged grad, so the norm needs no collective.
            total = self._sum_of_squares([(local(p.grad), 1.0) for p in self.pm.parameters()
                                          if p.grad is not None])
        else:
            total = self._sum_of_squares([(g, _replication_weight(p))
                                          for p, g in self._owned_grads()])
            dist.all_reduce(total)
        norm = total.sqrt().item()
        clip = self.spec.train.grad_clip
        if clip > 0:
            coef = min(1.0, clip / (norm + 1e-6))
            if coef < 1.0:
                for g in self._grads_to_scale():
                    g.mul_(coef)
        return norm

    def _sum_of_squares(self, pieces: list[tuple[torch.Tensor, float]]) -> torch.Tensor:
        """sum(weight * ||g||^2) in float64; each norm is one fp32 kernel over the grad (a
        float64 copy of every grad cost more than the rest of the clipping)."""
        if not pieces:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        norms = torch.stack([torch.linalg.vector_norm(g) for g, _ in pieces]).double()
        weights = torch.tensor([w for _, w in pieces], dtype=torch.float64, device=norms.device)
        return (norms.pow(2) * weights).sum()

    def zero_grad(self) -> None:
        for dp in self.pm.dps:
            dp.zero_grad()
        self.optimizer.zero_grad(set_to_none=True)

    def run_step(self) -> StepResult:
        """zero_grad + train_step: what a loop calls."""
        self.zero_grad()
        return self.train_step()

    # ---- inspection (tests, checkpoints) ---------------------------------------------------
    @torch.no_grad()
    def full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter as a full CPU tensor keyed by its canonical name (collective)."""
        from tenax.parallel import canonical_param_name

        out = {}
        for name, p in self.pm.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            out[canonical_param_name(name)] = full.detach().float().cpu().clone()
        return self._gather_over_pp(out)

    def _gather_over_pp(self, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.layout.pp == 1:
            return mine
        everyone: list[Any] = [None] * self.layout.pp
        dist.all_gather_object(everyone, mine, group=self.mesh["pp"].get_group())
        return {k: v for part in everyone for k, v in part.items()}


def _replication_weight(p: torch.Tensor) -> float:
    if not isinstance(p, DTensor):
        return 1.0
    weight = 1.0
    for dim, placement in enumerate(p.placements):
        if isinstance(placement, Replicate):
            weight /= p.device_mesh.size(dim)
    return weight
