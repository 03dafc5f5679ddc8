"""Hugging Face `config.json` <-> the job spec's `model` section (torch-free).

Why torch-free: the spec validates `model.init_from` against the directory's config.json when it
is loaded (CLI, controller, service), and those processes must not import torch. Llama
(`model_type: llama`, SwiGLU, no biases, head_dim = hidden_size / num_attention_heads) maps onto
the dense decoder and Mixtral (`model_type: mixtral`, the same plus routed experts, no sliding
window) onto `model.moe`; anything else is refused by name rather than loaded into the wrong
shape.

Mixtral and Tenax route alike (softmax over all experts in float32, top_k, the k weights
renormalised), but HF's Mixtral is dropless while Tenax drops assignments past its capacity, so
the two compute the same function only where nothing is dropped (`dropless_note`).
"""
from __future__ import annotations

import json
import logging
import math
from typing import Any

from tenax.workers.hf.errors import HFConfigError

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
# The model keys an HF config fixes; seq_len is a training choice and is not compared.
SHAPE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden",
              "norm_eps", "rope_theta", "rope_scaling", "tie_embeddings")
DEFAULTS: dict[str, Any] = {"n_kv_heads": 4, "rope_theta": 10000.0, "rope_scaling": None,
                            "norm_eps": 1e-5, "tie_embeddings": False}
SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings")
HF_DTYPES = ("float32", "bfloat16", "float16")
MODEL_TYPES = ("llama", "mixtral")
# The MoE keys a Mixtral config fixes (spec key -> HF key); capacity_factor and aux_loss_coef
# are Tenax's training choices and stay the spec's.
MOE_KEYS = {"num_experts": "num_local_experts", "top_k": "num_experts_per_tok"}
# config.json keys no model key fixes; an export keeps the source's (inherited_from_source).
INHERITED_KEYS = ("max_position_embeddings", "bos_token_id", "eos_token_id")


def join_uri(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}"


def read_text(uri: str) -> str:
    """A small text file from a local path or any fsspec URI."""
    import fsspec

    with fsspec.open(uri, "r", encoding="utf-8") as handle:
        return handle.read()


