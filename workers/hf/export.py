"""A committed checkpoint (any layout) -> a directory `LlamaForCausalLM.from_pretrained` loads
(`MixtralForCausalLM` for a model with `moe`).

How: the version is read through the checkpoint layer's own resharding load path (DCP's load
planner + `RawReader`), asking for whole tensors as a world-size-1 process would. Since every
tensor's global shape is in the version's metadata, each safetensors shard's header is written
first and the tensors are then loaded and streamed into it a batch at a time (at most half a
shard): a reader thread loads and casts batch k+1 while batch k is written, so the export holds
about one shard (plus its largest tensor), never the model. The job spec comes from the
manifest (saved with each version; source.py checks a given `spec` against it, and older
checkpoints need one). A stacked expert tensor is read whole like any other and written as its
E per-expert HF tensors (names.hf_parts).
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
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from tenax.checkpoint import Storage
from tenax.checkpoint.load import RawReader
from tenax.workers.hf.config import (CONFIG_NAME, HFConfigError, dropless_note,
                                     hf_config_from_model, inherited_from_source)
from tenax.workers.hf.names import hf_name, hf_parts, is_stacked_expert
from tenax.workers.hf.out_dir import check_not_source, open_out
from tenax.workers.hf.safetensors_io import INDEX_NAME, StreamingWriter, shard_name
from tenax.workers.hf.source import ExportError, open_version

logger = logging.getLogger(__name__)

SHARD_BYTES = 5 * 10**9  # HF's default max_shard_size
BATCH_BYTES = 256 << 20  # tensors loaded per DCP read
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                 "float16": torch.float16}
STALE_SHARD = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
Progress = Callable[[int, int], None]  # (bytes written so far, total bytes)


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
    reader = reader_of()
    try:
        with warnings.catch_warnings():  # DCP warns on each load without a process group
            warnings.filterwarnings("ignore", message="torch.distributed is .*unavailable")
            dcp.load(state, storage_reader=reader, planner=DefaultLoadPlanner(), no_dist=True)
    except CheckpointException as exc:  # a BaseException: it would escape the CLI's handler
        causes = "; ".join(f"{type(e).__name__}: {e}" for e, _ in exc.failures.values())
        raise ExportError(f"cannot read {reader.storage.url(reader.version)} (damaged, or "
                          f"removed while exporting, e.g. by checkpoint.keep_last): "
                          f"{causes[:500]}") from None
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
    ids = {"eos_token_id": tokenizer.eos_id, "bos_token_id": getattr(tokenizer, "bos_id", None)}
    if getattr(tokenizer, "kind", "") == "hf":
        ids.update(write_tokenizer_config(tokenizer, fs, root, job))
    return ids


def _read_json(fs: Any, path: str) -> dict[str, Any]:
    """A JSON object file, or {} when absent or unreadable (as the tokenizer loader treats a
    tokenizer_config.json it cannot read)."""
    try:
        with fs.open(path, "r") as handle:
            doc = json.loads(handle.read())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.warning("ignoring %s: %s", path, exc)
        return {}
    return doc if isinstance(doc, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or {"content": ...}."""
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


