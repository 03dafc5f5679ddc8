"""A job started from Hugging Face weights that resumes after its `model.init_from` is gone.

A resuming job loads its own checkpoint and never reads `init_from` again, but the spec check
that compares (and with `from_hf`, completes) the model section against the directory's
config.json would still need it. Weeks into a run the directory may have been cleaned up or
moved; the newest committed manifest carries the job's model section, so the spec takes the
keys it leaves out from there and drops the weight source. The checkpoint load still compares
the model hash, so a spec whose explicit keys disagree with the checkpoint is refused there.
"""
from __future__ import annotations

import logging
from typing import Any

from tenax.workers.hf.config import read_hf_config
from tenax.workers.hf.errors import HFConfigError
from tenax.workers.spec_sections import SOURCE_KEYS, CheckpointSpec

logger = logging.getLogger(__name__)


def saved_model_section(checkpoint_uri: str) -> dict[str, Any] | None:
    """The `model` section saved with the newest committed version; None when there is none
    or the storage cannot be listed (the caller's own error then says what is missing)."""
    from tenax.checkpoint import Catalog, CatalogError, Storage, StorageError

    try:
        manifest = Catalog(Storage(checkpoint_uri)).latest_committed(verify=False)
    except (CatalogError, StorageError, OSError, ValueError) as exc:
        logger.info("cannot list %s (%s): model.init_from stays required", checkpoint_uri, exc)
        return None
    saved = (manifest.extra.get("spec") or {}).get("model") if manifest is not None else None
    return dict(saved) if isinstance(saved, dict) else None


def without_lost_source(raw: Any) -> Any:
    """The raw job spec, with the model section completed from the checkpoint and its weight
    source dropped, when `model.init_from` cannot be read and the job resumes; else as given."""
    model = raw.get("model") if isinstance(raw, dict) else None
    if not isinstance(model, dict) or not model.get("init_from"):
        return raw
    try:
        read_hf_config(str(model["init_from"]))
        return raw
    except HFConfigError as exc:
        unreadable = str(exc)
    section = raw.get("checkpoint")
    uri = section.get("uri") if isinstance(section, dict) else None
    saved = saved_model_section(uri if isinstance(uri, str) and uri else
                                CheckpointSpec.model_fields["uri"].default)
    if saved is None:
        return raw  # a fresh job: the model section's own check names the unreadable file
    kept = {k: v for k, v in model.items() if k not in SOURCE_KEYS}
    completed = {**{k: v for k, v in saved.items() if k not in SOURCE_KEYS}, **kept}
    logger.warning("model.init_from ignored: the job resumes from its checkpoint and %s; the "
                   "model keys the spec leaves out come from the checkpoint's saved spec",
                   unreadable.removeprefix("model.init_from: "))
    return {**raw, "model": completed}
