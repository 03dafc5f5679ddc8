"""`tenax ckpt list|inspect|verify URI`: look at a job's checkpoints without starting a job.

Why a CLI of its own: after a failure an operator needs to know, before resuming, which versions
exist, which are committed, what layout wrote them and whether their bytes are intact. Reads
only; s3:// and other object stores take their settings from fsspec's environment
configuration (e.g. FSSPEC_S3_ENDPOINT_URL). Exit codes: 0 fine, 1 damage found, 2 bad URI or
unreadable storage.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from tenax.checkpoint.errors import CatalogError, StorageError
from tenax.checkpoint.format.catalog import Catalog, version_name
from tenax.checkpoint.format.storage import Storage

logger = logging.getLogger(__name__)

EXIT_DAMAGED, EXIT_USAGE = 1, 2


def _catalog(uri: str) -> Catalog:
    return Catalog(Storage(uri))


def _layout_text(layout: dict[str, Any] | None) -> str:
    if not layout:
        return "-"
    dims = [f"{k}{layout[k]}" for k in ("dp", "tp", "pp", "cp", "ep") if layout.get(k, 1) != 1]
    return " ".join(dims + [f"zero{layout.get('zero', '?')}"])


def _print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2))


def _table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*[str(v) for v in row])
    Console().print(table)


def list_versions(catalog: Catalog) -> list[dict[str, Any]]:
    """Every version: step, committed, bytes, and from the manifest layout/world/creation."""
    out = []
    for v in catalog.versions():
        row: dict[str, Any] = {"step": v.step, "committed": v.committed, "bytes": v.size,
                               "layout": None, "world_size": None, "created_at": None}
        if v.committed:
            try:
                m = catalog.manifest(v.step)
                row.update(layout=m.layout, world_size=m.world_size, created_at=m.created_at)
            except CatalogError as exc:
                row["error"] = str(exc)
        out.append(row)
    return out


def cmd_list(args: argparse.Namespace) -> int:
    catalog = _catalog(args.uri)
    rows = list_versions(catalog)
    if args.json:
        _print_json({"uri": catalog.storage.uri, "versions": rows})
        return 0
    _table(f"Checkpoints in {catalog.storage.uri}",
           ["step", "committed", "MB", "layout", "world", "created"],
           [[r["step"], "yes" if r["committed"] else "no (partial)", f"{r['bytes'] / 1e6:.1f}",
             _layout_text(r["layout"]) if not r.get("error") else f"unreadable: {r['error']}",
             r["world_size"] or "-", r["created_at"] or "-"] for r in rows])
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    catalog = _catalog(args.uri)
    if args.step is None:
        manifest = catalog.latest_committed(verify=False)
        if manifest is None:
            print(f"error: no committed checkpoint under {catalog.storage.uri}", file=sys.stderr)
            return EXIT_USAGE
    else:
        manifest = catalog.manifest(args.step)
    doc = json.loads(manifest.to_json())
    if args.json:
        _print_json(doc)
        return 0
    from rich.console import Console

    files = doc.pop("files")
    Console().print(f"[bold]{catalog.storage.url(version_name(manifest.step))}[/bold]")
    _table("Manifest", ["field", "value"], [[k, json.dumps(v)] for k, v in doc.items()])
    _table(f"Files ({len(files)}, {manifest.total_bytes / 1e6:.1f} MB)",
           ["file", "bytes", "checksum"],
           [[rel, e["size"], e["checksum"]] for rel, e in sorted(files.items())])
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    catalog = _catalog(args.uri)
    versions = catalog.versions()
    committed = [v.step for v in versions if v.committed]
    partial = [v.step for v in versions if not v.committed]
    damaged = 0
    for step in committed:
        problems = catalog.verify(step)
        damaged += bool(problems)
        status = "DAMAGED" if problems else "ok"
        print(f"step {step:>8}: {status}")
        for problem in problems:
            print(f"    {problem}")
    if not committed:
        print(f"no committed versions under {catalog.storage.uri}")
    if partial:
        print(f"uncommitted (never loaded, removed by retention): {partial}")
    if damaged:
        print(f"{damaged} of {len(committed)} committed versions are damaged", file=sys.stderr)
        return EXIT_DAMAGED
    return 0


def _guarded(fn: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except (StorageError, CatalogError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_USAGE
    return run


def register(sub: argparse._SubParsersAction) -> None:
    """Add `tenax ckpt ...` to the top-level parser (orchestrator/cli/main.py REGISTRARS)."""
    ckpt = sub.add_parser("ckpt", help="inspect and verify checkpoints").add_subparsers(
        dest="what", required=True)
    p = ckpt.add_parser("list", help="versions with step, layout, size, committed or not")
    p.add_argument("uri", help="checkpoint root URI (file://, s3://, ...)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_guarded(cmd_list))
    p = ckpt.add_parser("inspect", help="print a manifest (newest committed by default)")
    p.add_argument("uri")
    p.add_argument("--step", type=int, default=None)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_guarded(cmd_inspect))
    p = ckpt.add_parser("verify", help="re-check every checksum; exit 1 on damage")
    p.add_argument("uri")
    p.set_defaults(func=_guarded(cmd_verify))
