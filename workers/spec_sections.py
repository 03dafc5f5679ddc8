"""The sections of the job spec: one pydantic model per top-level key (`model`, `parallel`,
`train`, `data`, `logging`, `checkpoint`, `resources`, `fault_tolerance`).

Every key is pinned by DESIGN.md. `JobSpec` (workers/spec.py) assembles them and runs the checks
between sections; each section checks only itself here. Every section forbids unknown keys,
NaN/inf and integers that do not fit the wire (`StrictSection`).
"""
from __future__ import annotations

import logging
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, field_validator, model_validator

from tenax.parallel import ModelArgs

logger = logging.getLogger(__name__)

# Why limits: a spec arrives over the wire and every number in it ends up in int32/int64 proto
# fields and sqlite columns; one that does not fit made SubmitJob INTERNAL and broke ListJobs.
INT32_MAX = 2**31 - 1
INT64_FIELDS = frozenset({"seed"})  # carried as int64 (manifest, data order)
ECHO_CHARS = 80  # never echo more of a bad value than this (a huge value is the attack)


def short(value: Any, limit: int = ECHO_CHARS) -> str:
    """`repr(value)` cut to `limit` characters, saying how long it was."""
    text = repr(value) if not isinstance(value, str) or len(value) <= limit else value
    if len(text) <= limit:
        return text
    return f"{text[:limit]!r}... ({len(text)} chars)"


def _degree(value: Any) -> int | str:
    """A parallel degree: a positive integer, or "auto" for the planner to choose."""
    if value == "auto":
        return "auto"
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError("must be a positive integer or 'auto'")
    return value


Degree = Annotated[Union[int, str], PlainValidator(_degree)]


class StrictSection(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _fits_the_wire(cls, value: Any, info: Any) -> Any:
        limit = 2**63 - 1 if info.field_name in INT64_FIELDS else INT32_MAX
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > limit:
            raise ValueError(f"must be at most {limit} (it is carried as a "
                             f"{'64' if limit > INT32_MAX else '32'}-bit integer)")
        return value


class MoESpec(StrictSection):
    num_experts: int = Field(8, ge=1)
    top_k: int = Field(2, ge=1)
    capacity_factor: float = Field(1.25, gt=0)
    aux_loss_coef: float = Field(0.01, ge=0)

    @model_validator(mode="after")
    def _top_k_fits(self) -> "MoESpec":
        if self.top_k > self.num_experts:
            raise ValueError(f"moe.top_k: {self.top_k} exceeds moe.num_experts={self.num_experts}")
        return self


class RopeScalingSpec(StrictSection):
    """Llama 3.1's rotary scaling (HF `rope_type: llama3`)."""
    factor: float = Field(8.0, gt=0)
    low_freq_factor: float = Field(1.0, gt=0)
    high_freq_factor: float = Field(4.0, gt=0)
    original_max_position_embeddings: int = Field(8192, ge=1)

    @model_validator(mode="after")
    def _band(self) -> "RopeScalingSpec":
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"model.rope_scaling.high_freq_factor: {self.high_freq_factor} must "
                             f"exceed low_freq_factor={self.low_freq_factor}")
        return self


# Keys that say where weights come from, not what the model is: not part of the engine's
# config nor of the checkpoint's model hash.
SOURCE_KEYS = frozenset({"init_from", "from_hf"})
# Keys added after checkpoints existed: left out of the model hash while at their default, so
# those checkpoints still load.
HASH_OPTIONAL = {"rope_theta": 10000.0, "rope_scaling": None, "norm_eps": 1e-5,
                 "tie_embeddings": False}


