"""The committed version `tenax export hf` reads, and the model it is read as.

The model comes from the checkpoint itself: the job spec saved in the version's manifest
(`extra.spec`). A `--spec` may add what the checkpoint lacks (the tokenizer, or the whole spec
for a checkpoint saved before the spec travelled with it) but never changes the model: its
model section must equal the saved one (or, with no saved spec, hash to the manifest's
`model_hash`), else the export is refused naming the first key that differs. Every tensor the
model needs must then be in the version with the shape the model gives it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from tenax.checkpoint import Catalog, Storage, spec_hash, version_name
from tenax.checkpoint.load import RawReader
from tenax.workers.hf.errors import ExportError
from tenax.workers.hf.names import layer_order

logger = logging.getLogger(__name__)


def find_manifest(catalog: Catalog, step: int | None) -> Any:
    """The manifest of version `step`, or of the newest committed one."""
    if step is None:
        manifest = catalog.latest_committed(verify=False)
        if manifest is None:
            raise ExportError(f"no committed checkpoint under {catalog.storage.uri}")
        return manifest
    if step not in catalog.committed_steps():
        raise ExportError(f"--step {step}: not a committed version under {catalog.storage.uri} "
                          f"(committed: {catalog.committed_steps()})")
    return catalog.manifest(step)


def model_section(job: dict[str, Any]) -> dict[str, Any]:
    """The validated `model` section, without the weight-source keys (already used)."""
    from tenax.workers.spec import SOURCE_KEYS, ModelSpec

    raw = {k: v for k, v in dict(job.get("model") or {}).items() if k not in SOURCE_KEYS}
    try:
        return ModelSpec.model_validate(raw).model_dump(mode="json")
    except ValueError as exc:
        raise ExportError(f"the job spec's model section is invalid: {exc}") from None


def first_difference(given: Any, saved: Any, path: str) -> tuple[str, Any, Any] | None:
    """(dotted key, given value, saved value) of the first key where the two differ."""
    if isinstance(given, dict) and isinstance(saved, dict):
        for key in list(saved) + [k for k in given if k not in saved]:
            found = first_difference(given.get(key), saved.get(key), f"{path}.{key}")
            if found is not None:
                return found
        return None
    return None if given == saved else (path, given, saved)


def model_hash(model: dict[str, Any]) -> str:
    """What a job with this model section writes into each manifest (checkpoint_config)."""
    from tenax.workers.spec import ModelSpec

    return spec_hash(ModelSpec.model_validate(model).hash_dump())


def job_spec_of(manifest: Any, spec: dict[str, Any] | None, uri: str) -> dict[str, Any]:
    """The job spec to export with: the saved one, or `spec` where its model section is the
    checkpoint's (its other sections, e.g. `data.tokenizer`, are then used as given)."""
    saved = manifest.extra.get("spec")
    if spec is None:
        if saved is None:
            raise ExportError(f"checkpoint {uri} step {manifest.step} carries no job spec "
                              f"(saved by an older Tenax): pass --spec JOB.yaml")
        return dict(saved)
    given = model_section(spec)
    if saved is not None:
        found = first_difference(given, model_section(saved), "model")
        if found is not None:
            key, mine, theirs = found
            raise ExportError(f"--spec: {key} is {mine!r}, the checkpoint's is {theirs!r} "
                              f"({uri} step {manifest.step}); the checkpoint's own spec is used "
                              f"when --spec is left out")
    elif model_hash(given) != manifest.model_hash:
        raise ExportError(f"--spec: its model section hashes to {model_hash(given)[:16]}..., "
                          f"the checkpoint {uri} step {manifest.step} was saved by a model "
                          f"hashing to {manifest.model_hash[:16]}...: not the model that "
                          f"wrote it (check every model key, e.g. dim, n_layers, rope_theta)")
    return dict(spec)


def expected_shapes(model: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Canonical parameter name -> shape, in HF file order (tied head counted once)."""
    from tenax.workers.hf.load import model_names
    from tenax.workers.spec import ModelSpec

    shapes = model_names(ModelSpec.model_validate(model).args())
    return {n: shapes[n] for n in sorted(shapes, key=layer_order)}


def check_stored(shapes: dict[str, tuple[int, ...]], metadata: Metadata, where: str) -> None:
    """Every tensor the model needs is in the version, with the shape the model gives it."""
    stored = metadata.state_dict_metadata
    missing = [n for n in shapes if not isinstance(stored.get(f"model.{n}"),
                                                   TensorStorageMetadata)]
    if missing:
        raise ExportError(f"{where}: the checkpoint lacks {missing[:5]} (of {len(missing)}) that "
                          f"the job's model section needs")
    wrong = [(n, list(stored[f"model.{n}"].size), list(s)) for n, s in shapes.items()
             if tuple(stored[f"model.{n}"].size) != s]
    if wrong:
        name, have, want = wrong[0]
        raise ExportError(f"{where}: the checkpoint's {name} is {have}, the job's model section "
                          f"needs {want} ({len(wrong)} tensor(s) differ)")


@dataclass
class Source:
    """A committed version opened for export: its manifest, job spec, model and metadata."""
    catalog: Catalog
    manifest: Any
    job: dict[str, Any]
    model: dict[str, Any]
    version: str
    metadata: Metadata
    names: list[str]  # canonical parameter names in HF file order


def open_version(ckpt_uri: str, step: int | None, spec: dict[str, Any] | None,
                 storage_options: dict[str, Any] | None) -> Source:
    """The version to export, checked: a model whose every tensor the version holds."""
    catalog = Catalog(Storage(ckpt_uri, storage_options=storage_options))
    manifest = find_manifest(catalog, step)
    job = job_spec_of(manifest, spec, ckpt_uri)
    model = model_section(job)
    version = version_name(manifest.step)
    metadata = RawReader(catalog.storage, version).read_metadata()
    shapes = expected_shapes(model)
    check_stored(shapes, metadata, catalog.storage.url(version))
    return Source(catalog, manifest, job, model, version, metadata, list(shapes))
