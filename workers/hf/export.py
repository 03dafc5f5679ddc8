"""A committed checkpoint (any layout) -> a directory `LlamaForCausalLM.from_pretrained` loads
(`MixtralForCausalLM` for a model with `moe`).

How: the version is read through the checkpoint layer's own resharding load path (DCP's load
planner + `RawReader`), asking for whole tensors as a world-size-1 process would. Since every
tensor's global shape is in the version's metadata, each safetensors shard's header is written
first and the tensors are then loaded and streamed into it a batch at a time (at most half a
shard): a reader thread loads and casts batch k+1 while batch k is written, so the export holds
about one shard (plus its largest tensor), never the model. The job spec comes from the
manifest (saved with each version); older checkpoints need `spec` passed in. A stacked expert
tensor is read whole like any other and written as its E per-expert HF tensors (names.hf_parts).
"""
from __future__ import annotations

import json
import logging
import posixpath
from concurrent.futures import ThreadPoolExecutor
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from tenax.checkpoint import Catalog, Storage, version_name
from tenax.checkpoint.load import RawReader
from tenax.workers.hf.config import (CONFIG_NAME, HFConfigError, dropless_note,
                                     hf_config_from_model)
from tenax.workers.hf.names import hf_name, hf_parts, is_stacked_expert, layer_order
from tenax.workers.hf.safetensors_io import INDEX_NAME, StreamingWriter, shard_name

logger = logging.getLogger(__name__)

SHARD_BYTES = 5 * 10**9  # HF's default max_shard_size
BATCH_BYTES = 256 << 20  # tensors loaded per DCP read
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                 "float16": torch.float16}
STALE_SHARD = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
Progress = Callable[[int, int], None]  # (bytes written so far, total bytes)


class ExportError(ValueError):
    """Why a checkpoint cannot be exported (names the checkpoint, the step or the key)."""


class CachedReader(RawReader):
    """RawReader that decodes the version's metadata once for the many small loads."""

    def __init__(self, storage: Storage, version: str, metadata: Metadata) -> None:
        super().__init__(storage, version)
        self.metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata


@dataclass
class ExportResult:
    out: str
    step: int
    files: list[str]
    total_bytes: int
    tensors: int
    extra: dict[str, Any] = field(default_factory=dict)


def _manifest(catalog: Catalog, step: int | None) -> Any:
    if step is None:
        manifest = catalog.latest_committed(verify=False)
        if manifest is None:
            raise ExportError(f"no committed checkpoint under {catalog.storage.uri}")
        return manifest
    if step not in catalog.committed_steps():
        raise ExportError(f"--step {step}: not a committed version under {catalog.storage.uri} "
                          f"(committed: {catalog.committed_steps()})")
    return catalog.manifest(step)


def job_spec_of(manifest: Any, spec: dict[str, Any] | None, uri: str) -> dict[str, Any]:
    """The job spec saved with the version, else the one given; a plain mapping."""
    saved = manifest.extra.get("spec")
    if saved is None and spec is None:
        raise ExportError(f"checkpoint {uri} step {manifest.step} carries no job spec (saved "
                          f"by an older Tenax): pass --spec JOB.yaml")
    return dict(spec if spec is not None else saved)


def model_section(job: dict[str, Any]) -> dict[str, Any]:
    """The validated `model` section, without the weight-source keys (already used)."""
    from tenax.workers.spec import SOURCE_KEYS, ModelSpec

    raw = {k: v for k, v in dict(job.get("model") or {}).items() if k not in SOURCE_KEYS}
    try:
        return ModelSpec.model_validate(raw).model_dump(mode="json")
    except ValueError as exc:
        raise ExportError(f"the job spec's model section is invalid: {exc}") from None


def expected_names(model: dict[str, Any]) -> list[str]:
    """Canonical parameter names of the model, in HF file order (tied head counted once)."""
    from tenax.parallel import Transformer
    from tenax.workers.spec import ModelSpec

    with torch.device("meta"):
        built = Transformer(ModelSpec.model_validate(model).args())
    return sorted((n for n, _ in built.named_parameters()), key=layer_order)