class ModelSpec(StrictSection):
    dim: int = Field(256, ge=1)
    n_layers: int = Field(4, ge=1)
    n_heads: int = Field(8, ge=1)
    n_kv_heads: int = Field(4, ge=1)
    vocab_size: int = Field(512, ge=2)  # `auto`: from data.tokenizer (JobSpec resolves it)
    seq_len: int = Field(128, ge=1)
    ffn_hidden: int = Field(688, ge=1)
    moe: MoESpec | None = None
    rope_theta: float = Field(10000.0, gt=0)
    rope_scaling: RopeScalingSpec | None = None
    norm_eps: float = Field(1e-5, gt=0)
    tie_embeddings: bool = False
    init_from: str | None = Field(None, min_length=1, max_length=4096)  # an HF directory URI
    from_hf: bool = False  # take the shape keys from init_from's config.json

    @model_validator(mode="before")
    @classmethod
    def _agrees_with_hf(cls, data: Any) -> Any:
        """With `init_from`, the model keys must match its config.json (from_hf fills them)."""
        from tenax.workers.hf.config import check_model_section

        return check_model_section(data, cls.model_fields)

    @model_validator(mode="after")
    def _heads_fit(self) -> "ModelSpec":
        if self.dim % self.n_heads:
            raise ValueError(f"model.n_heads: {self.n_heads} does not divide model.dim={self.dim}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_kv_heads: {self.n_kv_heads} does not divide model.n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(f"model.dim: head dim {self.head_dim} must be even for rotary "
                             f"embeddings")
        return self

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def args(self) -> ModelArgs:
        """The engine's plain config for this model (parallel/ never sees the spec)."""
        return ModelArgs.from_dict(self.model_dump(exclude=set(SOURCE_KEYS)))

    def hash_dump(self) -> dict[str, Any]:
        """What the checkpoint's model hash covers: the shape, not where weights came from."""
        dump = self.model_dump(mode="json", exclude=set(SOURCE_KEYS))
        return {k: v for k, v in dump.items()
                if not (k in HASH_OPTIONAL and v == HASH_OPTIONAL[k])}

    def layer_params(self, active: bool = False) -> int:
        return self.args().layer_params(active)

    def num_params(self, active: bool = False) -> int:
        """Total parameters (untied embedding and head); `active` counts top_k experts only."""
        return self.args().num_params(active)

    def expert_params(self) -> int:
        """Parameters that live in experts (sharded by ep); 0 for a dense model."""
        return self.args().expert_params()


class ParallelSpec(StrictSection):
    dp: Degree = "auto"
    tp: Degree = 1
    pp: Degree = 1
    cp: Degree = 1
    ep: Degree = 1
    zero: Literal[0, 1, 2, 3] = 1
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"] = "1f1b"
    pp_virtual_stages: int = Field(1, ge=1)
    micro_batch_size: int = Field(2, ge=1)
    # Activation recompute (parallel/recompute.py); auto: the planner's choice for the layout.
    recompute: Literal["auto", "none", "selective", "full"] = "auto"


class TrainSpec(StrictSection):
    steps: int = Field(200, ge=1, le=99_999_999)  # checkpoint dirs are step-NNNNNNNN
    global_batch_size: int = Field(32, ge=1)
    lr: float = Field(3.0e-4, gt=0)
    warmup_steps: int = Field(20, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    grad_clip: float = Field(1.0, ge=0)
    seed: int = Field(0, ge=0)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # [FIRST, LAST]: every rank keeps a torch.profiler trace of these steps (workers/profiling.py)
    profile_steps: list[int] | None = Field(None, min_length=2, max_length=2)
    # torch.compile each transformer block (parallel/compile.py): fuses the norms, rotary and
    # SwiGLU into a few kernels; the first steps of every (re)start pay the compile time.
    compile: bool = False

    @model_validator(mode="after")
    def _profile_window(self) -> "TrainSpec":
        window = self.profile_steps
        if window is not None and not 1 <= window[0] <= window[1]:
            raise ValueError(f"train.profile_steps: {window} must be [FIRST, LAST] with "
                             "1 <= FIRST <= LAST")
        return self


class BlendSourceSpec(StrictSection):
    """One source of a blend: its URI and its share of the samples (weights are normalised)."""
    uri: str = Field(min_length=1, max_length=4096)
    weight: float = Field(gt=0)


class ValidationSpec(StrictSection):
    """Held-out loss every `every_steps` over `steps` global batches, windows in file order."""
    uri: str = Field(min_length=1, max_length=4096)
    every_steps: int = Field(100, ge=1)
    steps: int = Field(10, ge=1)
    at_start: bool = False


class DataSpec(StrictSection):
    source: str = "synthetic"
    token_dtype: Literal["uint8", "uint16", "uint32", "int32", "int64"] = "uint16"
    sources: list[BlendSourceSpec] | None = Field(None, min_length=1, max_length=256)
    tokenizer: str | None = Field(None, min_length=1, max_length=4096)  # URI of the tokenizer file
    eos_id: int | None = Field(None, ge=0)  # default: the tokenizer's, else 256 (byte-level)
    document_mask: bool = False  # attention and rotary positions restart at each document
    mask_eos_loss: bool = False  # no loss for the token after an EOS
    validation: ValidationSpec | None = None

    @model_validator(mode="after")
    def _one_source_field(self) -> "DataSpec":
        # "synthetic" is also the default, so only a real data.source conflicts with a blend.
        if self.sources is not None and self.source != "synthetic":
            raise ValueError(f"data.sources: give data.source ({short(self.source)}) or "
                             f"data.sources (a blend), not both")
        return self

    def uris(self) -> list[tuple[str, str]]:
        """(field, URI) of every file this section reads, for storage-root checks."""
        out = [] if self.source == "synthetic" or self.sources else [("data.source", self.source)]
        out += [(f"data.sources[{i}].uri", e.uri) for i, e in enumerate(self.sources or [])
                if e.uri != "synthetic"]
        if self.tokenizer:
            out.append(("data.tokenizer", self.tokenizer))
        if self.validation is not None:
            out.append(("data.validation.uri", self.validation.uri))
        return out


class WandbSpec(StrictSection):
    """Weights & Biases: rank 0 logs the step scalars to one run per job (id from the job id)."""
    project: str = Field("tenax", min_length=1, max_length=128)
    entity: str | None = Field(None, max_length=128)
    name: str | None = Field(None, max_length=128)  # default: the job's name
    mode: Literal["online", "offline", "disabled"] = "online"


class LoggingSpec(StrictSection):
    """Experiment tracking from rank 0's process, off the training thread (workers/tracking)."""
    tensorboard_dir: str | None = Field(None, min_length=1, max_length=4096)  # URI (fsspec)
    wandb: WandbSpec | None = None

    @field_validator("tensorboard_dir")
    @classmethod
    def _shared_store(cls, value: str | None) -> str | None:
        """memory:// lives in one process: rank 0's and the controller's files would vanish."""
        if value is not None and value.startswith("memory://"):
            raise ValueError(f"logging.tensorboard_dir: {value!r} is in one process's memory, "
                             f"which the job's processes do not share; use a directory or an "
                             f"object store URI")
        return value


class CheckpointSpec(StrictSection):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)
    uri: str = "file:///var/lib/tenax/ckpt/tiny-llama"
    every_steps: int = Field(20, ge=1)
    keep_last: int = Field(3, ge=1)
    keep_every: int = Field(0, ge=0)
    async_: bool = Field(True, alias="async")
    # In-memory snapshot (the rank's agent + a peer node's agent) every N steps; 0 = off.
    memory_every_steps: int = Field(1, ge=0)


