"""The user-facing job spec: one pydantic model, loaded from YAML or JSON.

Every key here is pinned by DESIGN.md; users, the CLI and the gRPC service all go through
`load_spec`/`JobSpec.model_validate`, so a bad spec fails the same way everywhere: a
`SpecError` whose lines each name the field path and the offending value.

The sections (`ModelSpec`, `DataSpec`, ...) live in workers/spec_sections.py and are re-exported
here. It lives in workers/ (not orchestrator/) because the rank launcher,
`python -m tenax.workers.launch JOB.yaml`, must parse it and imports point one way
(orchestrator -> workers -> parallel); `tenax.orchestrator.spec` re-exports it. The engine
never sees these models: `ModelSpec.args()` and `layout_from_spec` hand `parallel/` its own
plain config.
"""
from __future__ import annotations

import json
import logging
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from tenax.parallel import ParallelLayout, degree_problems, layout_for, tie_problems
from tenax.workers.errors import SpecError
from tenax.workers.spec_sections import (ECHO_CHARS, HASH_OPTIONAL, INT32_MAX, INT64_FIELDS,
                                         SOURCE_KEYS, BlendSourceSpec, CheckpointSpec, DataSpec,
                                         Degree, FaultToleranceSpec, LoggingSpec, ModelSpec,
                                         MoESpec, ParallelSpec, PreflightSpec, ResourcesSpec,
                                         RopeScalingSpec, StrictSection, TrainSpec,
                                         ValidationSpec, WandbSpec, short)

logger = logging.getLogger(__name__)

# The sections are re-exported: callers import every spec name from here.
__all__ = ["ECHO_CHARS", "HASH_OPTIONAL", "INT32_MAX", "INT64_FIELDS", "MAX_OVERRIDE_CHARS",
           "MAX_SPEC_BYTES", "SOURCE_KEYS", "BlendSourceSpec", "CheckpointSpec", "DataSpec",
           "Degree", "FaultToleranceSpec", "JobSpec", "LoggingSpec", "ModelSpec", "MoESpec",
           "ParallelSpec", "PreflightSpec", "ResourcesSpec", "RopeScalingSpec", "TrainSpec",
           "ValidationSpec", "WandbSpec", "apply_overrides", "cross_field_problems",
           "data_problems", "format_validation_error", "layout_from_spec", "load_spec",
           "load_yaml_text", "parse_spec_text", "resolve_vocab_size", "short", "spec_from_dict",
           "tokenizer_vocab_size"]

MAX_SPEC_BYTES = 1 << 20  # a job spec is a few hundred bytes; anything near this is an attack
MAX_OVERRIDE_CHARS = 4096


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

