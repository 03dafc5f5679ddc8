"""`tenax data prepare` and `tenax data inspect`: corpora in, Megatron indexed datasets out.

`prepare` tokenizes text (.txt, .jsonl, .jsonl.gz, .parquet) into `OUT.bin` + `OUT.idx`;
`inspect` prints what a dataset holds and its first tokens, decoded when given the tokenizer.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import sys
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Iterator

from tenax.orchestrator.cli.signals import handling_sigterm

logger = logging.getLogger(__name__)

INSPECT_TOKENS = 32
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130  # what a shell reports for a command stopped by Ctrl-C


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """SIGTERM (`kill`, a batch scheduler's time limit) stops prepare the way Ctrl-C does: a
    KeyboardInterrupt, so the partial output is removed; by default SIGTERM ends the process
    on the spot and leaves the temporary `.bin` behind."""
    def handler(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the cleanup
        raise KeyboardInterrupt

    with handling_sigterm(handler):
        yield


def cmd_data_prepare(args: argparse.Namespace) -> int:
    from tenax.workers.data import prepare_dataset

    try:
        with sigterm_interrupts():
            stats = prepare_dataset(args.inputs, args.out, tokenizer=args.tokenizer,
                                    text_field=args.text_field, workers=args.workers,
                                    progress=not args.json, eos_id=args.eos_id)
    except KeyboardInterrupt:
        print(f"interrupted: nothing was written at {args.out}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenProcessPool as err:
        print(f"error: {err}; nothing was written at {args.out}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(json.dumps(stats, indent=2))
    return 0


def inspect_doc(uri: str, tokenizer: str | None, count: int,
                eos_id: int | None = None) -> dict[str, Any]:
    from tenax.workers.data import IndexedDataset, load_tokenizer

    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"--count: must be a non-negative integer, got {count!r}")
    data = IndexedDataset(uri)
    first = data.read_tokens(0, min(count, data.num_tokens)).tolist()
    doc: dict[str, Any] = {
        "prefix": data.prefix, "documents": data.num_docs, "sequences": data.num_sequences,
        "tokens": data.num_tokens, "dtype": data.dtype.name,
        "max_document_tokens": int(data.sequence_lengths.max()) if data.num_sequences else 0,
        "first_tokens": first}
    if tokenizer:
        doc["first_text"] = load_tokenizer(tokenizer, eos_id).decode(first)
    return doc


def cmd_data_inspect(args: argparse.Namespace) -> int:
    doc = inspect_doc(args.uri, args.tokenizer, args.count, args.eos_id)
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"{doc['prefix']}: {doc['documents']:,} documents, {doc['tokens']:,} tokens, "
          f"dtype {doc['dtype']} ({doc['sequences']:,} sequences, longest "
          f"{doc['max_document_tokens']:,} tokens)")
    print(f"first {len(doc['first_tokens'])} tokens: {doc['first_tokens']}")
    if "first_text" in doc:
        print(f"decoded: {doc['first_text']!r}")
    else:
        print("(pass --tokenizer FILE to decode)")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser("data", help="training data tools").add_subparsers(dest="what",
                                                                              required=True)
    p = data.add_parser("prepare", help="tokenize text into a Megatron indexed dataset")
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help=".txt, .jsonl, .jsonl.gz or .parquet files (paths, fsspec URIs, globs)")
    p.add_argument("--out", required=True,
                   help="output prefix URI: writes OUT.bin and OUT.idx")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json, SentencePiece .model or tiktoken BPE file "
                        "(default: UTF-8 bytes, EOS 256)")
    p.add_argument("--eos-id", type=int, default=None, metavar="INT",
                   help="end-of-document id appended after each document (default: the "
                        "tokenizer's own; needed for a tokenizer that names none)")
    p.add_argument("--text-field", default="text",
                   help="jsonl field / parquet column holding the text (default: text)")
    p.add_argument("--workers", type=int, default=None,
                   help="tokenizer processes (default: all CPUs)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_data_prepare)
    p = data.add_parser("inspect", help="what an indexed dataset holds, and its first tokens")
    p.add_argument("uri", help="dataset prefix (URI.bin + URI.idx)")
    p.add_argument("--tokenizer", default=None, help="decode the first tokens with this file")
    p.add_argument("--eos-id", type=int, default=None, metavar="INT",
                   help="the end-of-document id, for a tokenizer that names none")
    p.add_argument("--count", type=int, default=INSPECT_TOKENS,
                   help=f"how many tokens to show (default {INSPECT_TOKENS})")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_data_inspect)