def read_hf_config(root: str) -> dict[str, Any]:
    """The parsed config.json under `root`; HFConfigError naming the file on any failure."""
    uri = join_uri(root, CONFIG_NAME)
    try:
        raw = json.loads(read_text(uri))
    except (OSError, ValueError) as exc:
        raise HFConfigError(f"model.init_from: cannot read {uri}: {type(exc).__name__}: "
                            f"{str(exc)[:200]}") from None
    if not isinstance(raw, dict):
        raise HFConfigError(f"model.init_from: {uri} is not a JSON object")
    return raw


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, Llama 3.1 scaling or None) from either the legacy `rope_theta`/`rope_scaling`
    keys (published checkpoints) or transformers 5's `rope_parameters`."""
    params = cfg.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type") not in
                                          (None, "default") else None)
    if not scaling or scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        return theta, None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3":
        raise HFConfigError(f"config.json: rope scaling type {kind!r} is not supported "
                            f"(only 'llama3')")
    missing = [k for k in SCALING_KEYS if k not in scaling]
    if missing:
        raise HFConfigError(f"config.json: llama3 rope scaling lacks {missing}")
    out = {k: float(scaling[k]) for k in SCALING_KEYS}
    out["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
    return theta, out


def _refuse_unmapped(cfg: dict[str, Any]) -> None:
    kind = cfg.get("model_type")
    if kind not in MODEL_TYPES:
        raise HFConfigError(f"config.json: model_type {kind!r} is not supported (only "
                            f"{' and '.join(repr(k) for k in MODEL_TYPES)})")
    if kind == "mixtral" and cfg.get("sliding_window") is not None:
        raise HFConfigError(f"config.json: sliding_window={cfg['sliding_window']!r} is not "
                            f"supported (Tenax's attention is full causal)")
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if key in cfg and cfg[key] != want:
            raise HFConfigError(f"config.json: {key}={cfg[key]!r} is not supported "
                                f"(Tenax's decoder has {key}={want!r})")
    heads = int(cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim")
    if head_dim is not None and int(head_dim) * heads != int(cfg["hidden_size"]):
        raise HFConfigError(f"config.json: head_dim={head_dim} is not hidden_size / "
                            f"num_attention_heads = {cfg['hidden_size']} / {heads}")


def model_fields_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    """The spec's `model` keys a Llama or Mixtral config.json fixes (`moe`: None, or its
    num_experts and top_k), plus a `seq_len` suggestion."""
    try:
        _refuse_unmapped(cfg)
        theta, scaling = _rope(cfg)
        heads = int(cfg["num_attention_heads"])
        fields = {"dim": int(cfg["hidden_size"]), "n_layers": int(cfg["num_hidden_layers"]),
                  "n_heads": heads, "n_kv_heads": int(cfg.get("num_key_value_heads") or heads),
                  "vocab_size": int(cfg["vocab_size"]),
                  "ffn_hidden": int(cfg["intermediate_size"]),
                  "norm_eps": float(cfg.get("rms_norm_eps", 1e-6)), "rope_theta": theta,
                  "rope_scaling": scaling,
                  "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
                  "moe": ({k: int(cfg[v]) for k, v in MOE_KEYS.items()}
                          if cfg["model_type"] == "mixtral" else None)}
    except KeyError as exc:
        raise HFConfigError(f"config.json: required key {exc.args[0]!r} is missing") from None
    except (TypeError, ValueError) as exc:
        if isinstance(exc, HFConfigError):
            raise
        raise HFConfigError(f"config.json: {type(exc).__name__}: {exc}") from None
    context = scaling["original_max_position_embeddings"] if scaling else \
        cfg.get("max_position_embeddings", 2048)
    fields["seq_len"] = int(context)
    return fields


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, float) or isinstance(b, float):
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
        except (TypeError, ValueError):
            return False
    return a == b


def config_differences(model: dict[str, Any], hf: dict[str, Any]) -> list[str]:
    """One line per shape key where the spec's model section and the HF config differ."""
    out = []
    for key in SHAPE_KEYS:
        mine = model.get(key)
        if not _same(mine, hf[key]):
            out.append(f"model.{key}: the spec has {mine!r}, config.json has {hf[key]!r}")
    return out + _moe_differences(model.get("moe"), hf.get("moe"))


def _moe_differences(mine: dict[str, Any] | None, hf: dict[str, Any] | None) -> list[str]:
    if hf is None:
        return [] if mine is None else [
            f"model.moe: the spec has {mine!r}, config.json describes a dense Llama (no experts)"]
    if mine is None:
        return [f"model.moe: the spec has None, config.json describes a Mixtral with "
                f"num_experts={hf['num_experts']}, top_k={hf['top_k']}"]
    return [f"model.moe.{key}: the spec has {mine.get(key)!r}, config.json has {hf[key]!r} "
            f"({hf_key})" for key, hf_key in MOE_KEYS.items() if mine.get(key) != hf[key]]


def moe_defaults() -> dict[str, Any]:
    """The spec's `model.moe` defaults (a partial moe mapping is compared with them filled)."""
    from tenax.workers.spec_sections import MoESpec

    return {k: f.default for k, f in MoESpec.model_fields.items()}


def dropless_note(moe: dict[str, Any]) -> tuple[bool, str]:
    """(drops possible, why HF's logits may differ): HF's Mixtral sends every token to its
    top_k experts, Tenax drops assignments past C = ceil(capacity_factor * T * top_k / E) per
    expert; an expert gets at most T assignments, so capacity_factor >= E / top_k drops none."""
    moe = {**moe_defaults(), **moe}
    bound = moe["num_experts"] / moe["top_k"]
    head = ("HF's MixtralForCausalLM is dropless (every token reaches its top_k experts) while "
            "Tenax drops expert assignments past moe.capacity_factor, so HF's logits equal "
            "Tenax's only where no assignment was dropped")
    if moe["capacity_factor"] >= bound:
        return False, (f"{head}; here capacity_factor={moe['capacity_factor']:g} >= "
                       f"num_experts/top_k={bound:g}, so Tenax drops none and the two agree")
    return True, (f"{head}; here capacity_factor={moe['capacity_factor']:g} < "
                  f"num_experts/top_k={bound:g}, so Tenax's forward may drop assignments that "
                  f"HF computes (capacity_factor >= {bound:g} guarantees no drops)")


def inherited_from_source(model: dict[str, Any], init_from: str | None) -> dict[str, Any]:
    """The config.json keys a model section cannot hold (INHERITED_KEYS), from the HF
    directory the job started from (`init_from`) while it is readable and still describes
    `model`; {} otherwise. Why: e.g. Llama 3.1's max_position_embeddings (131072) follows from
    no model key, and its token ids are what the vocabulary was trained with."""
    if not init_from:
        return {}
    try:
        cfg = read_hf_config(init_from)
        diffs = config_differences(model, model_fields_from_hf(cfg))
    except (HFConfigError, ImportError, OSError, ValueError) as exc:
        logger.info("model.init_from %s unreadable (%s): config.json's %s from the model "
                    "section alone", init_from, exc, ", ".join(INHERITED_KEYS))
        return {}
    if diffs:
        logger.info("model.init_from %s no longer describes this model (%s): not taking its "
                    "%s", init_from, diffs[0], ", ".join(INHERITED_KEYS))
        return {}
    return {k: cfg[k] for k in INHERITED_KEYS if cfg.get(k) is not None}


def _max_positions(model: dict[str, Any], inherited: dict[str, Any]) -> int:
    """The job's seq_len, or more: the source's own context, else under rope scaling at least
    the original context times the factor (HF expects it to exceed the original one)."""
    max_pos = int(model["seq_len"])
    scaling = model.get("rope_scaling")
    if "max_position_embeddings" in inherited:
        return max(max_pos, int(inherited["max_position_embeddings"]))
    if scaling:
        return max(max_pos, int(scaling["original_max_position_embeddings"] * scaling["factor"]))
    return max_pos


def hf_config_from_model(model: dict[str, Any], dtype: str,
                         token_ids: dict[str, int | None] | None = None,
                         inherited: dict[str, Any] | None = None) -> dict[str, Any]:
    """A LlamaForCausalLM config.json for the spec's `model` section (a plain mapping), or a
    MixtralForCausalLM one when `moe` is set. `token_ids` are the job's tokenizer's;
    `inherited` the source's keys (`inherited_from_source`): its context, and its token ids
    when the job has no tokenizer."""
    if dtype not in HF_DTYPES:
        raise HFConfigError(f"--dtype: {dtype!r} must be one of {HF_DTYPES}")
    scaling = model.get("rope_scaling")
    inherited = inherited or {}
    max_pos = _max_positions(model, inherited)
    own = {k: v for k, v in (token_ids or {}).items() if v is not None}
    ids = {"bos_token_id": None, "eos_token_id": None, **(own or {
        k: inherited[k] for k in ("bos_token_id", "eos_token_id") if k in inherited})}
    common = {
        "hidden_size": model["dim"], "intermediate_size": model["ffn_hidden"],
        "num_hidden_layers": model["n_layers"], "num_attention_heads": model["n_heads"],
        "num_key_value_heads": model["n_kv_heads"], "head_dim": model["dim"] // model["n_heads"],
        "vocab_size": model["vocab_size"], "max_position_embeddings": max_pos,
        "rope_theta": float(model.get("rope_theta", 10000.0)),
        "rope_scaling": {"rope_type": "llama3", **scaling} if scaling else None,
        "rms_norm_eps": float(model.get("norm_eps", 1e-5)),
        "tie_word_embeddings": bool(model.get("tie_embeddings", False)),
        "hidden_act": "silu", "torch_dtype": dtype, "dtype": dtype, "use_cache": True, **ids,
    }
    if model.get("moe") is None:
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common,
                "attention_bias": False, "mlp_bias": False}
    moe = {**moe_defaults(), **model["moe"]}
    # sliding_window null: Mixtral's default has varied across transformers versions and
    # vLLM reads it; Tenax attends over the whole causal context.
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **common,
            "num_local_experts": int(moe["num_experts"]),
            "num_experts_per_tok": int(moe["top_k"]),
            "router_aux_loss_coef": float(moe["aux_loss_coef"]), "router_jitter_noise": 0.0,
            "output_router_logits": False, "sliding_window": None}


