"""Every cost-model formula against numbers worked out by hand here, not with the module's helpers.

The arithmetic is written out literally so a reader can check it against the formula in the
docstring; the published figures (7B ZeRO table, 43.75 GiB TP volume, 15.8% 1F1B bubble) are
asserted at the precision they are quoted with.
"""
from __future__ import annotations

import itertools

import pytest

from tenax.parallel.bubble import bubble_fraction, bubble_table, bubble_time
from tenax.parallel.cost_model import (FP32_ADAMW, MIXED_ADAMW, Comm, Link, MemoryLedger, Network,
                                       all_gather, all_reduce, all_to_all,
                                       attention_activation_bytes, cp_comm, crossing_dims, dp_comm,
                                       ep_comm, gib, in_flight_microbatches, layer_activation_bytes,
                                       mlp_activation_bytes, model_state_memory, pp_comm,
                                       reduce_scatter, stage_activation_bytes, tp_comm,
                                       train_flops_per_token, zero_stage_ledgers)
from tenax.parallel.layout import ParallelLayout

GIB = 2 ** 30


# ---- memory ledger ---------------------------------------------------------------------------
def test_state_byte_presets() -> None:
    assert (MIXED_ADAMW.weights, MIXED_ADAMW.grads, MIXED_ADAMW.optimizer) == (2, 2, 12)
    assert (FP32_ADAMW.weights, FP32_ADAMW.grads, FP32_ADAMW.optimizer) == (4, 4, 8)
    assert MIXED_ADAMW.total == FP32_ADAMW.total == 16


def test_seven_billion_on_eight_gpus_matches_the_zero_table() -> None:
    ledgers = zero_stage_ledgers(7e9, 8)
    totals = {z: round(ledgers[z].total / GIB, 1) for z in range(4)}
    assert totals == {0: 104.3, 1: 35.9, 2: 24.4, 3: 13.0}
    assert ledgers[0].total == 16 * 7e9
    assert ledgers[1].total == pytest.approx(4 * 7e9 + 12 * 7e9 / 8)
    assert ledgers[2].total == pytest.approx(2 * 7e9 + 14 * 7e9 / 8)
    assert ledgers[3].total == pytest.approx(16 * 7e9 / 8)


def test_zero_stages_shard_optimizer_then_grads_then_weights() -> None:
    z2 = model_state_memory(7e9, dp=8, zero=2)
    assert (z2.params, z2.grads, z2.optimizer) == pytest.approx(
        (2 * 7e9, 2 * 7e9 / 8, 12 * 7e9 / 8))
    z1 = model_state_memory(1e9, dp=4, zero=1, state=FP32_ADAMW)
    assert (z1.params, z1.grads, z1.optimizer) == pytest.approx((4e9, 4e9, 8e9 / 4))


def test_model_parallel_divides_params_and_cp_joins_the_sharding_group() -> None:
    # P=8e9, tp=2, pp=2 -> 2e9 per rank; ZeRO-3 over dp*cp = 2*2 = 4 -> 16 * 2e9 / 4 bytes
    ledger = model_state_memory(8e9, dp=2, zero=3, tp=2, pp=2, cp=2)
    assert ledger.total == pytest.approx(16 * 2e9 / 4)


def test_expert_params_split_by_ep_and_sharded_over_dp_cp_over_ep() -> None:
    # 10e9 params, 8e9 in experts; dp=4, ep=2, ZeRO-1.
    # dense 2e9 sharded over 4: 4*2e9 + 12*2e9/4; experts 8e9/2 = 4e9 sharded over 4/2 = 2
    ledger = model_state_memory(10e9, dp=4, zero=1, ep=2, expert_params=8e9)
    expected = (4 * 2e9 + 12 * 2e9 / 4) + (4 * 4e9 + 12 * 4e9 / 2)
    assert ledger.total == pytest.approx(expected)


