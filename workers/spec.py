"""The user-facing job spec: one pydantic model, loaded from YAML or JSON.

Every key here is pinned by DESIGN.md; users, the CLI and the gRPC service all go through
`load_spec`/`JobSpec.model_validate`, so a bad spec fails the same way everywhere: a
`SpecError` whose lines each name the field path and the offending value.

It lives in workers/ (not orchestrator/) because the rank launcher, `python -m tenax.workers.launch
JOB.yaml`, must parse it and imports point one way (orchestrator -> workers -> parallel);
`tenax.orchestrator.spec` re-exports it. The engine never sees these models: `ModelSpec.args()` and
`layout_from_spec` hand `parallel/` its own plain config.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (BaseModel, ConfigDict, Field, PlainValidator, ValidationError,
                      field_validator, model_validator)

from tenax.parallel import ModelArgs, ParallelLayout, degree_problems, layout_for
from tenax.workers.errors import SpecError

logger = logging.getLogger(__name__)

# Why limits: a spec arrives over the wire and every number in it ends up in int32/int64 proto
# fields and sqlite columns; one that does not fit made SubmitJob INTERNAL and broke ListJobs.
INT32_MAX = 2**31 - 1
INT64_FIELDS = frozenset({"seed"})  # carried as int64 (manifest, data order)
MAX_SPEC_BYTES = 1 << 20  # a job spec is a few hundred bytes; anything near this is an attack
MAX_OVERRIDE_CHARS = 4096
ECHO_CHARS = 80  # never echo more of a bad value than this (a huge value is the attack)


def short(value: Any, limit: int = ECHO_CHARS) -> str:
    """`repr(value)` cut to `limit` characters, saying how long it was."""
    text = repr(value) if not isinstance(value, str) or len(value) <= limit else value
    if len(text) <= limit:
        return text
    return f"{text[:limit]!r}... ({len(text)} chars)"


class _NoAliasLoader(yaml.SafeLoader):
    """safe_load without YAML aliases: `*a` re-uses a node, so a few hundred characters can
    expand to gigabytes once converted (billion laughs); a job spec never needs them."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            raise yaml.YAMLError(f"YAML aliases (*{short(self.peek_event().anchor, 20)}) are "
                                 f"not accepted in a job spec")
        return super().compose_node(parent, index)


def load_yaml_text(text: str, source: str) -> Any:
    """YAML/JSON text, capped in size and without aliases; SpecError naming `source`."""
    if len(text) > MAX_SPEC_BYTES:
        raise SpecError(f"{source}: {len(text)} characters is more than a job spec may have "
                        f"({MAX_SPEC_BYTES})")
    try:
        return yaml.load(text, Loader=_NoAliasLoader) if text.strip() else None
    except yaml.YAMLError as err:
        raise SpecError(f"{source}: not valid YAML/JSON: {short(str(err), 300)}") from None


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


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _fits_the_wire(cls, value: Any, info: Any) -> Any:
        limit = 2**63 - 1 if info.field_name in INT64_FIELDS else INT32_MAX
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > limit:
            raise ValueError(f"must be at most {limit} (it is carried as a "
                             f"{'64' if limit > INT32_MAX else '32'}-bit integer)")
        return value


class MoESpec(_Strict):
    num_experts: int = Field(8, ge=1)
    top_k: int = Field(2, ge=1)
    capacity_factor: float = Field(1.25, gt=0)
    aux_loss_coef: float = Field(0.01, ge=0)

    @model_validator(mode="after")
    def _top_k_fits(self) -> "MoESpec":
        if self.top_k > self.num_experts:
            raise ValueError(f"moe.top_k: {self.top_k} exceeds moe.num_experts={self.num_experts}")
        return self