def plan_shards(names: list[str], metadata: Metadata, dtype: torch.dtype,
                shard_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Greedy split in file order: a shard closes before the tensor that would overflow it."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    used = 0
    for name in names:
        shape = tuple(metadata.state_dict_metadata[f"model.{name}"].size)
        size = torch.Size(shape).numel() * dtype.itemsize
        if shards[-1] and used + size > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append((name, shape))
        used += size
    return shards


def _check_names(names: list[str], metadata: Metadata, where: str) -> None:
    stored = metadata.state_dict_metadata
    missing = [n for n in names if not isinstance(stored.get(f"model.{n}"),
                                                  TensorStorageMetadata)]
    if missing:
        raise ExportError(f"{where}: the checkpoint lacks {missing[:5]} (of {len(missing)}) that "
                          f"the job's model section needs")


def _batches(shard: list[tuple[str, tuple[int, ...]]], itemsize: int,
             batch_bytes: int) -> Iterator[list[tuple[str, tuple[int, ...]]]]:
    batch: list[tuple[str, tuple[int, ...]]] = []
    used = 0
    for name, shape in shard:
        size = torch.Size(shape).numel() * itemsize
        if batch and used + size > batch_bytes:
            yield batch
            batch, used = [], 0
        batch.append((name, shape))
        used += size
    if batch:
        yield batch


def _carve(slot: torch.Tensor | None, specs: list[tuple[tuple[int, ...], torch.dtype]]
           ) -> list[torch.Tensor]:
    """Destination tensors as views of the reused byte buffer `slot` (64-byte aligned), or
    fresh ones when it is too small: a fresh tensor's pages fault in on first write, which
    costs more than the read itself, so the buffers are reused batch after batch."""
    sizes = [_aligned(torch.Size(shape).numel() * dtype.itemsize) for shape, dtype in specs]
    if slot is None or sum(sizes) > slot.numel():
        return [torch.empty(shape, dtype=dtype) for shape, dtype in specs]
    out, offset = [], 0
    for (shape, dtype), size in zip(specs, sizes):
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        out.append(slot[offset:offset + nbytes].view(dtype).view(shape))
        offset += size
    return out


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 64) * 64