def test_model_state_memory_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="zero"):
        model_state_memory(1e9, dp=2, zero=4)
    with pytest.raises(ValueError, match="ep: 3"):
        model_state_memory(1e9, dp=4, zero=1, ep=3)
    with pytest.raises(ValueError, match="expert_params"):
        model_state_memory(1e9, dp=1, expert_params=2e9)


def test_ledger_to_dict_is_in_gib() -> None:
    d = MemoryLedger(GIB, 2 * GIB, 3 * GIB, activations=4 * GIB, buffers=GIB / 2).to_dict()
    assert d == {"params_gib": 1.0, "grads_gib": 2.0, "optimizer_gib": 3.0,
                 "model_states_gib": 6.0, "activations_gib": 4.0, "buffers_gib": 0.5,
                 "total_gib": 10.5}


# ---- activations -----------------------------------------------------------------------------
def test_activation_formulas_for_one_case() -> None:
    s, b, h, a = 2048, 2, 4096, 32
    attn = 2 * (11 * s * b * h + 5 * a * s * s * b)
    mlp = 2 * (19 * s * b * h)
    assert attention_activation_bytes(s, b, h, a) == attn
    assert mlp_activation_bytes(s, b, h) == mlp
    assert layer_activation_bytes(s, b, h, a) == attn + mlp
    assert layer_activation_bytes(s, b, h, a, tp=4) == (attn + mlp) / 4
    assert layer_activation_bytes(s, b, h, a, recompute="selective") == 2 * 11 * s * b * h + mlp
    assert layer_activation_bytes(s, b, h, a, tp=4, recompute="full") == 2 * s * b * h / 4
    assert mlp_activation_bytes(s, b, h, top_k=2) == 2 * mlp


def test_context_parallel_splits_queries_not_keys() -> None:
    s, b, h, a, cp = 2048, 1, 1024, 8, 2
    local = 1024
    assert attention_activation_bytes(s, b, h, a, cp=cp) == 2 * (11 * local * b * h
                                                                 + 5 * a * local * s * b)
    assert layer_activation_bytes(s, b, h, a, cp=cp, recompute="full") == 2 * local * b * h


def test_in_flight_micro_batches_per_schedule() -> None:
    assert in_flight_microbatches("1f1b", 4, 16) == 4
    assert in_flight_microbatches("zero_bubble", 4, 16) == 4
    assert in_flight_microbatches("gpipe", 4, 16) == 16
    assert in_flight_microbatches("interleaved_1f1b", 4, 16, 2) == 4 * (1 + 3 / 8)
    assert in_flight_microbatches("1f1b", 4, 2) == 2
    assert in_flight_microbatches("gpipe", 1, 16) == 1


def test_stage_activation_bytes_rounds_layers_up() -> None:
    assert stage_activation_bytes(10, 32, 4, 4) == 8 * 10 * 4
    assert stage_activation_bytes(10, 30, 4, 4) == 8 * 10 * 4   # ceil(30/4) = 8
    assert stage_activation_bytes(10, 30, 4, 1, virtual=2) == 4 * 2 * 10  # ceil(30/8)*2


def test_activation_inputs_are_checked() -> None:
    with pytest.raises(ValueError, match="recompute"):
        layer_activation_bytes(16, 1, 8, 2, recompute="some")
    with pytest.raises(ValueError, match="tp"):
        layer_activation_bytes(16, 1, 8, 2, tp=0)


# ---- collectives and alpha-beta --------------------------------------------------------------
def test_ring_collective_volumes_and_steps() -> None:
    assert (all_reduce(1000, 4).nbytes, all_reduce(1000, 4).steps) == (1500, 6)
    assert (all_gather(1000, 4).nbytes, all_gather(1000, 4).steps) == (750, 3)
    assert (reduce_scatter(1000, 4).nbytes, reduce_scatter(1000, 4).steps) == (750, 3)
    assert (all_to_all(1000, 4).nbytes, all_to_all(1000, 4).steps) == (750, 3)
    assert (all_reduce(1000, 1).nbytes, all_reduce(1000, 1).steps) == (0, 0)