def write_tokenizer_config(tokenizer: Any, fs: Any, root: str,
                           job: dict[str, Any]) -> dict[str, int | None]:
    """tokenizer_config.json naming the EOS the job trained with (tokenizer.json alone leaves
    AutoTokenizer's eos_token None), merged into the one beside the job's tokenizer.json if
    any (which may name the BOS); special_tokens_map.json, when copied, gets the same EOS.
    The BOS id, when known."""
    from fsspec.core import url_to_fs

    vocab = tokenizer.model
    eos = vocab.id_to_token(tokenizer.eos_id)
    source_fs, source = url_to_fs(tokenizer.uri)
    config = _read_json(source_fs, posixpath.join(posixpath.dirname(source),
                                                  "tokenizer_config.json"))
    path = posixpath.join(root, "tokenizer_config.json")
    config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    config["eos_token"] = eos
    seq_len = (job.get("model") or {}).get("seq_len")
    if isinstance(seq_len, int):  # else transformers' "very large" default
        config["model_max_length"] = seq_len
    _write_json(fs, path, {k: v for k, v in config.items() if v is not None})
    special = posixpath.join(root, "special_tokens_map.json")
    if fs.exists(special):
        _write_json(fs, special, {**_read_json(fs, special), "eos_token": eos})
    bos = _token_text(config.get("bos_token"))
    bos_id = vocab.token_to_id(bos) if bos is not None else None
    return {"bos_token_id": int(bos_id)} if bos_id is not None else {}


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
    try:
        with ThreadPoolExecutor(1, "hf-export-read") as pool:
            batches = Prefetcher(stream_of(largest), [b for plan in plans for b in plan], pool)
            for i, (shard, plan) in enumerate(zip(shards, plans)):
                files.append(shard_name(i, len(shards)))
                _write_shard(fs, posixpath.join(root, files[-1]), shard, len(plan), batches)
                weight_map.update({key: files[-1] for n, s in shard for key, _ in hf_parts(n, s)})
    except BaseException:
        _remove_partial(fs, root, files)
        raise
    index = posixpath.join(root, INDEX_NAME)
    if len(shards) > 1:
        _write_json(fs, index, {"metadata": {"total_size": total}, "weight_map": weight_map})
    elif fs.exists(index):  # left by an earlier, sharded export into the same directory
        fs.rm(index)
    for path in fs.glob(posixpath.join(root, "model*.safetensors")):
        if posixpath.basename(path) not in files and STALE_SHARD.match(posixpath.basename(path)):
            fs.rm(path)  # an earlier export's shards would shadow or confuse this one
    return files


def _remove_partial(fs: Any, root: str, files: list[str]) -> None:
    """Remove the shards a failed export wrote: a shard cut short has its whole header but
    not its data, and beside an earlier export's config.json it would pass for a model."""
    for name in files:
        try:
            fs.rm(posixpath.join(root, name))
        except FileNotFoundError:
            continue
        except OSError as exc:
            logger.warning("cannot remove the partial %s: %s", posixpath.join(root, name), exc)
    if files:
        logger.warning("export failed: removed its partial file(s) %s under %s", files, root)


def export_hf(ckpt_uri: str, out: str, step: int | None = None, dtype: str = "bfloat16", *,
              shard_bytes: int = SHARD_BYTES, spec: dict[str, Any] | None = None,
              storage_options: dict[str, Any] | None = None, progress: Progress | None = None,
              batch_bytes: int = BATCH_BYTES) -> ExportResult:
    """Write version `step` (default: newest committed) of `ckpt_uri` as an HF Llama (or, with
    `model.moe`, Mixtral) directory."""
    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"--dtype: {dtype!r} must be one of {sorted(EXPORT_DTYPES)}")
    src = open_version(ckpt_uri, step, spec, storage_options)
    catalog, manifest, job, model = src.catalog, src.manifest, src.job, src.model
    version, metadata, names = src.version, src.metadata, src.names
    extra = note_dropless(model)
    target = EXPORT_DTYPES[dtype]
    shards = plan_shards(names, metadata, target, shard_bytes)
    total = sum(torch.Size(s).numel() for shard in shards for _, s in shard) * target.itemsize
    check_not_source(out, (job.get("model") or {}).get("init_from"))
    fs, root = open_out(out)
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
        source = inherited_from_source(model, (job.get("model") or {}).get("init_from"))
        config = hf_config_from_model(model, dtype, copy_tokenizer(job, fs, root), source)
    except HFConfigError as exc:
        raise ExportError(str(exc)) from None
    _write_json(fs, posixpath.join(root, CONFIG_NAME), config)
    tensors = sum(len(hf_parts(n, s)) for shard in shards for n, s in shard)
    logger.info("exported %s step %d -> %s: %d tensors, %d files, %.1f MB", ckpt_uri,
                manifest.step, out, tensors, len(files), total / 1e6)
    return ExportResult(out, manifest.step, files, total, tensors, extra)


def note_dropless(model: dict[str, Any]) -> dict[str, Any]:
    """Say, for an MoE model, when HF's dropless Mixtral may compute what Tenax did not: a
    warning where Tenax's capacity can drop assignments, else an info line. Also returned in
    ExportResult.extra (`dropless_note`, `drops_possible`)."""
    if model.get("moe") is None:
        return {}
    drops, note = dropless_note(model["moe"])
    logger.log(logging.WARNING if drops else logging.INFO, "MoE export as Mixtral: %s", note)
    return {"dropless_note": note, "drops_possible": drops}
