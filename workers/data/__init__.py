"""tenax.workers.data — the tokens a job trains on, in an order that survives any re-plan.

- `TokenDataLoader`: global batches by step, sliced per dp rank, whose only state is the
  global sample cursor; `permute`, the seeded O(1) permutation behind the order.
- Sources: `SyntheticSource`, `TokenFileSource` (a flat token file); `open_source`.
- `prepare_token_file`: byte-level tokens of text files into a flat token file; `EOS_ID`.

Names resolve lazily (PEP 562): importing this package imports neither torch nor a tokenizer.
"""
from __future__ import annotations

from tenax.faces import lazy_face

_MODULES = {
    "loader": ("EOS_ID", "SyntheticSource", "TokenDataLoader", "TokenFileSource", "TokenSource",
               "open_source", "permute", "prepare_token_file"),
}

__all__, __getattr__, __dir__ = lazy_face(__name__, _MODULES)
