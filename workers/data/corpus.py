"""Text corpora read as a stream of document batches, in a fixed order.

Inputs: `.txt` (the whole file is one document), `.jsonl` / `.jsonl.gz` (one JSON object per
line, the document in `text_field`), `.parquet` (a string column `text_field`, read one record
batch at a time). Local paths or any fsspec URI; glob patterns expand in sorted order.

Why batches of documents: tokenizing is spread over worker processes batch by batch, and the
batches depend only on the input, so any worker count writes the same bytes. Every error names
the file and the line (jsonl) or row (parquet) so a bad record in a terabyte corpus is found; a
file that cannot be read at all (a truncated or non-gzip `.jsonl.gz`, a `.parquet` that is not
one) is a ValueError naming the file too, not a library traceback without it.
"""
from __future__ import annotations

import json
import logging
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import fsspec

logger = logging.getLogger(__name__)

BATCH_DOCUMENTS = 1000
BATCH_BYTES = 1 << 20
PARQUET_BATCH_ROWS = 1024
SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".parquet")
# What reading a damaged file raises (gzip.BadGzipFile is an OSError); the ValueErrors of bad
# records are raised by this module, already naming the file.
READ_ERRORS = (OSError, EOFError, zlib.error)
REASON_CHARS = 200


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


def unreadable(f: CorpusFile, err: BaseException, at: str = "") -> ValueError:
    """`<uri>: unreadable <kind> file[ at <at>] (<reason>)` for a file the library gave up on."""
    reason = str(err) or type(err).__name__
    if len(reason) > REASON_CHARS:
        reason = reason[:REASON_CHARS] + "..."
    return ValueError(f"{f.uri}: unreadable {f.kind} file{f' at {at}' if at else ''} "
                      f"({reason})")


def text_documents(f: CorpusFile) -> Iterator[tuple[str, str, int]]:
    try:
        with f.fs.open(f.path, "rb") as stream:
            raw = stream.read()
    except READ_ERRORS as err:
        raise unreadable(f, err) from None
    yield decode_utf8(raw, f.uri), f.uri, len(raw)


def jsonl_documents(f: CorpusFile, text_field: str) -> Iterator[tuple[str, str, int]]:
    for number, raw in enumerate(jsonl_lines(f), start=1):
        where = f"{f.uri}: line {number}"
        line = decode_utf8(raw, where)
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not JSON ({err.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: not a JSON object but {json_kind(record)}; each line "
                             f"must be an object with the text in field {text_field!r}")
        if text_field not in record:
            raise ValueError(f"{where}: no field {text_field!r} (set --text-field)")
        text = record[text_field]
        if not isinstance(text, str):
            raise ValueError(f"{where}: field {text_field!r} is {json_kind(text)}, "
                             f"not a string")
        yield text, where, len(raw)


def json_kind(value: Any) -> str:
    """What a parsed JSON value is, in JSON's words (a list is an array, None is null)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {dict: "an object", list: "an array", str: "a string"}.get(type(value), "a value")


def jsonl_lines(f: CorpusFile) -> Iterator[bytes]:
    """The raw lines of a jsonl file, decompressed; a read failure names the line it hit."""
    compression = "gzip" if f.kind == "jsonl.gz" else None
    number = 0
    try:
        with f.fs.open(f.path, "rb", compression=compression) as stream:
            for raw in stream:
                number += 1
                yield raw
    except READ_ERRORS as err:
        raise unreadable(f, err, f"line {number + 1}") from None


def parquet_documents(f: CorpusFile, text_field: str) -> Iterator[tuple[str, str, int]]:
    import pyarrow as pa

    row = 0
    try:
        for texts in parquet_batches(f, text_field):
            for text in texts:
                if text is None:
                    raise ValueError(f"{f.uri}: row {row} column {text_field!r} is null")
                yield text, f"{f.uri}: row {row}", len(text)
                row += 1
    except (*READ_ERRORS, pa.ArrowException) as err:  # ArrowInvalid: not a parquet file
        raise unreadable(f, err, f"row {row}" if row else "") from None


def parquet_batches(f: CorpusFile, text_field: str) -> Iterator[list[str | None]]:
    """The column `text_field` of a parquet file, one record batch at a time."""
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
        for group in range(reader.num_row_groups):
            for batch in reader.iter_batches(PARQUET_BATCH_ROWS, row_groups=[group],
                                             columns=[text_field]):
                yield batch.column(0).to_pylist()


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
