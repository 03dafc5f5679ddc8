"""tenax.workers.data — the tokens a job trains on, in an order that survives any re-plan.

- `TokenDataLoader`: global batches by step, sliced per dp rank, whose only state is the
  global sample cursor; `permute`, the seeded O(1) permutation behind the order.
- Sources (sources.py): `SyntheticSource`, `TokenFileSource` (a flat token file),
  `IndexedSource` (an indexed dataset prefix); `open_source`, `open_uri`.
- Blends (blend.py): `BlendAssignment` (global index -> source and its index), `BlendedSource`.
- Documents (documents.py): positions and block-causal masks from EOS tokens, EOS loss masking,
  `check_document_ends` (an indexed source's documents end with the EOS the job uses).
- `prepare_token_file`: byte-level tokens of text files into a flat token file; `EOS_ID`.
- Tokenizers (tokenizer.py): `Tokenizer`, `load_tokenizer` (tokenizer.json, SentencePiece,
  tiktoken), `ByteTokenizer`, `auto_vocab_size`.
- Megatron's indexed dataset (indexed.py): `IndexedDataset`, `IndexedDatasetWriter`,
  `is_indexed_dataset`, `dtype_for_vocab`; `prepare_dataset` (prepare.py) writes one from text.

Names resolve lazily (PEP 562): importing this package imports neither torch nor a tokenizer.
"""
from __future__ import annotations

from tenax.faces import lazy_face

_MODULES = {
    "loader": ("EOS_ID", "TokenDataLoader", "open_blend", "prepare_token_file"),
    "sources": ("IndexedSource", "SyntheticSource", "TokenFileSource", "TokenSource",
                "check_rows", "open_source", "open_uri", "permute"),
    "blend": ("BLEND_BLOCK", "BlendAssignment", "BlendedSource", "source_order"),
    "documents": ("IGNORE_INDEX", "check_document_ends", "document_ids", "document_mask",
                  "document_positions", "documents_eos_id", "mask_eos_targets",
                  "resolve_eos_id"),
    "tokenizer": ("ByteTokenizer", "Tokenizer", "auto_vocab_size", "load_tokenizer"),
    "indexed": ("IndexedDataset", "IndexedDatasetWriter", "dtype_for_vocab",
                "is_indexed_dataset"),
    "prepare": ("prepare_dataset",),
}

__all__, __getattr__, __dir__ = lazy_face(__name__, _MODULES)