class ModelSpec(_Strict):
    dim: int = Field(256, ge=1)
    n_layers: int = Field(4, ge=1)
    n_heads: int = Field(8, ge=1)
    n_kv_heads: int = Field(4, ge=1)
    vocab_size: int = Field(512, ge=2)
    seq_len: int = Field(128, ge=1)
    ffn_hidden: int = Field(688, ge=1)
    moe: MoESpec | None = None

    @model_validator(mode="after")
    def _heads_fit(self) -> "ModelSpec":
        if self.dim % self.n_heads:
            raise ValueError(f"model.n_heads: {self.n_heads} does not divide model.dim={self.dim}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_kv_heads: {self.n_kv_heads} does not divide model.n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(f"model.dim: head dim {self.head_dim} must be even for rotary embeddings")
        return self

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def args(self) -> ModelArgs:
        """The engine's plain config for this model (parallel/ never sees the spec)."""
        return ModelArgs.from_dict(self.model_dump())

    def layer_params(self, active: bool = False) -> int:
        return self.args().layer_params(active)

    def num_params(self, active: bool = False) -> int:
        """Total parameters (untied embedding and head); `active` counts top_k experts only."""
        return self.args().num_params(active)

    def expert_params(self) -> int:
        """Parameters that live in experts (sharded by ep); 0 for a dense model."""
        return self.args().expert_params()


class ParallelSpec(_Strict):
    dp: Degree = "auto"
    tp: Degree = 1
    pp: Degree = 1
    cp: Degree = 1
    ep: Degree = 1
    zero: Literal[0, 1, 2, 3] = 1
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"] = "1f1b"
    pp_virtual_stages: int = Field(1, ge=1)
    micro_batch_size: int = Field(2, ge=1)


class TrainSpec(_Strict):
    steps: int = Field(200, ge=1, le=99_999_999)  # checkpoint dirs are step-NNNNNNNN
    global_batch_size: int = Field(32, ge=1)
    lr: float = Field(3.0e-4, gt=0)
    warmup_steps: int = Field(20, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    grad_clip: float = Field(1.0, ge=0)
    seed: int = Field(0, ge=0)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


class DataSpec(_Strict):
    source: str = "synthetic"
    token_dtype: Literal["uint8", "uint16", "uint32", "int32", "int64"] = "uint16"


class CheckpointSpec(_Strict):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)
    uri: str = "file:///var/lib/tenax/ckpt/tiny-llama"
    every_steps: int = Field(20, ge=1)
    keep_last: int = Field(3, ge=1)
    keep_every: int = Field(0, ge=0)
    async_: bool = Field(True, alias="async")
    # In-memory snapshot (the rank's agent + a peer node's agent) every N steps; 0 = off.
    memory_every_steps: int = Field(1, ge=0)


class ResourcesSpec(_Strict):
    nodes: int = Field(2, ge=1)
    gpus_per_node: int = Field(2, ge=1)
    min_nodes: int = Field(1, ge=1)
    max_nodes: int = Field(4, ge=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Service scheduling: how long a job may wait in QUEUED (None = no limit), and whether it
    # may be stopped at a checkpoint boundary and requeued for a more urgent job.
    queue_timeout_s: float | None = Field(None, gt=0)
    preemptible: bool = False

    @model_validator(mode="after")
    def _node_range(self) -> "ResourcesSpec":
        if self.min_nodes > self.max_nodes:
            raise ValueError(f"resources.min_nodes: {self.min_nodes} exceeds resources.max_nodes={self.max_nodes}")
        if not self.min_nodes <= self.nodes <= self.max_nodes:
            raise ValueError(f"resources.nodes: {self.nodes} is outside "
                             f"[min_nodes={self.min_nodes}, max_nodes={self.max_nodes}]")
        return self

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


class FaultToleranceSpec(_Strict):
    heartbeat_interval_s: float = Field(1.0, gt=0)
    heartbeat_timeout_s: float = Field(5.0, gt=0)
    hang_timeout_s: float = Field(60.0, gt=0)
    max_restarts: int = Field(10, ge=0)
    straggler_threshold: float = Field(0.9, gt=0, lt=1)  # bench/straggler_bench.py, docs/operations.md
    straggler_action: Literal["ignore", "alert", "evict"] = "alert"  # see orchestrator/job/health.py

    @model_validator(mode="after")
    def _timeouts(self) -> "FaultToleranceSpec":
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(f"fault_tolerance.heartbeat_timeout_s: {self.heartbeat_timeout_s} must "
                             f"exceed heartbeat_interval_s={self.heartbeat_interval_s}")
        return self


class JobSpec(_Strict):
    name: str = Field("tiny-llama", min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    priority: int = Field(0, ge=-1000, le=1000)  # service scheduling: higher first, then FIFO
    model: ModelSpec = Field(default_factory=ModelSpec)
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    fault_tolerance: FaultToleranceSpec = Field(default_factory=FaultToleranceSpec)

    @model_validator(mode="after")
    def _cross_checks(self) -> "JobSpec":
        for problem in cross_field_problems(self):
            raise ValueError(problem)
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True)


def cross_field_problems(spec: JobSpec) -> list[str]:
    """Checks between sections that hold whatever degrees the planner later picks; the rules
    live in tenax.parallel.layout.degree_problems, which every layout is checked against too."""
    return degree_problems(spec.model.args(), spec.parallel.model_dump(),
                           spec.train.global_batch_size)


def layout_from_spec(spec: JobSpec, world_size: int | None = None) -> ParallelLayout:
    """The layout a spec asks for; fails if any degree is "auto" (ask the planner instead)."""
    return layout_for(spec.parallel.model_dump(), spec.model.args(), spec.train.global_batch_size,
                      world_size)


def format_validation_error(err: ValidationError, max_lines: int = 20) -> str:
    lines, errors = [], err.errors()
    for e in errors[:max_lines]:
        path = ".".join(str(part) for part in e["loc"])[:200]
        msg = e["msg"].removeprefix("Value error, ")
        if path:
            lines.append(f"{path}: {msg} (got {short(e.get('input'))})")
        else:
            lines.append(msg)
    if len(errors) > max_lines:
        lines.append(f"... and {len(errors) - max_lines} more problems")
    return "\n".join(lines)


def spec_from_dict(raw: dict[str, Any]) -> JobSpec:
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as err:
        raise SpecError(format_validation_error(err)) from None


def parse_spec_text(text: str, source: str = "<text>") -> dict[str, Any]:
    """YAML is a superset of JSON, so one parser reads both."""
    raw = load_yaml_text(text, source)
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise SpecError(f"{source}: top level must be a mapping, got {type(raw).__name__}")
    return raw


def _field_annotation(path: list[str]) -> Any:
    """The annotation of a dotted key, for typing `--set` values; SpecError if unknown."""
    model: Any = JobSpec
    annotation: Any = None
    for i, part in enumerate(path):
        fields = {f.alias or name: f for name, f in model.model_fields.items()}
        fields.update(model.model_fields)
        if part not in fields:
            raise SpecError(f"{'.'.join(path[:i + 1])}: unknown key (known: {', '.join(sorted(fields))})")
        annotation = fields[part].annotation
        nested = [a for a in (get_args(annotation) or (annotation,)) if isinstance(a, type)
                  and issubclass(a, BaseModel)]
        model = nested[0] if nested else None
        if model is None and i < len(path) - 1:
            raise SpecError(f"{'.'.join(path[:i + 2])}: unknown key ({'.'.join(path[:i + 1])} is not a section)")
    return annotation


def _is_text(annotation: Any) -> bool:
    if annotation is str:
        return True
    if get_origin(annotation) is Literal:
        return all(isinstance(a, str) for a in get_args(annotation))
    return False


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b=c` overrides; values are typed by the field they land in."""
    out = json.loads(json.dumps(raw))
    for item in overrides:
        key, sep, value = item.partition("=")
        if len(item) > MAX_OVERRIDE_CHARS:
            raise SpecError(f"--set {short(item)}: longer than {MAX_OVERRIDE_CHARS} characters")
        if not sep or not key.strip():
            raise SpecError(f"--set {short(item)}: expected KEY=VALUE, e.g. parallel.tp=2")
        path = key.strip().split(".")
        annotation = _field_annotation(path)
        typed: Any = value if _is_text(annotation) else \
            load_yaml_text(value, f"--set {key.strip()}") if value else value
        node = out
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[path[-1]] = typed
    return out


def load_spec(path: str | Path | None = None, overrides: list[str] | None = None,
              preset: str | None = None) -> JobSpec:
    """Load a spec file (or the embedded default), apply a model preset and `--set` overrides."""
    from tenax.workers.presets import preset_model

    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise SpecError(f"spec file {str(p)!r} does not exist")
        raw = parse_spec_text(p.read_text(), str(p))
    if preset is not None:
        raw["model"] = preset_model(preset)
    return spec_from_dict(apply_overrides(raw, overrides or []))
