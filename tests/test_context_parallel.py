"""Context parallelism: zig-zag split/gather, ring attention forward and backward against the
full-sequence reference, and a whole model under CP against the single-process model."""
from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tenax.parallel.config import ModelArgs
from tenax.parallel.context_parallel import (RingCommCounter, apply_cp, ring_attention,
                                             zigzag_gather, zigzag_indices, zigzag_split)
from tenax.parallel.model import build_model, cross_entropy_sum
from tests.distributed import run_ranks

logger = logging.getLogger(__name__)
torch.set_num_threads(1)

SEED = 1234
B, HEADS, SEQ, HEAD_DIM = 2, 4, 32, 16
TOL = 1e-5


def test_zigzag_indices_partition_and_balance() -> None:
    for cp in (1, 2, 3, 4):
        seq = 8 * cp
        held = [zigzag_indices(seq, cp, r) for r in range(cp)]
        assert torch.equal(torch.sort(torch.cat(held)).values, torch.arange(seq))
        c = seq // (2 * cp)
        for r, idx in enumerate(held):
            assert idx.tolist() == list(range(r * c, (r + 1) * c)) + \
                list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))
        # Causal work of a rank = sum over its queries of (position + 1): equal on every rank.
        assert len({int((idx + 1).sum()) for idx in held}) == 1
    x = torch.arange(2 * 16).view(2, 16)
    assert torch.equal(zigzag_split(x, 2, 1), x[:, [4, 5, 6, 7, 8, 9, 10, 11]])
    with pytest.raises(ValueError, match="not divisible by 2\\*cp=8"):
        zigzag_indices(36, 4, 0)
    with pytest.raises(ValueError, match="rank 2 is not in"):
        zigzag_indices(16, 2, 2)