SCALING_DEFAULTS = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}


def _plain(key: str, value: Any) -> Any:
    """A spec value as plain JSON-like data (a pydantic section dumped, scaling defaults in)."""
    if hasattr(value, "model_dump"):
        value = value.model_dump()
    if key == "rope_scaling" and isinstance(value, dict):
        value = {**SCALING_DEFAULTS, **value}
    if key == "moe" and isinstance(value, dict):
        value = {**moe_defaults(), **value}
    return value


def _fill_moe(out: dict[str, Any], hf_moe: dict[str, Any] | None) -> None:
    """from_hf: the experts and top_k of a Mixtral config, where the spec leaves them out
    (an explicit `moe: null` stays, and is then reported as a difference)."""
    if hf_moe is None:
        return
    if "moe" not in out:
        out["moe"] = dict(hf_moe)
    elif isinstance(out["moe"], dict):
        out["moe"] = {**hf_moe, **out["moe"]}


def check_model_section(data: Any, fields: dict[str, Any]) -> Any:
    """The spec's raw `model` mapping, checked against (and with `from_hf`, completed from)
    the config.json of `init_from`; `fields` are ModelSpec's pydantic fields (defaults)."""
    if not isinstance(data, dict):
        return data
    if not data.get("init_from"):
        if data.get("from_hf"):
            raise HFConfigError("model.from_hf: true needs model.init_from (a directory with "
                                "config.json and safetensors)")
        return data
    root = str(data["init_from"])
    hf = model_fields_from_hf(read_hf_config(root))
    out = dict(data)
    if out.get("from_hf"):
        for key in (*SHAPE_KEYS, "seq_len"):
            out.setdefault(key, hf[key])
        _fill_moe(out, hf["moe"])
    effective = {k: _plain(k, out[k] if k in out else fields[k].default)
                 for k in (*SHAPE_KEYS, "moe")}
    diffs = config_differences(effective, hf)
    if diffs:
        hint = "from_hf fills only the keys the spec leaves out" if out.get("from_hf") else \
            "set model.from_hf: true to take its values"
        raise HFConfigError(f"model.init_from: {root}/config.json does not match the spec "
                            f"({hint}): " + "; ".join(diffs))
    return out
