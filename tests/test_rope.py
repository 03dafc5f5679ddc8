"""Rotary embeddings against Hugging Face's own code: theta, Llama 3.1 scaling, pairing.

The references are transformers' functions (ROPE_INIT_FUNCTIONS, apply_rotary_pos_emb,
LlamaForCausalLM) on tiny configs built here; nothing is downloaded.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tenax.parallel import ModelArgs, RopeScalingArgs, rotary_cos_sin, rotary_inv_freq
from tenax.parallel.model import apply_rotary
from tests import hf_jobs

transformers = pytest.importorskip("transformers")

SCALING = RopeScalingArgs(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64)


def hf_inv_freq(head_dim: int, theta: float, scaling: RopeScalingArgs | None) -> torch.Tensor:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = hf_jobs.tiny_llama_config(hidden_size=head_dim * 4, num_attention_heads=4,
                                       rope_theta=theta, max_position_embeddings=1024)
    if scaling is None:
        return ROPE_INIT_FUNCTIONS["default"](config, "cpu")[0] \
            if "default" in ROPE_INIT_FUNCTIONS else \
            1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    config.rope_parameters = {"rope_type": "llama3", "rope_theta": theta,
                              "factor": scaling.factor,
                              "low_freq_factor": scaling.low_freq_factor,
                              "high_freq_factor": scaling.high_freq_factor,
                              "original_max_position_embeddings":
                                  scaling.original_max_position_embeddings}
    return ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")[0]


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
@pytest.mark.parametrize("scaled", [False, True])
def test_inv_freq_matches_hf(theta: float, scaled: bool) -> None:
    scaling = SCALING if scaled else None
    ours = rotary_inv_freq(64, theta, scaling)
    theirs = hf_inv_freq(64, theta, scaling)
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
    if scaled:  # the scaling must have moved some frequencies, or the test proves nothing
        assert not torch.allclose(ours, rotary_inv_freq(64, theta))


def test_default_theta_is_unchanged() -> None:
    """The defaults give today's frequencies bit for bit (checkpoints' models unchanged)."""
    head_dim = 32
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    torch.testing.assert_close(rotary_inv_freq(head_dim), 1.0 / (10000.0 ** exponents),
                               rtol=0, atol=0)
    args = ModelArgs()
    assert (args.rope_theta, args.rope_scaling, args.norm_eps, args.tie_embeddings) == \
        (10000.0, None, 1e-5, False)


def test_apply_rotary_is_hf_rotate_half() -> None:
    """Tenax's half-split pairing is HF's rotate_half: q/k need no permutation."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    b, s, h, d = 2, 7, 3, 16
    q, k = torch.randn(b, s, h, d), torch.randn(b, s, h, d)
    positions = torch.arange(s)
    cos, sin = rotary_cos_sin(positions, d, 500000.0, SCALING)
    ours_q, ours_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    hf_cos = torch.cat([cos, cos], dim=-1).squeeze(2)  # [1, s, d]
    hf_sin = torch.cat([sin, sin], dim=-1).squeeze(2)
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), hf_cos, hf_sin)
    torch.testing.assert_close(ours_q, hf_q.transpose(1, 2), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours_k, hf_k.transpose(1, 2), rtol=1e-6, atol=1e-6)


def _tenax_from_hf_dir(path: Path, args: ModelArgs, tokens: torch.Tensor) -> torch.Tensor:
    from tenax.parallel import Transformer, tie_output
    from tenax.workers.hf.load import load_hf_into

    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    tie_output(model)
    load_hf_into([model], args, str(path))
    with torch.no_grad():
        return model(tokens).float()


@pytest.mark.parametrize("scaled", [False, True])
def test_llama3_rope_logits_match_hf(tmp_path: Path, scaled: bool) -> None:
    """rope_theta 500000 (and Llama 3.1 scaling, with a context short enough that the scaled
    band covers the test's positions) give HF's logits."""
    # norm eps 0.1 (not the 1e-5 default): a dropped or misread eps changes the logits. With
    # HF's 0.02 init std, an eps that large flattens the attention scores until rope no longer
    # shows; std 0.2 keeps both visible (checked below)
    overrides: dict = {"rope_theta": 500000.0, "max_position_embeddings": 64,
                       "rms_norm_eps": 0.1, "initializer_range": 0.2}
    scaling = RopeScalingArgs(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=8) if scaled else None
    if scaling is not None:
        overrides["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8}
    hf = hf_jobs.random_hf_model(tmp_path / "hf", **overrides)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, seq_len=32,
                     ffn_hidden=96, rope_theta=500000.0, rope_scaling=scaling, norm_eps=0.1)
    tokens = hf_jobs.tokens_for(seq=32)
    ours = _tenax_from_hf_dir(tmp_path / "hf", args, tokens)
    theirs = hf_jobs.hf_logits(hf, tokens)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    # without the scaling (or with the old theta), or with the default eps, the logits must
    # differ, or nothing is tested
    for changed in ({"rope_scaling": None} if scaled else {"rope_theta": 10000.0},
                    {"norm_eps": 1e-5}):
        other = _tenax_from_hf_dir(tmp_path / "hf",
                                   ModelArgs.from_dict({**args.to_dict(), **changed}), tokens)
        assert not torch.allclose(other, theirs, rtol=1e-5, atol=1e-5), \
            f"{changed} made no difference: the test cannot fail"


def test_rope_scaling_band_is_continuous() -> None:
    """At the band's edges the blend equals the pure rules (no jump in frequency)."""
    inv = rotary_inv_freq(128, 500000.0, SCALING)
    base = rotary_inv_freq(128, 500000.0)
    wavelen = 2 * math.pi / base
    long = wavelen > SCALING.original_max_position_embeddings / SCALING.low_freq_factor
    short = wavelen < SCALING.original_max_position_embeddings / SCALING.high_freq_factor
    torch.testing.assert_close(inv[long], base[long] / SCALING.factor)
    torch.testing.assert_close(inv[short], base[short])
    assert (inv <= base).all() and (inv >= base / SCALING.factor - 1e-12).all()


def test_config_json_round_trip(tmp_path: Path) -> None:
    """transformers 5 writes `rope_parameters`; published configs `rope_theta`/`rope_scaling`.
    Both read back to the same model keys, and the exported config reads back in HF."""
    import json

    from transformers import LlamaConfig

    from tenax.workers.hf.config import hf_config_from_model, model_fields_from_hf, read_hf_config

    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8}
    config = hf_jobs.tiny_llama_config(rope_theta=500000.0, max_position_embeddings=64,
                                       rope_scaling={"rope_type": "llama3", **scaling},
                                       tie_word_embeddings=True)
    config.save_pretrained(str(tmp_path / "v5"))
    fields = model_fields_from_hf(read_hf_config(str(tmp_path / "v5")))
    assert (fields["rope_theta"], fields["rope_scaling"], fields["seq_len"]) == \
        (500000.0, scaling, 8)
    assert fields["tie_embeddings"] and fields["dim"] == 64 and fields["n_kv_heads"] == 2
    exported = hf_config_from_model({**fields, "moe": None}, "float32")
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / "config.json").write_text(json.dumps(exported))
    back = LlamaConfig.from_pretrained(str(tmp_path / "ours"))
    assert back.rope_parameters == config.rope_parameters
    assert model_fields_from_hf(read_hf_config(str(tmp_path / "ours"))) == fields
