"""`prepare_dataset` throughput ÷ a plain tokenizer loop, and its speed-up from 1 to 2 workers.

    python -m bench.prepare_bench [--quick] [--workers N] [--reps N] [--json PATH]

Why: preparing a corpus should cost little more than tokenizing it; reading JSON, packing
ids, ordering batches and writing the indexed dataset must not eat the tokenizer's speed.

Both sides run in one invocation on the same synthetic corpus (jsonl: about 40 MB, `--quick`
about 5 MB, documents of 0.5-4 KB) with a byte-level BPE tokenizer trained on it here:
- prepare: `prepare_dataset(corpus, tokenizer.json, workers=W)`, wall time end to end (reading,
  tokenizing, writing .bin/.idx, pool start-up);
- plain loop: the same documents already in memory, cut into prepare's own batches (1000
  documents or 1 MB), given to a multiprocessing pool of the same W processes (same start
  method), each calling `tokenizers.Tokenizer.encode_batch` on one thread
  (TOKENIZERS_PARALLELISM=false) and returning only a token count: tokenizing, nothing else.
The ratio is tokens/s of prepare ÷ tokens/s of the plain loop (goal >= 0.9); next to it the
same ratio per CPU second (parent + workers, which a busy shared host does not skew), and the
speed-up from 1 to W workers of both. Workers are spawned on both sides here, so that their CPU
time is counted. Reps alternate the sides; each figure is the best of its reps.
"""
from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import random
import resource
import sys
import tempfile
import time
from typing import Any

from tenax.testing.scripts import exit_unless_run_as_module

exit_unless_run_as_module(__spec__, __file__)  # a path run stops here, before `bench.`

import tenax.workers.data.prepare as prepare_module
from bench.common import Report, parse_args, ratio

logger = logging.getLogger(__name__)

FULL_MB, QUICK_MB = 40, 5
FULL_VOCAB, QUICK_VOCAB = 8192, 4096
PLAIN: dict[str, Any] = {}


def make_corpus(path: str, megabytes: int, seed: int = 0) -> list[str]:
    """Documents of Zipf-distributed made-up words, written as jsonl; returns the texts."""
    rng = random.Random(seed)
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    vocab = ["".join(rng.choice(letters) for _ in range(rng.randint(1, 10)))
             for _ in range(20000)]
    weights = [1.0 / (rank + 1) for rank in range(len(vocab))]
    docs, size = [], 0
    with open(path, "w") as f:
        while size < megabytes * 1_000_000:
            words = rng.choices(vocab, weights, k=rng.randint(80, 700))
            text = " ".join(words).capitalize() + "."
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            docs.append(text)
            size += len(line)
    return docs