def _qkv_grads_inputs(kv_repeat: int) -> tuple[torch.Tensor, ...]:
    """q, k, v (kv with HEADS // kv_repeat heads) and an upstream gradient, identical everywhere."""
    g = torch.Generator().manual_seed(SEED + kv_repeat)
    q = torch.randn(B, HEADS, SEQ, HEAD_DIM, generator=g)
    k = torch.randn(B, HEADS // kv_repeat, SEQ, HEAD_DIM, generator=g)
    v = torch.randn(B, HEADS // kv_repeat, SEQ, HEAD_DIM, generator=g)
    return q, k, v, torch.randn(B, HEADS, SEQ, HEAD_DIM, generator=g)


def _reference(kv_repeat: int) -> dict[str, torch.Tensor]:
    q, k, v, dout = (t.requires_grad_(i < 3) for i, t in enumerate(_qkv_grads_inputs(kv_repeat)))
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(kv_repeat, 1),
                                         v.repeat_interleave(kv_repeat, 1), is_causal=True)
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _cp_groups(world: int, cp: int) -> list[list[int]]:
    # Strided groups ({0, 2}, {1, 3} for cp=2 on 4 ranks): group rank != global rank, so a
    # peer computed in the wrong rank space would deadlock or mix up blocks.
    return [list(range(start, world, world // cp)) for start in range(world // cp)]


def _ring_worker(rank: int, world: int, cp: int) -> dict[str, Any]:
    groups = [dist.new_group(ranks) for ranks in _cp_groups(world, cp)]
    group = groups[rank % (world // cp)]
    cp_rank = dist.get_rank(group)
    result: dict[str, Any] = {}
    for kv_repeat in (1, 2):
        full = _qkv_grads_inputs(kv_repeat)
        q, k, v, dout = (zigzag_split(t, cp, cp_rank, seq_dim=2) for t in full)
        for t in full:  # gather must invert split exactly
            assert torch.equal(zigzag_gather(zigzag_split(t, cp, cp_rank, 2), cp, group, 2), t)
        for t in (q, k, v):
            t.requires_grad_(True)
        counter = RingCommCounter()
        # As Attention does for GQA: kv heads repeated to the q heads before the attention core.
        out = ring_attention(q, k.repeat_interleave(kv_repeat, 1),
                             v.repeat_interleave(kv_repeat, 1), group, kv_repeat=kv_repeat,
                             counter=counter)
        out.backward(dout)
        gathered = {name: zigzag_gather(t, cp, group, seq_dim=2)
                    for name, t in (("out", out.detach()), ("dq", q.grad), ("dk", k.grad),
                                    ("dv", v.grad))}
        result[f"kv_repeat={kv_repeat}"] = {**gathered, "counter": counter}
    return result


@pytest.mark.parametrize("world,cp", [(4, 2), (4, 4)])
def test_ring_attention_matches_full_sequence(world: int, cp: int) -> None:
    results = run_ranks(_ring_worker, world, cp, timeout_s=120)
    for kv_repeat in (1, 2):
        ref = _reference(kv_repeat)
        kv_heads = HEADS // kv_repeat
        # One K+V block, float32: what each ring hop carries (only one copy per kv head).
        block = 2 * B * (SEQ // cp) * kv_heads * HEAD_DIM * 4
        for rank, result in enumerate(results):
            got = result[f"kv_repeat={kv_repeat}"]
            for name in ("out", "dq", "dk", "dv"):
                err = (got[name] - ref[name]).abs().max().item()
                assert err <= TOL, f"rank {rank} kv_repeat {kv_repeat} {name}: max error {err}"
            counter = got["counter"]
            assert (counter.forward_hops, counter.backward_hops) == (cp - 1, 2 * (cp - 1))
            assert counter.forward_bytes == (cp - 1) * block
            assert counter.backward_bytes == 2 * (cp - 1) * block


def tiny_spec() -> ModelArgs:
    return ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, seq_len=SEQ,
                     ffn_hidden=96)


def _tokens(spec: ModelArgs) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    data = torch.randint(0, spec.vocab_size, (B, spec.seq_len + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def _model_worker(rank: int, world: int, spec_json: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    spec = ModelArgs.from_dict(json.loads(spec_json))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    group = mesh.get_group("cp")
    model = build_model(spec, SEED)
    counter = apply_cp(model, mesh)
    tokens, targets = _tokens(spec)
    logits = model(zigzag_split(tokens, world, rank),
                   positions=zigzag_indices(spec.seq_len, world, rank))
    loss_sum, _ = cross_entropy_sum(logits, zigzag_split(targets, world, rank))
    (loss_sum / targets.numel()).backward()  # normalised by the GLOBAL token count
    grads = {}
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad, group=group)  # partial on each cp rank: sum them
        grads[name] = p.grad
    loss = loss_sum.detach() / targets.numel()
    dist.all_reduce(loss, group=group)
    return {"logits": zigzag_gather(logits.detach(), world, group), "loss": loss, "grads": grads,
            "counter": counter}


def test_model_under_cp_matches_single_process() -> None:
    spec, cp = tiny_spec(), 2
    results = run_ranks(_model_worker, cp, json.dumps(spec.to_dict()), timeout_s=120)
    reference = build_model(spec, SEED)
    tokens, targets = _tokens(spec)
    logits = reference(tokens)
    loss_sum, count = cross_entropy_sum(logits, targets)
    (loss_sum / count).backward()
    from tenax.parallel.cost_model import cp_comm  # the comm the planner charges for this run

    expected = cp_comm(B, spec.seq_len, spec.n_kv_heads, spec.head_dim, cp, spec.n_layers,
                       dtype_bytes=4)
    for rank, result in enumerate(results):
        assert (result["logits"] - logits.detach()).abs().max().item() <= TOL, rank
        assert abs(result["loss"].item() - (loss_sum / count).item()) <= TOL
        for name, p in reference.named_parameters():
            err = (result["grads"][name] - p.grad).abs().max().item()
            assert err <= TOL, f"rank {rank} {name}: grad max error {err}"
        assert result["counter"].total_bytes == expected.nbytes
        assert result["counter"].forward_hops + result["counter"].backward_hops == expected.steps