def _load_batch(reader_of: Callable[[], CachedReader], metadata: Metadata,
                batch: list[tuple[str, tuple[int, ...]]],
                slot: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Whole tensors through DCP's planner (the resharding path), in their stored dtype."""
    dtypes = [metadata.state_dict_metadata[f"model.{n}"].properties.dtype for n, _ in batch]
    views = _carve(slot, [(shape, dtype) for (_, shape), dtype in zip(batch, dtypes)])
    state = {f"model.{name}": view for (name, _), view in zip(batch, views)}
    with warnings.catch_warnings():  # DCP warns on each load without a process group
        warnings.filterwarnings("ignore", message="torch.distributed is .*unavailable")
        dcp.load(state, storage_reader=reader_of(), planner=DefaultLoadPlanner(), no_dist=True)
    return {k.removeprefix("model."): v for k, v in state.items()}


def copy_tokenizer(job: dict[str, Any], fs: Any, root: str) -> dict[str, int | None]:
    """Copy the job's tokenizer files next to the weights; its special ids for config.json."""
    data = job.get("data") or {}
    uri = data.get("tokenizer")
    if not uri:
        return {}
    from tenax.workers.data.tokenizer import load_tokenizer, read_bytes

    tokenizer = load_tokenizer(uri, data.get("eos_id"))
    for i, source in enumerate(tokenizer.files()):
        # transformers looks for `tokenizer.json` by name; others keep their own name
        name = "tokenizer.json" if i == 0 and getattr(tokenizer, "kind", "") == "hf" \
            else posixpath.basename(source.rstrip("/"))
        with fs.open(posixpath.join(root, name), "wb") as handle:
            handle.write(read_bytes(source))
    return {"eos_token_id": tokenizer.eos_id, "bos_token_id": getattr(tokenizer, "bos_id", None)}


def _write_json(fs: Any, path: str, doc: dict[str, Any]) -> None:
    with fs.open(path, "w") as handle:
        handle.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")


Loader = Callable[[list[Any], "torch.Tensor | None"], dict[str, torch.Tensor]]
SCRATCH_ELEMENTS = 4 << 20  # cast this many elements at a time into a reused buffer


@dataclass
class Stream:
    """What writing the shards shares: the loader, the export dtype, two reused read buffers
    (batch k is written from one while batch k+1 is read into the other) and a cast buffer."""
    load: Loader
    target: torch.dtype
    slots: list[torch.Tensor]
    scratch: torch.Tensor
    tick: Callable[[int], None]


class Prefetcher:
    """Batches in file order across all shards; batch k+1 is read by a thread (preadv
    releases the GIL) into the other reused buffer while batch k is cast and written."""

    def __init__(self, stream: Stream, batches: list[list[tuple[str, tuple[int, ...]]]],
                 pool: Any) -> None:
        self.stream, self.batches, self.pool, self.next = stream, batches, pool, 0
        self.pending = pool.submit(stream.load, batches[0], stream.slots[0])

    def take(self) -> tuple[list[tuple[str, tuple[int, ...]]], dict[str, torch.Tensor]]:
        k, tensors = self.next, self.pending.result()
        self.next += 1
        if self.next < len(self.batches):  # batch k-1's buffer is free: it was written
            self.pending = self.pool.submit(self.stream.load, self.batches[self.next],
                                            self.stream.slots[self.next % 2])
        return self.batches[k], tensors


def _pieces(name: str, source: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of each HF tensor `source` becomes: itself, or one expert's slice
    transposed to HF's Linear [out, in] (a view; the writer copies one expert at a time)."""
    if not is_stacked_expert(name):
        yield hf_name(name), source
        return
    for e, (key, _) in enumerate(hf_parts(name, tuple(source.shape))):
        yield key, source[e].t()


def _write_shard(fs: Any, path: str, shard: list[tuple[str, tuple[int, ...]]],
                 n_batches: int, batches: Prefetcher) -> None:
    stream = batches.stream
    with fs.open(path, "wb") as handle:
        writer = StreamingWriter(handle, [(key, stream.target, shape) for n, s in shard
                                          for key, shape in hf_parts(n, s)])
        for _ in range(n_batches):
            batch, tensors = batches.take()
            for name, _ in batch:
                source = tensors.pop(name)
                for key, piece in _pieces(name, source):
                    writer.write_cast(key, piece, stream.scratch)
                stream.tick(source.numel() * stream.target.itemsize)
        writer.close()


def _write_shards(fs: Any, root: str, shards: list[list[tuple[str, tuple[int, ...]]]],
                  stream_of: Callable[[int], Stream], batch_bytes: int,
                  total: int) -> list[str]:
    """Every shard file, then the index when there is more than one; the file names."""
    plans = [list(_batches(shard, 4, batch_bytes)) for shard in shards]
    largest = max(sum(_aligned(torch.Size(s).numel() * 4) for _, s in batch)
                  for plan in plans for batch in plan)
    files, weight_map = [], {}
    with ThreadPoolExecutor(1, "hf-export-read") as pool:
        batches = Prefetcher(stream_of(largest), [b for plan in plans for b in plan], pool)
        for i, (shard, plan) in enumerate(zip(shards, plans)):
            name = shard_name(i, len(shards))
            _write_shard(fs, posixpath.join(root, name), shard, len(plan), batches)
            files.append(name)
            weight_map.update({key: name for n, s in shard for key, _ in hf_parts(n, s)})
    index = posixpath.join(root, INDEX_NAME)
    if len(shards) > 1:
        _write_json(fs, index, {"metadata": {"total_size": total}, "weight_map": weight_map})
    elif fs.exists(index):  # left by an earlier, sharded export into the same directory
        fs.rm(index)
    for path in fs.glob(posixpath.join(root, "model*.safetensors")):
        if posixpath.basename(path) not in files and STALE_SHARD.match(posixpath.basename(path)):
            fs.rm(path)  # an earlier export's shards would shadow or confuse this one
    return files


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
    manifest = _manifest(catalog, step)
    job = job_spec_of(manifest, spec, ckpt_uri)
    model = model_section(job)
    version = version_name(manifest.step)
    metadata = RawReader(catalog.storage, version).read_metadata()
    names = expected_names(model)
    _check_names(names, metadata, catalog.storage.url(version))
    return Source(catalog, manifest, job, model, version, metadata, names)


def export_hf(ckpt_uri: str, out: str, step: int | None = None, dtype: str = "bfloat16", *,
              shard_bytes: int = SHARD_BYTES, spec: dict[str, Any] | None = None,
              storage_options: dict[str, Any] | None = None, progress: Progress | None = None,
              batch_bytes: int = BATCH_BYTES) -> ExportResult:
    """Write version `step` (default: newest committed) of `ckpt_uri` as an HF Llama (or, with
    `model.moe`, Mixtral) directory."""
    from fsspec.core import url_to_fs

    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"--dtype: {dtype!r} must be one of {sorted(EXPORT_DTYPES)}")
    src = open_version(ckpt_uri, step, spec, storage_options)
    catalog, manifest, job, model = src.catalog, src.manifest, src.job, src.model
    version, metadata, names = src.version, src.metadata, src.names
    extra = _note_dropless(model)
    target = EXPORT_DTYPES[dtype]
    shards = plan_shards(names, metadata, target, shard_bytes)
    total = sum(torch.Size(s).numel() for shard in shards for _, s in shard) * target.itemsize
    fs, root = url_to_fs(out)
    fs.makedirs(root, exist_ok=True)
    done = [0]

    def tick(n: int) -> None:
        done[0] += n
        if progress is not None:
            progress(done[0], total)

    def load(batch: list[Any], slot: torch.Tensor | None) -> dict[str, torch.Tensor]:
        return _load_batch(lambda: CachedReader(catalog.storage, version, metadata), metadata,
                           batch, slot)

    def stream_of(slot_bytes: int) -> Stream:
        return Stream(load, target, [torch.empty(slot_bytes, dtype=torch.uint8)
                                     for _ in range(2)],
                      torch.empty(SCRATCH_ELEMENTS, dtype=target), tick)

    # a batch (stored bytes) at most half a shard: with one batch being written and the next
    # being read and cast, the export holds about one shard's worth (plus its largest tensor)
    files = _write_shards(fs, root, shards, stream_of, min(batch_bytes, shard_bytes // 2),
                          total)
    try:
        config = hf_config_from_model(model, dtype, copy_tokenizer(job, fs, root))
    except HFConfigError as exc:
        raise ExportError(str(exc)) from None
    _write_json(fs, posixpath.join(root, CONFIG_NAME), config)
    tensors = sum(len(hf_parts(n, s)) for shard in shards for n, s in shard)
    logger.info("exported %s step %d -> %s: %d tensors, %d files, %.1f MB", ckpt_uri,
                manifest.step, out, tensors, len(files), total / 1e6)
    return ExportResult(out, manifest.step, files, total, tensors, extra)


def _note_dropless(model: dict[str, Any]) -> dict[str, Any]:
    """Say, for an MoE model, when HF's dropless Mixtral may compute what Tenax did not: a
    warning where Tenax's capacity can drop assignments, else an info line. Also returned in
    ExportResult.extra (`dropless_note`, `drops_possible`)."""
    if model.get("moe") is None:
        return {}
    drops, note = dropless_note(model["moe"])
    logger.log(logging.WARNING if drops else logging.INFO, "MoE export as Mixtral: %s", note)
    return {"dropless_note": note, "drops_possible": drops}