def test_alpha_beta_time() -> None:
    link = Link(alpha_s=1e-6, bandwidth_Bps=150e9)
    assert link.time(1.5e9, 6) == pytest.approx(6e-6 + 0.01)
    assert Comm("x", 1.5e9, 6).time(link) == pytest.approx(0.010006)
    net = Network()
    assert net.link(False) is net.intra and net.link(True) is net.inter
    assert Comm("x", 50e9, 2).to_dict(net.inter)["time_s"] == pytest.approx(1 + 2 * 5e-6)


def test_tp_volume_matches_the_published_43_75_gib() -> None:
    comm = tp_comm(batch=4, seq=2048, hidden=4096, tp=8, layers=100, dtype_bytes=2)
    per_all_reduce = 4 * 2048 * 4096 * 2 * 2 * 7 / 8
    assert comm.nbytes == pytest.approx(4 * 100 * per_all_reduce)
    assert comm.nbytes / GIB == pytest.approx(43.75)
    assert comm.steps == 4 * 100 * 2 * 7
    assert comm.to_dict()["gib"] == 43.75
    assert tp_comm(4, 2048, 4096, 8, 100, recompute="full").nbytes == pytest.approx(
        6 * 100 * per_all_reduce)


def test_tp_whole_step_adds_the_stage_ends_and_norm_grads() -> None:
    """Embedding reduce-scatter + its backward all-gather, head all-gather + its backward
    reduce-scatter (2 all-reduce equivalents), the vocab-sharded logits' all-gather
    ((N-1)/N * b*s*V*dtype) and one all-reduce of the norms' partial grads."""
    b, s, h, v, n, layers = 8, 32, 64, 128, 2, 2
    act = b * s * h * 4
    norms = (2 * layers + 1) * h * 4
    comm = tp_comm(b, s, h, n, layers, 4, vocab=v, norm_grad_bytes=norms)
    want = (4 * layers + 2) * 2 * (n - 1) / n * act + (n - 1) / n * b * s * v * 4 \
        + 2 * (n - 1) / n * norms
    assert comm.nbytes == pytest.approx(want)
    assert comm.steps == (4 * layers + 2) * 2 + 1 + 2


def test_dp_volume_per_zero_stage() -> None:
    g, n = 1e9, 8
    assert dp_comm(g, n, 0).nbytes == pytest.approx(2 * 7 / 8 * g)
    assert dp_comm(g, n, 1, microbatches=4).nbytes == pytest.approx(2 * 7 / 8 * g)
    assert dp_comm(g, n, 2, microbatches=4).nbytes == pytest.approx(5 * 7 / 8 * g)
    assert dp_comm(g, n, 3).nbytes == pytest.approx(1.5 * 2 * 7 / 8 * g)
    assert dp_comm(g, n, 3, microbatches=4).nbytes == pytest.approx(9 * 7 / 8 * g)
    # pipeline schedules run backward outside the micro-batch loop: ZeRO-2 reduces once
    assert dp_comm(g, n, 2, microbatches=4, per_micro_batch=False).nbytes == pytest.approx(
        2 * 7 / 8 * g)


def test_pp_ep_cp_volumes() -> None:
    pp = pp_comm(micro_batch=2, seq=2048, hidden=4096, microbatches=8, dtype_bytes=2)
    assert (pp.nbytes, pp.steps) == (2 * 8 * 2 * 2048 * 4096 * 2, 16)
    assert pp_comm(2, 2048, 4096, 8, 2, tp=4).nbytes == 2 * 8 * 2 * 2048 * 4096 * 2 / 4
    ep = ep_comm(batch=4, seq=2048, hidden=4096, top_k=2, ep=8, moe_layers=10, dtype_bytes=2)
    assert ep.nbytes == pytest.approx(4 * 10 * 7 / 8 * 4 * 2048 * 2 * 4096 * 2)
    assert ep.steps == 4 * 10 * 7
    cp = cp_comm(batch=2, seq=8192, kv_heads=8, head_dim=128, cp=4, layers=10, dtype_bytes=2)
    block = 2 * 2 * 2048 * 8 * 128 * 2
    assert (cp.nbytes, cp.steps) == (3 * 3 * block * 10, 3 * 3 * 10)
    # a ring per micro-batch: same bytes (b is the whole batch), m times the latency steps
    cp4 = cp_comm(2, 8192, 8, 128, 4, 10, 2, microbatches=4)
    assert (cp4.nbytes, cp4.steps) == (cp.nbytes, 4 * cp.steps)


