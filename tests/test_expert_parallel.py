"""Tests for parallel/expert_parallel.py: routing maths against a per-token loop, exact drop counts,
ep=2/4 against the single-process reference on each rank's chunk, all-to-all bytes, init across
ep, and that a Transformer with MoE layers trains."""
from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from tenax.parallel.config import ModelArgs, MoEArgs
from tenax.parallel.expert_parallel import (MoEFeedForward, MoEStats, apply_ep, is_expert_param,
                                            moe_aux_loss, moe_stats)
from tenax.parallel.model import Transformer, build_model, cross_entropy_sum, init_weights
from tenax.workers.data import TokenDataLoader
from tenax.workers.spec import DataSpec
from tests.distributed import run_ranks

logger = logging.getLogger(__name__)
torch.set_num_threads(1)

SEED = 4321
TOL = dict(atol=1e-5, rtol=1e-5)


def make_layer(capacity_factor: float, num_experts: int = 4, top_k: int = 2, dim: int = 8,
               hidden: int = 12) -> MoEFeedForward:
    layer = MoEFeedForward(dim, hidden, MoEArgs(num_experts=num_experts, top_k=top_k,
                                                capacity_factor=capacity_factor))
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return layer


def naive_moe(layer: MoEFeedForward, x: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Per-token loop: (output, dropped assignments, aux loss) with slot-major capacity."""
    n_exp, k = layer.num_experts, layer.top_k
    w1, w3, w2 = (layer.experts[n].weight for n in ("w1", "w3", "w2"))
    probs = torch.softmax(x @ layer.router.weight.t(), dim=-1)
    capacity = math.ceil(layer.capacity_factor * x.shape[0] * k / n_exp)
    choices = [sorted(range(n_exp), key=lambda e: -probs[t, e].item())[:k] for t in range(len(x))]
    used, dropped, rows = [0] * n_exp, 0, [torch.zeros(x.shape[1]) for _ in range(len(x))]
    for slot in range(k):
        for t, chosen in enumerate(choices):
            e = chosen[slot]
            if used[e] >= capacity:
                dropped += 1
                continue
            used[e] += 1
            gate = probs[t, e] / sum(probs[t, c] for c in chosen)
            rows[t] = rows[t] + gate * ((F.silu(x[t] @ w1[e]) * (x[t] @ w3[e])) @ w2[e])
    share = torch.tensor([sum(c.count(e) for c in choices) / (len(x) * k) for e in range(n_exp)])
    return torch.stack(rows), dropped, n_exp * (share * probs.mean(dim=0)).sum()


@pytest.mark.parametrize("capacity_factor", [4.0, 0.5])
def test_forward_and_grads_match_naive_loop(capacity_factor: float) -> None:
    layer = make_layer(capacity_factor)
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1))
    out = layer(x)
    ref_out, ref_dropped, ref_aux = naive_moe(layer, x.reshape(-1, 8))
    torch.testing.assert_close(out.reshape(-1, 8), ref_out, **TOL)
    torch.testing.assert_close(layer.last_aux_loss, ref_aux, **TOL)
    stats = layer.last_stats
    assert stats.dropped == ref_dropped and (ref_dropped > 0) == (capacity_factor < 1)
    assert stats.tokens == 15 and stats.assignments == 30 and sum(stats.tokens_per_expert) == 30

    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out * grad_out).sum().add(layer.last_aux_loss).backward()
    got = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    (ref_out * grad_out.reshape(-1, 8)).sum().add(ref_aux).backward()
    for name, p in layer.named_parameters():
        torch.testing.assert_close(got[name], p.grad, **TOL, msg=name)


def test_drops_counted_exactly_and_contribute_zero() -> None:
    layer = make_layer(capacity_factor=0.5)
    x = torch.randn(40, 8, generator=torch.Generator().manual_seed(3))
    out = layer(x)
    capacity = layer.capacity(40)
    assert capacity == math.ceil(0.5 * 40 * 2 / 4) == 10
    chosen = torch.softmax(x @ layer.router.weight.t(), -1).topk(2, dim=-1).indices
    per_expert = torch.bincount(chosen.reshape(-1), minlength=4)
    expected = int((per_expert - capacity).clamp(min=0).sum())
    assert expected > 0
    stats = layer.last_stats
    assert stats.dropped == expected
    assert stats.tokens_per_expert == tuple(per_expert.tolist())
    assert stats.drop_rate == pytest.approx(expected / 80)
    # First choices have priority: an expert drops a first choice only if first choices alone
    # exceed its capacity; a token that lost both slots gets exactly zero output.
    first = torch.bincount(chosen[:, 0], minlength=4)
    kept_first = torch.minimum(first, torch.tensor(capacity))
    kept_second = torch.minimum(per_expert - first, capacity - kept_first)
    assert expected == 80 - int(kept_first.sum() + kept_second.sum())
    ref_out, _, _ = naive_moe(layer, x)
    fully_dropped = (ref_out == 0).all(dim=-1)
    assert torch.equal(out[fully_dropped], torch.zeros_like(out[fully_dropped]))


def test_aux_loss_is_one_when_router_is_uniform_and_stats_add() -> None:
    layer = make_layer(capacity_factor=2.0)
    with torch.no_grad():
        layer.router.weight.zero_()
    layer(torch.randn(6, 8))
    assert layer.last_aux_loss.item() == pytest.approx(1.0)
    a = MoEStats(1, 4, 8, 2, (5, 3), 1.5, 10, 5, 7)
    total = a + MoEStats(1, 4, 8, 0, (4, 4), 0.5, 20, 10, 7)
    assert total == MoEStats(2, 8, 16, 2, (9, 7), 2.0, 30, 15, 14)
    assert total.drop_rate == pytest.approx(2 / 16) and total.aux_loss == pytest.approx(1.0)
    assert (MoEStats() + a) == a


# ---- expert parallelism ------------------------------------------------------------------------
def ep_spec(capacity_factor: float) -> ModelArgs:
    return ModelArgs(dim=16, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=32, seq_len=8,
                     ffn_hidden=24, moe=MoEArgs(num_experts=4, top_k=2,
                                                capacity_factor=capacity_factor,
                                                aux_loss_coef=0.1))


def rank_chunk(rank: int, spec: ModelArgs, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    seqs = torch.randint(0, spec.vocab_size, (batch, spec.seq_len + 1), generator=gen)
    return seqs[:, :-1], seqs[:, 1:]


def chunk_loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logits = model(inputs)
    ce_sum, n = cross_entropy_sum(logits, targets)
    aux = moe_aux_loss(model)
    return ce_sum + aux * n, logits, aux


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _ep_rank(rank: int, world: int, ep: int, capacity_factor: float) -> dict[str, Any]:
    spec = ep_spec(capacity_factor)
    groups = [dist.new_group(list(range(s, s + ep))) for s in range(0, world, ep)]
    with torch.device("meta"):
        model = Transformer(spec)
    apply_ep(model, groups[rank // ep])
    model.to_empty(device="cpu")
    init_weights(model, SEED)
    init = {n: local(p) for n, p in model.named_parameters()}
    sends: list[tuple[torch.dtype, int]] = []
    original = dist.all_to_all_single

    def spy(out: torch.Tensor, inp: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sends.append((inp.dtype, inp.numel() * inp.element_size()))
        return original(out, inp, *args, **kwargs)

    dist.all_to_all_single = spy
    try:
        loss, logits, aux = chunk_loss(model, *rank_chunk(rank, spec))
        forward_sends = list(sends)
        loss.backward()
    finally:
        dist.all_to_all_single = original
    return {"init": init, "logits": logits.detach(), "aux": aux.detach(), "sends": forward_sends,
            "grads": {n: local(p.grad) for n, p in model.named_parameters()},
            "stats": moe_stats(model)}


def check_bytes(result: dict[str, Any], spec: ModelArgs, ep_rank: int, ep: int) -> None:
    """Dispatch bytes == kept assignments * dim * 4, with kept = sum_e min(n_e, C)."""
    tokens, moe = 2 * spec.seq_len, spec.moe
    capacity = math.ceil(moe.capacity_factor * tokens * moe.top_k / moe.num_experts)
    floats = [b for dtype, b in result["sends"] if dtype == torch.float32]
    counts = [b for dtype, b in result["sends"] if dtype == torch.int64]
    assert counts == [moe.num_experts * 8] * spec.n_layers
    assert len(floats) == 2 * spec.n_layers  # dispatch + combine per layer
    per_rank = moe.num_experts // ep
    for i, (name, stats) in enumerate(sorted(result["stats"].items())):
        kept = [min(n, capacity) for n in stats.tokens_per_expert]
        assert stats.dropped == tokens * moe.top_k - sum(kept)
        assert floats[2 * i] == stats.a2a_bytes_sent == sum(kept) * spec.dim * 4, name
        assert floats[2 * i + 1] == stats.a2a_bytes_received, name
        own = sum(kept[ep_rank * per_rank:(ep_rank + 1) * per_rank])
        assert stats.a2a_remote_bytes_sent == (sum(kept) - own) * spec.dim * 4, name
        if stats.dropped == 0:
            assert stats.a2a_bytes_sent == tokens * moe.top_k * spec.dim * 4


@pytest.mark.parametrize("world,ep,capacity_factor",
                         [(2, 2, 4.0), (4, 4, 4.0), (2, 2, 0.5), (4, 2, 0.5)])
def test_ep_matches_single_process_reference(world: int, ep: int, capacity_factor: float) -> None:
    spec = ep_spec(capacity_factor)
    results = run_ranks(_ep_rank, world, ep, capacity_factor)
    ref = build_model(spec, SEED)
    params = dict(ref.named_parameters())
    ep_groups = [list(range(s, s + ep)) for s in range(0, world, ep)]

    def gathered(key: str, name: str, group: list[int]) -> torch.Tensor:
        return torch.cat([results[r][key][name] for r in group]) if is_expert_param(name) \
            else results[group[0]][key][name]

    for name, p in params.items():  # expert shards gathered == the full name-seeded init
        for group in ep_groups:
            assert torch.equal(gathered("init", name, group), p.detach()), name

    total = torch.zeros(())
    for rank in range(world):
        loss, logits, aux = chunk_loss(ref, *rank_chunk(rank, spec))
        total = total + loss
        torch.testing.assert_close(results[rank]["logits"], logits.detach(), **TOL)
        torch.testing.assert_close(results[rank]["aux"], aux.detach(), **TOL)
        for name, stats in moe_stats(ref).items():
            got = results[rank]["stats"][name]
            assert (got.dropped, got.tokens_per_expert) == (stats.dropped, stats.tokens_per_expert)
        check_bytes(results[rank], spec, rank % ep, ep)
    dropped = sum(s.dropped for r in results for s in r["stats"].values())
    assert (dropped > 0) == (capacity_factor < 1)
    total.backward()
    for name, p in params.items():
        # Each expert shard's grad already holds its whole ep group's tokens: sum over replicas.
        got = sum(gathered("grads", name, g) if is_expert_param(name) else
                  sum(results[r]["grads"][name] for r in g) for g in ep_groups)
        torch.testing.assert_close(got, p.grad, **TOL, msg=name)

    if dropped == 0:  # without drops the chunks are independent: one concatenated forward agrees
        inputs = torch.cat([rank_chunk(r, spec)[0] for r in range(world)])
        logits = torch.cat([results[r]["logits"] for r in range(world)])
        torch.testing.assert_close(ref(inputs).detach(), logits, **TOL)


# ---- the model ---------------------------------------------------------------------------------
def test_transformer_with_moe_builds_and_trains() -> None:
    spec = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, seq_len=16,
                     ffn_hidden=32, moe=MoEArgs(num_experts=4, top_k=2, capacity_factor=1.25))
    model = build_model(spec, SEED)
    assert all(isinstance(b.feed_forward, MoEFeedForward) for b in model.layers.values())
    assert sum(p.numel() for p in model.parameters()) == spec.num_params()
    loader = TokenDataLoader(DataSpec(), spec.seq_len, spec.vocab_size, SEED, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        inputs, targets = loader.next_batch(0, 1)
        ce_sum, n = cross_entropy_sum(model(inputs), targets)
        loss = (ce_sum + moe_aux_loss(model) * n) / n
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    stats = moe_stats(model)
    assert sorted(stats) == ["layers.0.feed_forward", "layers.1.feed_forward"]
    assert all(0 <= s.drop_rate < 1 and s.assignments == 8 * 16 * 2 for s in stats.values())
    assert losses[0] == pytest.approx(math.log(spec.vocab_size), rel=0.1)
    assert sum(losses[-5:]) / 5 < 0.75 * losses[0], losses
