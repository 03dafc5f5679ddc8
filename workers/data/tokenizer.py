"""Tokenizers read from local files: HF `tokenizer.json`, SentencePiece `.model`, tiktoken BPE.

Why one small protocol: preparing a corpus, decoding samples for `tenax data inspect` and
copying the tokenizer next to exported weights need only ids in, ids out, the vocabulary size,
the end-of-document id and the files that make the tokenizer up.

Nothing is fetched from a hub or URL: a tokenizer is the bytes of one file at a local path or
any fsspec URI. The bytes are kept in the object, so it pickles to worker processes (which
may not see the same filesystem, e.g. memory://) and rebuilds there on first use.

`encode` never adds BOS/EOS; callers append `eos_id` after each document themselves. Special
tokens written literally in a text ("<|endoftext|>") are encoded as ordinary text by every
backend, so only the EOS the caller appends ends a document.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import posixpath
import re
import tempfile
from typing import Any, Protocol, runtime_checkable

import fsspec

logger = logging.getLogger(__name__)

# The cl100k pre-tokenisation pattern: tiktoken BPE files carry only ranks, not a pattern.
CL100K_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+|"""
                  r""" ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s""")
ENDOFTEXT = "<|endoftext|>"
# Tried in this order when neither the caller nor the tokenizer's own config names an EOS.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
VOCAB_MULTIPLE = 64
MAX_TOKENIZER_BYTES = 256 << 20  # the largest tokenizer.json files (256k vocabularies) are ~35 MB
BYTE_VOCAB_SIZE = 257
BYTE_EOS_ID = 256
_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]+=*[ \t]+[0-9]+\r?$")


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS or EOS."""
        ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        ...

    def decode(self, ids: list[int]) -> str:
        ...

    def files(self) -> list[str]:
        """The paths/URIs that make up this tokenizer (to copy next to exported weights)."""
        ...


class ByteTokenizer:
    """No tokenizer: UTF-8 bytes are the tokens (0..255) and 256 ends a document."""

    vocab_size = BYTE_VOCAB_SIZE
    eos_id = BYTE_EOS_ID

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def files(self) -> list[str]:
        return []

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class FileTokenizer:
    """Shared part of the file-backed tokenizers: the file's bytes and a lazily built backend."""

    kind = "file"

    def __init__(self, uri: str, blob: bytes, eos_id: int | None,
                 extra_files: list[str] | None = None) -> None:
        self.uri, self.blob = uri, blob
        self.extra_files = list(extra_files or [])
        self.backend: Any = None
        self.vocab_size = self.measure_vocab()
        found = self.find_eos() if eos_id is None else eos_id
        if found is None:
            raise ValueError(f"tokenizer {uri!r}: no end-of-document token found (looked for "
                             f"{', '.join(EOS_CANDIDATES)}); set --eos-id (data.eos_id when "
                             f"training) to its id")
        if isinstance(found, bool) or not isinstance(found, int) \
                or not 0 <= found < self.vocab_size:
            raise ValueError(f"data.eos_id: {found!r} is outside the vocabulary of tokenizer "
                             f"{uri!r} (vocab_size {self.vocab_size})")
        self.eos_id = found

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["backend"] = None  # native objects do not pickle; rebuilt from `blob` on use
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    @property
    def model(self) -> Any:
        if self.backend is None:
            self.backend = self.build()
        return self.backend

    def build(self) -> Any:
        raise NotImplementedError

    def measure_vocab(self) -> int:
        raise NotImplementedError

    def find_eos(self) -> int | None:
        raise NotImplementedError

    def files(self) -> list[str]:
        return [self.uri, *self.extra_files]

    def known_ids(self, ids: list[int]) -> list[int]:
        """`ids` as ints, every one inside the vocabulary: the native decoders would raise
        their own errors on others (or, `tokenizers`, silently drop them)."""
        ids = [int(i) for i in ids]
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"tokenizer {self.uri!r}: token id {bad} is outside its "
                             f"vocabulary [0, {self.vocab_size}); were these tokens made with "
                             f"another tokenizer?")
        return ids

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.uri!r}, vocab_size={self.vocab_size}, "
                f"eos_id={self.eos_id})")