class ResourcesSpec(StrictSection):
    nodes: int = Field(2, ge=1)
    gpus_per_node: int = Field(2, ge=1)
    min_nodes: int = Field(1, ge=1)
    max_nodes: int = Field(4, ge=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # GiB of memory per GPU the planner plans with (None: the smallest GPU Ray's accelerator
    # type names on the cluster's nodes, else 80).
    gpu_mem_gib: float | None = Field(None, gt=0)
    # Service scheduling: how long a job may wait in QUEUED (None = no limit), and whether it
    # may be stopped at a checkpoint boundary and requeued for a more urgent job.
    queue_timeout_s: float | None = Field(None, gt=0)
    preemptible: bool = False
    # A node the preflight singles out (slow links or slow ranks) is kept from the job, which
    # is re-placed without it and preflighted once more (docs/preflight.md).
    exclude_slow_nodes: bool = False

    @model_validator(mode="after")
    def _node_range(self) -> "ResourcesSpec":
        if self.min_nodes > self.max_nodes:
            raise ValueError(f"resources.min_nodes: {self.min_nodes} exceeds "
                             f"resources.max_nodes={self.max_nodes}")
        if not self.min_nodes <= self.nodes <= self.max_nodes:
            raise ValueError(f"resources.nodes: {self.nodes} is outside "
                             f"[min_nodes={self.min_nodes}, max_nodes={self.max_nodes}]")
        return self

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


class PreflightSpec(StrictSection):
    """Smoke-test the job on its own placement and layout before it trains (docs/preflight.md)."""
    steps: int = Field(50, ge=1)
    required: bool = False  # a failing preflight stops the run (else it is only reported)


class FaultToleranceSpec(StrictSection):
    heartbeat_interval_s: float = Field(1.0, gt=0)
    heartbeat_timeout_s: float = Field(5.0, gt=0)
    hang_timeout_s: float = Field(60.0, gt=0)
    max_restarts: int = Field(10, ge=0)
    # chosen by bench/straggler_bench.py (docs/operations.md); acted on in
    # orchestrator/job/health.py
    straggler_threshold: float = Field(0.9, gt=0, lt=1)
    straggler_action: Literal["ignore", "alert", "evict"] = "alert"

    @model_validator(mode="after")
    def _timeouts(self) -> "FaultToleranceSpec":
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(f"fault_tolerance.heartbeat_timeout_s: {self.heartbeat_timeout_s} "
                             f"must exceed heartbeat_interval_s={self.heartbeat_interval_s}")
        return self
