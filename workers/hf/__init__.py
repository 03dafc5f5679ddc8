"""tenax.workers.hf — Tenax weights in and out of Hugging Face (Llama; Mixtral for MoE).

- `config`: HF config.json <-> the spec's `model` section (torch-free; the spec uses it).
- `names`: Tenax parameter names <-> HF names, and the per-tensor layout change.
- `safetensors_io`: safetensors headers read and written tensor by tensor (fsspec).
- `source`: the checkpoint version an export reads, checked against a given `--spec`.
- `export`: a committed checkpoint (any layout) -> an HF directory, one shard at a time.
- `load`: `model.init_from` -> this rank's parameters, in any layout.

Names resolve lazily (PEP 562), so importing the package imports no torch.
"""
from __future__ import annotations

from tenax.faces import lazy_face

_MODULES = {
    "errors": ("ExportError", "HFConfigError", "HFLoadError", "NameMapError", "SafetensorsError"),
    "config": ("check_model_section", "dropless_note", "hf_config_from_model",
               "model_fields_from_hf", "read_hf_config"),
    "names": ("hf_name", "hf_parts", "is_stacked_expert", "tenax_name"),
    "safetensors_io": ("StreamingWriter", "read_index", "read_tensor"),
    "export": ("export_hf",),
    "load": ("ExpertStack", "check_hf_weights", "check_init_from", "load_hf_into"),
}

__all__, __getattr__, __dir__ = lazy_face(__name__, _MODULES)