class JobSpec(StrictSection):
    # at most 63 (a DNS label): job ids, snapshot dirs and metric labels are built from it
    name: str = Field("tiny-llama", min_length=1, max_length=63,
                      pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    priority: int = Field(0, ge=-1000, le=1000)  # service scheduling: higher first, then FIFO
    model: ModelSpec = Field(default_factory=ModelSpec)
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    logging: LoggingSpec = Field(default_factory=LoggingSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    fault_tolerance: FaultToleranceSpec = Field(default_factory=FaultToleranceSpec)
    preflight: PreflightSpec | None = None  # smoke test before training (docs/preflight.md)

    @model_validator(mode="before")
    @classmethod
    def _auto_vocab(cls, raw: Any) -> Any:
        from tenax.workers.hf.resume import without_lost_source

        return resolve_vocab_size(without_lost_source(raw))

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
    pp = spec.parallel.pp if isinstance(spec.parallel.pp, int) else 1
    return degree_problems(spec.model.args(), spec.parallel.model_dump(),
                           spec.train.global_batch_size) + \
        tie_problems(spec.model.args(), pp, spec.parallel.zero) + data_problems(spec)


def data_problems(spec: JobSpec) -> list[str]:
    """data.* against model.* and parallel.*: an EOS outside the vocabulary, a tokenizer larger
    than the embedding, document masks under layouts that cannot carry them."""
    data, vocab, problems = spec.data, spec.model.vocab_size, []
    if data.eos_id is not None and data.eos_id >= vocab:
        problems.append(f"data.eos_id: {data.eos_id} is outside [0, model.vocab_size={vocab})")
    if data.sources:
        from tenax.workers.data.blend import check_weights

        try:
            check_weights([e.weight for e in data.sources])
        except ValueError as err:  # a share too small for the blend's integer arithmetic
            problems.append(str(err))
    if data.tokenizer:
        size = tokenizer_vocab_size(data.tokenizer, data.eos_id)
        if size > vocab:
            problems.append(f"model.vocab_size: {vocab} is smaller than the vocabulary of "
                            f"data.tokenizer ({size} tokens); set model.vocab_size: auto")
    if data.document_mask:
        for degree in ("cp", "pp"):
            value = getattr(spec.parallel, degree)
            if value != 1:
                problems.append(f"data.document_mask: not supported with parallel.{degree}="
                                f"{value} (needs parallel.{degree}=1)")
    return problems


def tokenizer_vocab_size(uri: str, eos_id: int | None = None) -> int:
    """The vocabulary size of the tokenizer at `uri` (read once per process and URI); `eos_id`
    is data.eos_id, which a tokenizer without an EOS of its own needs to load."""
    return _tokenizer_sizes(uri, eos_id)[0]


@lru_cache(maxsize=16)
def _tokenizer_sizes(uri: str, eos_id: int | None) -> tuple[int, int]:
    from tenax.workers.data.tokenizer import auto_vocab_size, load_tokenizer

    try:
        tokenizer = load_tokenizer(uri, eos_id)
    except FileNotFoundError:
        raise ValueError(f"data.tokenizer: {short(uri)} does not exist") from None
    return int(tokenizer.vocab_size), auto_vocab_size(tokenizer)


def resolve_vocab_size(raw: Any) -> Any:
    """`model.vocab_size: auto` -> the data.tokenizer's vocabulary rounded up to 64."""
    model = raw.get("model") if isinstance(raw, dict) else None
    if not isinstance(model, dict) or model.get("vocab_size") != "auto":
        return raw
    data = raw.get("data")
    uri = data.get("tokenizer") if isinstance(data, dict) else None
    if not isinstance(uri, str) or not uri:
        raise ValueError("model.vocab_size: 'auto' needs data.tokenizer (the tokenizer whose "
                         "vocabulary sizes the embedding)")
    eos_id = data.get("eos_id")
    eos_id = eos_id if isinstance(eos_id, int) and not isinstance(eos_id, bool) else None
    return {**raw, "model": {**model, "vocab_size": _tokenizer_sizes(uri, eos_id)[1]}}


def layout_from_spec(spec: JobSpec, world_size: int | None = None) -> ParallelLayout:
    """The layout a spec asks for; fails if any degree is "auto" (ask the planner instead)."""
    return layout_for(spec.parallel.model_dump(), spec.model.args(), spec.train.global_batch_size,
                      world_size)


def format_validation_error(err: ValidationError, max_lines: int = 20) -> str:
    lines, errors = [], err.errors()
    for e in errors[:max_lines]:
        path = ".".join(str(part) for part in e["loc"])[:200]
        msg = e["msg"].removeprefix("Value error, ")
        if path and not msg.startswith((f"{path}.", f"{path}:")):
            lines.append(f"{path}: {msg} (got {short(e.get('input'))})")
        else:  # a section's own check names its field and value already
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
            known = ", ".join(sorted(fields))
            raise SpecError(f"{'.'.join(path[:i + 1])}: unknown key (known: {known})")
        annotation = fields[part].annotation
        nested = [a for a in (get_args(annotation) or (annotation,)) if isinstance(a, type)
                  and issubclass(a, BaseModel)]
        model = nested[0] if nested else None
        if model is None and i < len(path) - 1:
            raise SpecError(f"{'.'.join(path[:i + 2])}: unknown key "
                            f"({'.'.join(path[:i + 1])} is not a section)")
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
