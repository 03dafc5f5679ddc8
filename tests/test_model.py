"""Tests for parallel/model.py: layout-independent init, pipeline-stage tolerance, attention maths,
and that the model actually learns."""
from __future__ import annotations

import json
import logging
import math
from typing import Any

import pytest
import torch
from torch import nn

from tenax.parallel.config import ModelArgs
from tenax.parallel.model import (Attention, Transformer, build_model, cross_entropy_sum,
                                  init_weights, param_seed, rotary_cos_sin)
from tenax.workers.data import TokenDataLoader
from tenax.workers.spec import DataSpec
from tests.distributed import run_ranks

logger = logging.getLogger(__name__)
torch.set_num_threads(1)

SEED = 1234


def tiny_spec(**overrides: Any) -> ModelArgs:
    base: dict[str, Any] = dict(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64,
                                seq_len=16, ffn_hidden=48)
    base.update(overrides)
    return ModelArgs.from_dict(base)


def assert_same_params(a: nn.Module, b: nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert sorted(pa) == sorted(pb)
    for name in pa:
        assert torch.equal(pa[name].detach(), pb[name].detach()), name


def test_init_depends_only_on_seed_and_name() -> None:
    spec = tiny_spec()
    reference = build_model(spec, SEED)

    # Built eagerly on CPU (default init consumes the global RNG), layers re-inserted in reverse
    # order so parameters are visited in a different order, and the global RNG perturbed.
    torch.manual_seed(99)
    shuffled = Transformer(spec)
    names = reversed(list(shuffled.layers))
    shuffled.layers = nn.ModuleDict({k: shuffled.layers[k] for k in names})
    torch.rand(1000)
    init_weights(shuffled, SEED)
    assert_same_params(reference, shuffled)

    with torch.device("meta"):
        meta = Transformer(spec)
    meta.to_empty(device="cpu")
    init_weights(meta, SEED)
    assert_same_params(reference, meta)

    other = build_model(spec, SEED + 1)
    for name, p in reference.named_parameters():
        if not name.endswith("norm.weight"):
            assert not torch.equal(p, dict(other.named_parameters())[name]), name


def test_init_distributions_and_distinct_names() -> None:
    spec = tiny_spec(dim=64, ffn_hidden=128)
    params = dict(build_model(spec, SEED).named_parameters())
    assert torch.equal(params["norm.weight"], torch.ones(64))
    assert torch.equal(params["layers.2.ffn_norm.weight"], torch.ones(64))
    assert params["tok_embeddings.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    scaled = 0.02 / math.sqrt(2 * spec.n_layers)
    assert params["layers.1.attention.wo.weight"].std().item() == pytest.approx(scaled, rel=0.1)
    assert params["layers.1.feed_forward.w2.weight"].std().item() == pytest.approx(scaled, rel=0.1)
    # Same shape, different names -> different values.
    assert not torch.equal(params["layers.0.attention.wq.weight"],
                           params["layers.1.attention.wq.weight"])
    # Wrapper name parts do not change the seed.
    assert param_seed(3, "layers.0._checkpoint_wrapped_module.attention.wq.weight") == \
        param_seed(3, "layers.0.attention.wq.weight")


def test_init_rejects_meta_parameters() -> None:
    with torch.device("meta"):
        model = Transformer(tiny_spec())
    with pytest.raises(ValueError, match="meta device"):
        init_weights(model, SEED)


def test_pipeline_stages_keep_names_values_and_compose() -> None:
    spec = tiny_spec()
    full = build_model(spec, SEED)
    first, second = build_model(spec, SEED), build_model(spec, SEED)
    del first.layers["2"], first.layers["3"]
    first.norm, first.output = None, None
    del second.layers["0"], second.layers["1"]
    second.tok_embeddings = None
    # Re-initialising a stage alone reproduces the full model's values under the same names.
    init_weights(first, SEED)
    init_weights(second, SEED)
    full_params = dict(full.named_parameters())
    for stage in (first, second):
        for name, p in stage.named_parameters():
            assert torch.equal(p, full_params[name]), name
    assert "layers.3.attention.wq.weight" in dict(second.named_parameters())

    tokens = torch.randint(0, spec.vocab_size, (2, spec.seq_len))
    hidden = first(tokens)
    assert hidden.shape == (2, spec.seq_len, spec.dim)
    torch.testing.assert_close(second(hidden), full(tokens))


def test_forward_shapes_and_causality() -> None:
    spec = tiny_spec()
    model = build_model(spec, SEED)
    tokens = torch.randint(0, spec.vocab_size, (3, spec.seq_len))
    logits = model(tokens)
    assert logits.shape == (3, spec.seq_len, spec.vocab_size)
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % spec.vocab_size
    logits2 = model(changed)
    torch.testing.assert_close(logits2[:, :10], logits[:, :10])
    assert not torch.allclose(logits2[:, 10:], logits[:, 10:])


def reference_attention(attn: Attention, x: torch.Tensor, n_heads: int, n_kv: int) -> torch.Tensor:
    """Loop over heads, kv head = q head // group, rotary as complex multiplication, explicit
    mask."""
    b, s, _ = x.shape
    hd = attn.head_dim
    q = attn.wq(x).view(b, s, n_heads, hd)
    k = attn.wk(x).view(b, s, n_kv, hd)
    v = attn.wv(x).view(b, s, n_kv, hd)
    freqs = 1.0 / 10000.0 ** (torch.arange(0, hd, 2).float() / hd)
    rot = torch.polar(torch.ones(s, hd // 2), torch.arange(s).float()[:, None] * freqs)

    def rotate(t: torch.Tensor) -> torch.Tensor:
        c = torch.complex(t[..., : hd // 2], t[..., hd // 2:]) * rot[None, :, None, :]
        return torch.cat((c.real, c.imag), dim=-1)

    q, k = rotate(q), rotate(k)
    mask = torch.ones(s, s).tril().bool()
    heads = []
    for h in range(n_heads):
        kv = h // (n_heads // n_kv)
        scores = q[:, :, h] @ k[:, :, kv].transpose(1, 2) / math.sqrt(hd)
        scores = scores.masked_fill(~mask, float("-inf"))
        heads.append(scores.softmax(-1) @ v[:, :, kv])
    return attn.wo(torch.cat(heads, dim=-1))


@pytest.mark.parametrize("n_heads,n_kv", [(4, 2), (4, 1), (4, 4)])
def test_gqa_matches_reference(n_heads: int, n_kv: int) -> None:
    spec = tiny_spec(n_heads=n_heads, n_kv_heads=n_kv)
    attn = build_model(spec, SEED).layers["0"].attention
    x = torch.randn(2, spec.seq_len, spec.dim)
    cos, sin = rotary_cos_sin(torch.arange(spec.seq_len), spec.head_dim)
    torch.testing.assert_close(attn(x, cos, sin), reference_attention(attn, x, n_heads, n_kv))


def test_explicit_positions() -> None:
    spec = tiny_spec()
    model = build_model(spec, SEED)
    tokens = torch.randint(0, spec.vocab_size, (2, spec.seq_len))
    default = model(tokens)
    arange = torch.arange(spec.seq_len)
    torch.testing.assert_close(model(tokens, arange), default)
    torch.testing.assert_close(model(tokens, arange.expand(2, -1)), default)
    # Rotary is relative: a constant shift of all positions leaves the output unchanged ...
    torch.testing.assert_close(model(tokens, arange + 100), default, atol=1e-4, rtol=1e-4)
    # ... but positions really are used: spreading them out changes it.
    assert not torch.allclose(model(tokens, arange * 3), default, atol=1e-4)
    with pytest.raises(ValueError, match="positions"):
        model(tokens, torch.arange(spec.seq_len + 1))


def test_cross_entropy_sum() -> None:
    logits = torch.randn(2, 5, 11)
    targets = torch.randint(0, 11, (2, 5))
    loss_sum, n = cross_entropy_sum(logits, targets)
    assert n == 10
    expected = torch.nn.functional.cross_entropy(logits.view(-1, 11), targets.view(-1))
    torch.testing.assert_close(loss_sum / n, expected)
    with pytest.raises(ValueError, match="targets shape"):
        cross_entropy_sum(logits, targets[:, :4])


def test_moe_spec_builds_moe_feed_forward() -> None:
    from tenax.parallel.expert_parallel import MoEFeedForward

    spec = tiny_spec(moe={"num_experts": 4, "top_k": 2})
    model = build_model(spec, SEED)
    assert all(isinstance(b.feed_forward, MoEFeedForward) for b in model.layers.values())
    assert sum(p.numel() for p in model.parameters()) == spec.num_params()


def test_loss_decreases_on_synthetic_data() -> None:
    spec = tiny_spec(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, seq_len=32,
                     ffn_hidden=128)
    model = build_model(spec, SEED)
    loader = TokenDataLoader(DataSpec(), spec.seq_len, spec.vocab_size, SEED, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        inputs, targets = loader.next_batch(0, 1)
        loss_sum, n = cross_entropy_sum(model(inputs), targets)
        loss = loss_sum / n
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(spec.vocab_size), rel=0.1)
    assert sum(losses[-5:]) / 5 < 0.6 * losses[0], losses


TP_PLAN_KEYS = {"attention.wq": "col", "attention.wk": "col", "attention.wv": "col",
                "attention.wo": "row", "feed_forward.w1": "col", "feed_forward.w3": "col",
                "feed_forward.w2": "row"}


def _shard(model: Transformer, mode: str) -> None:
    """Apply 2-way TP (attention and FFN projections) or FSDP2 full sharding, on the meta device."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    mesh = init_device_mesh("cpu", (2,))
    if mode == "tp":
        plan = {f"layers.*.{k}": ColwiseParallel() if v == "col" else RowwiseParallel()
                for k, v in TP_PLAN_KEYS.items()}
        parallelize_module(model, mesh, plan)
    else:
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)


def _dist_worker(rank: int, world: int, mode: str, spec_json: str) -> dict[str, Any]:
    """One rank: build on meta, shard, materialise, init; return full params and logits."""
    from torch.distributed.tensor import DTensor

    spec = ModelArgs.from_dict(json.loads(spec_json))
    with torch.device("meta"):
        model = Transformer(spec)
    _shard(model, mode)
    model.to_empty(device="cpu")
    init_weights(model, SEED)
    n_dtensors = sum(isinstance(p, DTensor) for p in model.parameters())
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}
    tokens = torch.arange(2 * spec.seq_len).view(2, spec.seq_len) % spec.vocab_size
    with torch.no_grad():
        logits = model(tokens)
    return {"params": full, "logits": logits, "n_dtensors": n_dtensors}


@pytest.mark.parametrize("mode", ["tp", "fsdp"])
def test_sharded_init_and_forward_match_single_process(mode: str) -> None:
    """Sharded on meta then initialised in fresh processes (each with its own hash() salt), the
    gathered parameters and the logits equal the single-process model's."""
    spec = tiny_spec(n_layers=2)
    results = run_ranks(_dist_worker, 2, mode, json.dumps(spec.to_dict()), timeout_s=120)
    reference = build_model(spec, SEED)
    ref_params = dict(reference.named_parameters())
    expected = len(TP_PLAN_KEYS) * spec.n_layers if mode == "tp" else len(ref_params)
    tokens = torch.arange(2 * spec.seq_len).view(2, spec.seq_len) % spec.vocab_size
    with torch.no_grad():
        ref_logits = reference(tokens)
    for result in results:
        assert result["n_dtensors"] == expected
        assert sorted(result["params"]) == sorted(ref_params)
        for name, value in result["params"].items():
            assert torch.equal(value, ref_params[name]), name
        torch.testing.assert_close(result["logits"], ref_logits, atol=1e-5, rtol=1e-5)