class HFTokenizer(FileTokenizer):
    """A Hugging Face `tokenizer.json`, run by the `tokenizers` library."""

    kind = "hf"

    def build(self) -> Any:
        from tokenizers import Tokenizer as RustTokenizer

        backend = RustTokenizer.from_str(self.blob.decode("utf-8"))
        # A literal "<|endoftext|>" in a document is text, not an EOS that would cut the
        # document in two; tiktoken's encode_ordinary treats it the same way.
        backend.encode_special_tokens = True
        return backend

    def measure_vocab(self) -> int:
        vocab = self.model.get_vocab(with_added_tokens=True)
        return max(vocab.values()) + 1 if vocab else 0

    def find_eos(self) -> int | None:
        config_eos = self.config_eos()
        if config_eos is not None and self.model.token_to_id(config_eos) is not None:
            return int(self.model.token_to_id(config_eos))
        template_eos = template_trailing_special(json.loads(self.blob))
        if template_eos is not None:
            return template_eos
        for token in EOS_CANDIDATES:
            found = self.model.token_to_id(token)
            if found is not None:
                return int(found)
        return None

    def config_eos(self) -> str | None:
        """`eos_token` of a `tokenizer_config.json` next to the file, if there is one."""
        fs, path = fsspec.core.url_to_fs(self.uri)
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            sibling_path = posixpath.join(posixpath.dirname(path), name)
            try:
                with fs.open(sibling_path, "rb") as f:
                    config = json.loads(f.read())
            except (OSError, ValueError):
                continue
            sibling = fs.unstrip_protocol(sibling_path) if "://" in self.uri else sibling_path
            if sibling not in self.extra_files:
                self.extra_files.append(sibling)
            eos = config.get("eos_token") if isinstance(config, dict) else None
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str):
                return eos
        return None

    def encode(self, text: str) -> list[int]:
        return self.model.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.model.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.model.decode(self.known_ids(ids), skip_special_tokens=False)


def template_trailing_special(doc: Any) -> int | None:
    """The special token a TemplateProcessing post-processor appends after "$A", if any."""
    processors = []
    post = doc.get("post_processor") if isinstance(doc, dict) else None
    if isinstance(post, dict):
        processors = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
    for proc in processors:
        if not isinstance(proc, dict) or proc.get("type") != "TemplateProcessing":
            continue
        single = proc.get("single") or []
        last = single[-1] if single else None
        if isinstance(last, dict) and "SpecialToken" in last:
            name = last["SpecialToken"].get("id")
            ids = (proc.get("special_tokens", {}).get(name) or {}).get("ids") or []
            if ids:
                return int(ids[-1])
    return None


class SentencePieceTokenizer(FileTokenizer):
    """A SentencePiece `.model` file."""

    kind = "sentencepiece"

    def build(self) -> Any:
        import sentencepiece

        return sentencepiece.SentencePieceProcessor(model_proto=self.blob)

    def measure_vocab(self) -> int:
        return int(self.model.get_piece_size())

    def find_eos(self) -> int | None:
        eos = int(self.model.eos_id())
        if eos >= 0:
            return eos
        for token in EOS_CANDIDATES:
            found = int(self.model.piece_to_id(token))
            if found != self.model.unk_id():
                return found
        return None

    def encode(self, text: str) -> list[int]:
        return list(self.model.encode(text))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # One thread: parallelism comes from worker processes, which each own a core.
        return [list(ids) for ids in self.model.encode(list(texts), num_threads=1)]

    def decode(self, ids: list[int]) -> str:
        return self.model.decode(self.known_ids(ids))


