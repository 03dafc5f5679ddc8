"""Text corpora read as a stream of document batches, in a fixed order.

Inputs: `.txt` (the whole file is one document), `.jsonl` / `.jsonl.gz` (one JSON object per
line, the document in `text_field`), `.parquet` (a string column `text_field`, read one record
batch at a time). Local paths or any fsspec URI; glob patterns expand in sorted order.

Why batches of documents: tokenizing is spread over worker processes batch by batch, and the
batches depend only on the input, so any worker count writes the same bytes. Every error names
the file and the line (jsonl) or row (parquet) so a bad record in a terabyte corpus is found.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Iterator

import fsspec

logger = logging.getLogger(__name__)

BATCH_DOCUMENTS = 1000
BATCH_BYTES = 1 << 20
PARQUET_BATCH_ROWS = 1024
SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".parquet")


@dataclass
class DocumentBatch:
    """Consecutive documents; `where[i]` names document i's file and line/row for errors."""

    texts: list[str] = field(default_factory=list)
    where: list[str] = field(default_factory=list)
    nbytes: int = 0


@dataclass
class CorpusFile:
    fs: Any
    path: str
    uri: str
    kind: str


def kind_of(uri: str) -> str:
    lower = uri.lower()
    for suffix in (".jsonl.gz", ".jsonl", ".parquet", ".txt"):
        if lower.endswith(suffix):
            return suffix.lstrip(".")
    raise ValueError(f"data prepare: input {uri!r} is not one of {', '.join(SUFFIXES)}")


def resolve_inputs(inputs: list[str]) -> list[CorpusFile]:
    """Every input file, globs expanded, checked to exist before anything is written."""
    if not inputs:
        raise ValueError("data prepare: no inputs given; name at least one text file")
    files = []
    for uri in inputs:
        fs, path = fsspec.core.url_to_fs(uri)
        if any(ch in path for ch in "*?["):
            matches = sorted(fs.glob(path))
            if not matches:
                raise FileNotFoundError(f"data prepare: pattern {uri!r} matches no file")
            names = [(m, fs.unstrip_protocol(m) if "://" in uri else m) for m in matches]
        else:
            if not fs.isfile(path):
                raise FileNotFoundError(f"data prepare: input {uri!r} does not exist")
            names = [(path, uri)]
        files += [CorpusFile(fs, p, u, kind_of(u)) for p, u in names]
    return files


def decode_utf8(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{where}: invalid UTF-8 at byte {err.start}") from None


def text_documents(f: CorpusFile) -> Iterator[tuple[str, str, int]]:
    with f.fs.open(f.path, "rb") as stream:
        raw = stream.read()
    yield decode_utf8(raw, f.uri), f.uri, len(raw)


def jsonl_documents(f: CorpusFile, text_field: str) -> Iterator[tuple[str, str, int]]:
    compression = "gzip" if f.kind == "jsonl.gz" else None
    with f.fs.open(f.path, "rb", compression=compression) as stream:
        for number, raw in enumerate(stream, start=1):
            where = f"{f.uri}: line {number}"
            line = decode_utf8(raw, where)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not JSON ({err.msg})") from None
            if not isinstance(record, dict) or text_field not in record:
                raise ValueError(f"{where}: no field {text_field!r} (set --text-field)")
            text = record[text_field]
            if not isinstance(text, str):
                raise ValueError(f"{where}: field {text_field!r} is {type(text).__name__}, "
                                 f"not a string")
            yield text, where, len(raw)


def parquet_documents(f: CorpusFile, text_field: str) -> Iterator[tuple[str, str, int]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with f.fs.open(f.path, "rb") as stream:
        reader = pq.ParquetFile(stream)
        schema = reader.schema_arrow
        if text_field not in schema.names:
            raise ValueError(f"{f.uri}: no column {text_field!r} (columns: "
                             f"{', '.join(schema.names)}; set --text-field)")
        kind = schema.field(text_field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise ValueError(f"{f.uri}: column {text_field!r} is {kind}, not a string column")
        row = 0
        for group in range(reader.num_row_groups):
            for batch in reader.iter_batches(PARQUET_BATCH_ROWS, row_groups=[group],
                                             columns=[text_field]):
                for text in batch.column(0).to_pylist():
                    if text is None:
                        raise ValueError(f"{f.uri}: row {row} column {text_field!r} is null")
                    yield text, f"{f.uri}: row {row}", len(text)
                    row += 1


def documents(f: CorpusFile, text_field: str) -> Iterator[tuple[str, str, int]]:
    """(text, where, input bytes) of each document of one file."""
    if f.kind == "txt":
        return text_documents(f)
    if f.kind == "parquet":
        return parquet_documents(f, text_field)
    return jsonl_documents(f, text_field)


def document_batches(files: list[CorpusFile], text_field: str,
                     max_documents: int | None = None,
                     max_bytes: int | None = None) -> Iterator[DocumentBatch]:
    """Batches of consecutive documents across all files, cut by count or size (defaults:
    BATCH_DOCUMENTS, BATCH_BYTES, read at call time)."""
    max_documents = max_documents or BATCH_DOCUMENTS
    max_bytes = max_bytes or BATCH_BYTES
    batch = DocumentBatch()
    for f in files:
        for text, where, size in documents(f, text_field):
            batch.texts.append(text)
            batch.where.append(where)
            batch.nbytes += size
            if len(batch.texts) >= max_documents or batch.nbytes >= max_bytes:
                yield batch
                batch = DocumentBatch()
    if batch.texts:
        yield batch
