"""Document boundaries inside a training window: positions, block-causal masks, EOS loss masking.

Why from EOS tokens in the window: samples are windows over a concatenated token stream
(sources.py), so a window may hold the end of one document and the start of others. With
`data.document_mask: true` attention stays inside a document and rotary positions restart at
each document start; the token after an EOS starts a new document. Deriving this from the
inputs alone keeps it a pure function of the batch, identical on every rank and layout, with
no extra index reads.

With `data.mask_eos_loss: true` the target predicted from an EOS input (the first token of the
next document, which the model cannot know) is ignored in the loss.

Both features silently do nothing when the EOS id is wrong (a BPE dataset, EOS 0, read with the
byte-level default 256), so `check_document_ends` compares the last token of an indexed
dataset's first documents with the resolved EOS when the loader opens it.
"""
from __future__ import annotations

import logging
from functools import lru_cache
from typing import Iterable

import torch

from tenax.workers.data.sources import DOCUMENT_END_CHECKS, IndexedSource, TokenSource
from tenax.workers.spec import DataSpec

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index
BYTE_EOS_ID = 256


def document_ids(inputs: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[b, s] int64: which document of its window each token belongs to (0 for the first)."""
    is_eos = (inputs == eos_id).to(torch.int64)
    return is_eos.cumsum(dim=1) - is_eos  # an EOS belongs to the document it ends


def document_positions(inputs: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[b, s] int64 rotary positions that restart at 0 at each document start."""
    s = inputs.shape[1]
    index = torch.arange(s, device=inputs.device).expand_as(inputs)
    starts = torch.zeros_like(inputs, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = inputs[:, :-1] == eos_id
    start_of = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - start_of


def document_mask(inputs: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[b, 1, s, s] bool, True where query i may attend key j: same document and j <= i."""
    ids = document_ids(inputs, eos_id)
    s = inputs.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=inputs.device).tril()
    return ((ids.unsqueeze(2) == ids.unsqueeze(1)) & causal).unsqueeze(1)


def mask_eos_targets(inputs: torch.Tensor, targets: torch.Tensor, eos_id: int) -> torch.Tensor:
    """`targets` with IGNORE_INDEX where the input is EOS (no loss for a document's first token)."""
    return targets.masked_fill(inputs == eos_id, IGNORE_INDEX)


@lru_cache(maxsize=16)
def _tokenizer_eos(uri: str) -> int | None:
    from tenax.workers.data.tokenizer import load_tokenizer

    return load_tokenizer(uri).eos_id


def resolve_eos_id(data_spec: DataSpec) -> int:
    """data.eos_id, else the tokenizer's EOS (data.tokenizer), else the byte-level EOS (256)."""
    if data_spec.eos_id is not None:
        return data_spec.eos_id
    if data_spec.tokenizer:
        eos = _tokenizer_eos(data_spec.tokenizer)
        if eos is None:
            raise ValueError(f"data.eos_id: the tokenizer {data_spec.tokenizer!r} names no "
                             f"end-of-document token; set data.eos_id")
        return int(eos)
    return BYTE_EOS_ID


def documents_eos_id(data_spec: DataSpec, cp: int, pp: int) -> int | None:
    """The EOS id a job needs (data.document_mask or data.mask_eos_loss), else None; refuses
    document masks under cp (ring attention) and pp (stage inputs carry no mask) > 1."""
    if data_spec.document_mask:
        for name, degree in (("cp", cp), ("pp", pp)):
            if degree > 1:
                raise ValueError(f"data.document_mask: not supported with parallel.{name}="
                                 f"{degree} (needs parallel.{name}=1)")
    if data_spec.document_mask or data_spec.mask_eos_loss:
        return resolve_eos_id(data_spec)
    return None


def check_document_ends(data_spec: DataSpec, sources: Iterable[TokenSource]) -> None:
    """With data.document_mask or data.mask_eos_loss, the last token of each indexed source's
    first DOCUMENT_END_CHECKS documents (read as it opened) must be the resolved EOS;
    ValueError otherwise (naming the field, the URI and the EOS id, never a token of the
    data)."""
    if not (data_spec.document_mask or data_spec.mask_eos_loss):
        return
    indexed = [s for s in sources if isinstance(s, IndexedSource)]
    if not indexed:
        return  # flat token files and synthetic data carry no document index
    eos = resolve_eos_id(data_spec)
    field = "data.document_mask" if data_spec.document_mask else "data.mask_eos_loss"
    for source in indexed:
        if (source.document_ends != eos).any():
            raise ValueError(f"{field}: documents of {source.uri!r} do not end with eos id {eos}; "
                             f"set data.tokenizer or data.eos_id (Megatron: --append-eod)")