class TiktokenTokenizer(FileTokenizer):
    """A tiktoken BPE ranks file ("base64-token rank" per line), cl100k pattern, EOS after it."""

    kind = "tiktoken"

    def build(self) -> Any:
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        # load_tiktoken_bpe wants a path and caches by path; the content hash keeps a stale
        # cache entry (same temp name, other content) from ever being used.
        digest = hashlib.sha256(self.blob).hexdigest()
        with tempfile.TemporaryDirectory(prefix="tenax-tiktoken-") as tmp:
            local = os.path.join(tmp, "ranks.tiktoken")
            with open(local, "wb") as f:
                f.write(self.blob)
            ranks = load_tiktoken_bpe(local, expected_hash=digest)
        specials = {ENDOFTEXT: max(ranks.values()) + 1 if ranks else 0}
        return tiktoken.Encoding(name=f"tenax-{digest[:12]}", pat_str=CL100K_PATTERN,
                                 mergeable_ranks=ranks, special_tokens=specials)

    def measure_vocab(self) -> int:
        return int(self.model.n_vocab)

    def find_eos(self) -> int | None:
        return int(self.model.eot_token)

    def encode(self, text: str) -> list[int]:
        return self.model.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.model.encode_ordinary_batch(list(texts), num_threads=1)

    def decode(self, ids: list[int]) -> str:
        return self.model.decode(self.known_ids(ids))


def read_bytes(uri: str, limit: int = MAX_TOKENIZER_BYTES) -> bytes:
    """The file's bytes, at most `limit`: a tokenizer is megabytes, and a path such as
    /dev/zero must fail rather than read forever."""
    try:
        with fsspec.open(uri, "rb") as f:
            blob = f.read(limit + 1)
    except FileNotFoundError:
        raise FileNotFoundError(f"data.tokenizer: {uri!r} does not exist") from None
    if len(blob) > limit:
        raise ValueError(f"data.tokenizer: {uri!r} is larger than {limit >> 20} MiB; "
                         f"not a tokenizer file")
    return blob


def detect_kind(uri: str, blob: bytes) -> type[FileTokenizer]:
    """Pick the backend by extension first, then by content."""
    name = uri.rstrip("/").rsplit("/", 1)[-1].lower()
    if name.endswith(".json"):
        return HFTokenizer
    if name.endswith(".model"):
        return SentencePieceTokenizer
    if name.endswith(".tiktoken"):
        return TiktokenTokenizer
    if blob.lstrip()[:1] == b"{":
        return HFTokenizer
    first = blob.split(b"\n", 1)[0]
    if _TIKTOKEN_LINE.match(first):
        return TiktokenTokenizer
    return SentencePieceTokenizer


def load_tokenizer(uri: str | None, eos_id: int | None = None) -> Tokenizer:
    """The tokenizer in file `uri` (local path or fsspec URI); `None` or "" -> `ByteTokenizer`.

    The EOS is `eos_id` when given, else the tokenizer's own (its config's `eos_token`, the
    token its post-processor appends, or one of `EOS_CANDIDATES`).
    """
    if not uri:
        if eos_id not in (None, BYTE_EOS_ID):
            raise ValueError(f"data.eos_id: {eos_id} with no tokenizer; byte-level tokens end "
                             f"documents with {BYTE_EOS_ID}")
        return ByteTokenizer()
    blob = read_bytes(uri)
    cls = detect_kind(uri, blob)
    try:
        tokenizer = cls(uri, blob, eos_id)
    except ValueError:
        raise
    except Exception as err:  # the native libraries raise their own types on a bad file
        raise ValueError(f"data.tokenizer: {uri!r} could not be read as a {cls.kind} tokenizer "
                         f"(tokenizer.json, SentencePiece .model or tiktoken BPE file): "
                         f"{err}") from None
    logger.info("tokenizer %r", tokenizer)
    return tokenizer


def auto_vocab_size(tokenizer: Tokenizer) -> int:
    """The tokenizer's vocabulary rounded up to a multiple of 64 (for the embedding's shape)."""
    return -(-int(tokenizer.vocab_size) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