def train_tokenizer(docs: list[str], path: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(docs[:2000], trainer)
    tok.save(path)


def plain_init(tokenizer_json: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    PLAIN["tok"] = Tokenizer.from_str(tokenizer_json)


def plain_encode(texts: list[str]) -> int:
    """Tokens of a batch, EOS per document included, as prepare counts them."""
    encoded = PLAIN["tok"].encode_batch(texts, add_special_tokens=False)
    return sum(len(e.ids) for e in encoded) + len(texts)


def same_batches(corpus: str) -> list[list[str]]:
    """The corpus cut into prepare's own batches, read ahead of time (not timed)."""
    from tenax.workers.data.corpus import document_batches, resolve_inputs

    return [b.texts for b in document_batches(resolve_inputs([corpus]), "text")]


def plain_loop(batches: list[list[str]], tokenizer_path: str,
               workers: int) -> tuple[int, float]:
    from tenax.workers.data.prepare import START_METHOD

    with open(tokenizer_path) as f:
        blob = f.read()
    start = time.perf_counter()
    with mp.get_context(START_METHOD).Pool(workers, initializer=plain_init,
                                           initargs=(blob,)) as pool:
        tokens = sum(pool.imap(plain_encode, batches))
    return tokens, time.perf_counter() - start


def prepare(corpus: str, tokenizer_path: str, out: str, workers: int) -> tuple[int, float]:
    from tenax.workers.data import prepare_dataset

    start = time.perf_counter()
    stats = prepare_dataset([corpus], out, tokenizer=tokenizer_path, workers=workers,
                            progress=False)
    seconds = time.perf_counter() - start
    reap_workers()
    return stats["tokens"], seconds


def reap_workers(timeout_s: float = 30.0) -> None:
    """prepare returns without joining its pool's workers (they end on their own a moment
    later): reap them, so that their CPU time is in RUSAGE_CHILDREN like the plain loop's."""
    deadline = time.monotonic() + timeout_s
    while mp.active_children() and time.monotonic() < deadline:
        time.sleep(0.01)


def cpu_seconds() -> float:
    """User + system CPU of this process and its reaped children (the pool's workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def measure(root: str, corpus: str, tok: str, workers: int,
            reps: int) -> dict[str, Any]:
    """Best tokens/s of each side over `reps` alternating reps."""
    batches = same_batches(corpus)
    sides = {"plain_w": lambda: plain_loop(batches, tok, workers),
             "prepare_w": lambda: prepare(corpus, tok, f"{root}/out_w", workers),
             "prepare_1": lambda: prepare(corpus, tok, f"{root}/out_1", 1),
             "plain_1": lambda: plain_loop(batches, tok, 1)}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    for rep in range(reps):
        for name, run in sides.items():
            cpu = cpu_seconds()
            tokens, seconds = run()
            cpu = cpu_seconds() - cpu
            runs[name].append({"tokens": tokens, "seconds": seconds, "cpu_seconds": cpu,
                               "tokens_per_s": tokens / seconds,
                               "tokens_per_cpu_s": tokens / cpu})
            logger.info("rep %d %s: %d tokens in %.2f s", rep, name, tokens, seconds)
    counts = {r["tokens"] for rs in runs.values() for r in rs}
    if len(counts) != 1:
        raise RuntimeError(f"the sides counted different tokens: {sorted(counts)}")
    best = {name: max(r["tokens_per_s"] for r in rs) for name, rs in runs.items()}
    per_cpu = {name: max(r["tokens_per_cpu_s"] for r in rs) for name, rs in runs.items()}
    return {"best_tokens_per_s": best, "best_tokens_per_cpu_s": per_cpu, "runs": runs,
            "tokens": counts.pop()}


def main() -> int:
    args = parse_args(__doc__, lambda p: (
        p.add_argument("--workers", type=int, default=None,
                       help="worker processes for the ratio (default: all CPUs, at least 2)"),
        p.add_argument("--reps", type=int, default=None, help="reps per side (3, quick 2)")))
    workers = args.workers or max(2, os.cpu_count() or 1)
    reps = args.reps or (2 if args.quick else 3)
    megabytes = QUICK_MB if args.quick else FULL_MB
    # Spawned workers are this process's children, so their CPU time is counted (forkserver's
    # are the server's); both sides use the same start method.
    prepare_module.START_METHOD = "spawn"
    report = Report(f"tenax data prepare vs a plain tokenizer loop, {workers} workers")
    with tempfile.TemporaryDirectory(prefix="tenax-prepare-bench-") as root:
        corpus, tok = f"{root}/corpus.jsonl", f"{root}/tokenizer.json"
        docs = make_corpus(corpus, megabytes)
        train_tokenizer(docs, tok, QUICK_VOCAB if args.quick else FULL_VOCAB)
        load_before = os.getloadavg()
        result = measure(root, corpus, tok, workers, reps)
    best = result["best_tokens_per_s"]
    report.add(f"prepare ÷ plain loop tokens/s ({workers} workers)",
               ratio(best["prepare_w"], best["plain_w"]), ">= 0.9",
               "plain loop: a process pool of encode_batch over in-memory batches")
    report.add("prepare ÷ plain loop tokens/s (1 worker)",
               ratio(best["prepare_1"], best["plain_1"]), "", "context")
    report.add(f"prepare speed-up, 1 -> {workers} workers",
               ratio(best["prepare_w"], best["prepare_1"]), "",
               f"plain loop: {ratio(best['plain_w'], best['plain_1']):.2f}x on the same host")
    cpu = result["best_tokens_per_cpu_s"]
    report.add(f"prepare ÷ plain loop tokens per CPU second ({workers} workers)",
               ratio(cpu["prepare_w"], cpu["plain_w"]), "",
               "CPU of parent + workers: the overhead, whatever the host's load")
    for name, value in best.items():
        report.add(f"tokens/s {name}", value, "", "best of reps", "tok/s")
    report.context = {"quick": args.quick, "workers": workers, "reps": reps,
                      "corpus_mb": megabytes, "documents": len(docs),
                      "tokens": result["tokens"], "runs": result["runs"],
                      "load_avg_before": load_before, "load_avg_after": os.getloadavg()}
    report.finish(args.json_path)
    print(json.dumps(report.to_dict(), default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