def test_train_flops_per_token() -> None:
    p, layers, h, s = 8e9, 32, 4096, 8192
    base = 6 * p + 12 * layers * h * s
    assert train_flops_per_token(p, layers, h, s) == base
    assert train_flops_per_token(p, layers, h, s, "selective") == base + 4 * layers * h * s
    assert train_flops_per_token(p, layers, h, s, "full") == base + 2 * p + 4 * layers * h * s


def test_crossing_dims_agrees_with_the_layout() -> None:
    for world in range(1, 17):
        for tp, pp, cp in itertools.product(range(1, world + 1), repeat=3):
            if world % (tp * pp * cp):
                continue
            dp = world // (tp * pp * cp)
            for ep in (e for e in range(1, dp * cp + 1) if (dp * cp) % e == 0):
                lay = ParallelLayout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
                for gpn in (1, 2, 3, 4, 8):
                    got = crossing_dims(pp, dp, cp, tp, ep, gpn)
                    want = {d: lay.crosses_nodes(d, gpn) for d in ("tp", "cp", "dp", "pp", "ep")}
                    assert got == want, (lay, gpn)


# ---- pipeline bubble -------------------------------------------------------------------------
def test_1f1b_bubble_is_15_8_percent_for_p4_m16() -> None:
    t = bubble_time("1f1b", 4, F=1, B=2)
    assert t == 3 * 3
    assert bubble_fraction(t, 16, F=1, B=2) == pytest.approx(9 / (16 * 3 + 9))
    assert round(bubble_fraction(t, 16), 3) == 0.158


def test_bubble_table_p4_m16_defaults() -> None:
    table = bubble_table(4, 16, virtual=2)
    expected = {"gpipe": 9, "1f1b": 9, "interleaved_1f1b": 9 / 2,
                "zero_bubble": 3 * (1 + 2 - 2 * 0.5), "dualpipe": (4 / 2 - 1) * (2 + 2 - 3 * 0.5)}
    for name, bubble in expected.items():
        assert table[name].bubble == pytest.approx(bubble)
        assert table[name].fraction == pytest.approx(bubble / (16 * 3 + bubble))
    assert table["dualpipe"].to_dict()["label"] == "DualPipe"
    assert table["zero_bubble"].to_dict()["label"] == "ZB1P"


def test_bubble_table_second_case() -> None:
    table = bubble_table(8, 32, virtual=4, F=1, B=2, W=1, FB=2.5)
    expected = {"1f1b": 7 * 3, "interleaved_1f1b": 7 * 3 / 4, "zero_bubble": 7 * (3 - 2),
                "dualpipe": 3 * (2.5 + 2 - 3)}
    for name, bubble in expected.items():
        assert table[name].bubble == pytest.approx(bubble)
        assert table[name].fraction == pytest.approx(bubble / (32 * 3 + bubble))


def test_bubble_edge_cases() -> None:
    assert "dualpipe" not in bubble_table(3, 12)
    with pytest.raises(ValueError, match="even"):
        bubble_time("dualpipe", 3)
    assert bubble_time("1f1b", 1) == 0
    assert bubble_time("zero_bubble", 4, F=1, B=2, W=2) == 0  # (p-1)(3-4) < 0 is clamped
    with pytest.raises(ValueError, match="W"):
        bubble_time("zero_bubble", 4, W=3)
    with pytest.raises(ValueError, match="schedule"):
        bubble_time("chimera", 4)


def test_gib() -> None:
    assert gib(3 * GIB) == 3
