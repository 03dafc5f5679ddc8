"""`tenax export hf CKPT_URI --out DIR [--step N] [--dtype bfloat16|float32]`.

Writes a committed checkpoint, saved in any layout, as a directory that
`transformers.LlamaForCausalLM.from_pretrained(DIR)` (`MixtralForCausalLM` for a model with
`moe`) loads: config.json, safetensors (sharded
past --shard-size with model.safetensors.index.json) and the job's tokenizer files. Reads the
checkpoint (and, when readable, the config.json of the job's model.init_from, for the keys no
model key holds, e.g. max_position_embeddings); the job spec comes from the version's manifest.
A --spec supplies what the checkpoint lacks (the tokenizer, or the whole spec for checkpoints
saved before the spec travelled with them) and is refused when its model section is not the
checkpoint's. Exit codes: 0 written, 2 bad input, unreadable storage or an unwritable --out.
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

logger = logging.getLogger(__name__)

EXIT_USAGE = 2
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 1 << 10,
              "MIB": 1 << 20, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """'5GB', '200MB', '1048576' -> bytes (argparse type)."""
    raw = text.strip().upper()
    digits = raw.rstrip("KMGIB")
    unit = raw[len(digits):]
    try:
        value = float(digits)
    except ValueError:
        value = -1.0
    if unit not in SIZE_UNITS or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 5GB, 500MB, 1048576)")
    return int(value * SIZE_UNITS[unit])


def _spec_dict(path: str | None) -> dict[str, Any] | None:
    if path is None:
        return None
    from tenax.workers import load_spec

    return load_spec(path).model_dump(mode="json", by_alias=True)


def cmd_export_hf(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    from tenax.checkpoint import CatalogError, StorageError
    from tenax.workers import SpecError
    from tenax.workers.hf import ExportError, export_hf

    try:
        with Progress("[progress.description]{task.description}", BarColumn(),
                      DownloadColumn(), TimeRemainingColumn(), transient=True,
                      disable=args.quiet) as bar:
            task = bar.add_task("exporting", total=None)
            result = export_hf(args.uri, args.out, args.step, args.dtype,
                               shard_bytes=args.shard_size, spec=_spec_dict(args.spec),
                               progress=lambda done, total: bar.update(task, completed=done,
                                                                       total=total))
    except (ExportError, SpecError, StorageError, CatalogError, OSError) as exc:
        # an OSError here is a file export_hf writes under --out (its message names the file)
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {result.out}: step {result.step}, {result.tensors} tensors, "
          f"{len(result.files)} safetensors file(s), {result.total_bytes / 1e6:.1f} MB")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `tenax export ...` to the top-level parser (orchestrator/cli/main.py REGISTRARS)."""
    export = sub.add_parser("export", help="write checkpoints in other formats").add_subparsers(
        dest="format", required=True)
    p = export.add_parser("hf", help="a Hugging Face LlamaForCausalLM (MoE: MixtralForCausalLM) "
                                        "directory")
    p.add_argument("uri", help="checkpoint root URI (file://, s3://, ...)")
    p.add_argument("--out", required=True, help="output directory (local path or fsspec URI)")
    p.add_argument("--step", type=int, default=None,
                   help="committed version to export (default: the newest)")
    p.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16")
    p.add_argument("--shard-size", type=parse_size, default=5 * 10**9,
                   help="largest safetensors file before sharding (default 5GB)")
    p.add_argument("--spec", default=None,
                   help="job spec: its model section must be the checkpoint's; supplies the "
                        "tokenizer, or the whole spec for checkpoints saved without one")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_export_hf)
