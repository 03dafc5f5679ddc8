"""Each ZeRO stage shards exactly what its name says, and TP runs the collectives the cost
model charges for: measured per rank, compared with the ledger and the formulas."""
from __future__ import annotations

import pytest

from tenax.parallel.cost_model import FP32_ADAMW, model_state_memory
from tests.distributed import run_ranks
from tests.engine_jobs import comm_job, memory_job


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("dp", [2, 4])
def test_memory_per_zero_stage_matches_ledger(dp, zero):
    measured = run_ranks(memory_job, dp, {"dp": dp, "zero": zero, "micro_batch_size": 1})
    ledger = model_state_memory(measured[0]["n_params"], dp=dp, zero=zero, state=FP32_ADAMW)
    for rank, got in enumerate(measured):
        for part in ("params", "grads", "optimizer"):
            want = getattr(ledger, part)
            assert got[part] == pytest.approx(want, rel=0.05), \
                f"rank {rank} zero {zero} {part}: measured {got[part]} vs ledger {want:.0f}"


def _per_layer(layout: dict, world: int) -> dict:
    """Collectives of one step with 3 layers minus 2 layers: what one layer adds."""
    two = run_ranks(comm_job, world, layout, ["model.n_layers=2"])[0]
    three = run_ranks(comm_job, world, layout, ["model.n_layers=3"])[0]
    return {k: {m: three[k][m] - two.get(k, {}).get(m, 0) for m in ("count", "bytes")}
            for k in three}


@pytest.mark.slow  # three runs on 2 ranks: more than ~5 s
def test_tp_collectives_per_layer_match_cost_model():
    from tenax.parallel.cost_model import tp_comm
    from tests.engine_jobs import tiny_spec

    tp = 2
    spec = tiny_spec()
    layout = {"tp": tp, "zero": 0, "micro_batch_size": 1}  # zero 0: no DP all-gather to mix in
    delta = _per_layer(layout, tp)
    micro_batches = spec.train.global_batch_size  # micro batch 1, dp 1
    # Sequence parallel turns each all-reduce into all-gather + reduce-scatter: per layer and
    # micro-batch 2 of each forward, 2 of each backward = 4 all-reduce equivalents.
    assert delta["all_gather"]["count"] == 4 * micro_batches
    assert delta["reduce_scatter"]["count"] == 4 * micro_batches
    assert delta.get("all_reduce", {}).get("count", 0) == 2  # the two new norms' partial grads
    # Ring traffic per rank: all-gather sends (N-1) x its shard, reduce-scatter (N-1)/N x input.
    shard = delta["all_gather"]["bytes"] / delta["all_gather"]["count"]
    full = delta["reduce_scatter"]["bytes"] / delta["reduce_scatter"]["count"]
    assert full == tp * shard
    wire = delta["all_gather"]["count"] * (tp - 1) * shard + \
        delta["reduce_scatter"]["count"] * (tp - 1) / tp * full
    predicted = tp_comm(batch=micro_batches, seq=spec.model.seq_len, hidden=spec.model.dim,
                        tp=tp, layers=1, dtype_bytes=4)
    assert wire == pytest.approx(predicted.nbytes)


def test_dp_all_reduce_volume_matches_cost_model():
    from tenax.parallel.cost_model import dp_comm

    summary = run_ranks(comm_job, 2, {"dp": 2, "zero": 0, "micro_batch_size": 1}, [])[0]
    n_params = memory_n_params()
    grads = n_params * 4
    # the loss all-reduce is a scalar (plain DDP's grad norm needs none); the rest are buckets
    bucket_bytes = summary["all_reduce"]["bytes"] - 8
    assert bucket_bytes == grads
    predicted = dp_comm(grads, 2, zero=0)
    assert predicted.nbytes == pytest.approx(2 * (2 - 1) / 2 * grads)


def memory_n_params() -> int:
    from tests.engine_jobs import tiny_spec

    return tiny_spec().model.num_params()


# ---- ZeRO stages move and hold what the cost model charges -----------------------------------
ZERO_CONFIGS = [(zero, m) for zero in range(4) for m in (1, 4)]
RING = {"all_reduce": lambda b, n: 2 * (n - 1) / n * b, "all_gather": lambda b, n: (n - 1) * b,
        "reduce_scatter": lambda b, n: (n - 1) / n * b}


@pytest.fixture(scope="module", params=[2, 4], ids=["dp2", "dp4"])
def zero_accounting(request) -> tuple[int, dict]:
    from tests.engine_jobs import zero_accounting_job

    return request.param, run_ranks(zero_accounting_job, request.param, ZERO_CONFIGS,
                                    timeout_s=600)[0]


@pytest.mark.parametrize("zero,m", ZERO_CONFIGS)
def test_zero_comm_bytes_per_step_match_cost_model(zero_accounting, zero, m):
    """Every collective's input (CommCounter reads it from the op's schema), turned into ring
    bytes per rank, equals dp_comm for the stage as built: DDP and ZeRO-1 2(N-1)/N G, ZeRO-2
    (m+1)(N-1)/N G, ZeRO-3 (2m+1)(N-1)/N G. The scalar all-reduces (loss; grad norm unless
    plain DDP, whose ranks all hold every grad) are the only extra traffic."""
    from tenax.parallel.cost_model import dp_comm

    n, results = zero_accounting
    got = results[f"zero{zero} m{m}"]
    assert got["accum"] == m
    wire = sum(RING[k](v["bytes"], n) for k, v in got["comm"].items() if k in RING)
    wire -= RING["all_reduce"](8 if zero == 0 else 16, n)
    predicted = dp_comm(4 * got["n_params"], n, zero, microbatches=m)
    assert wire == pytest.approx(predicted.nbytes, rel=1e-3), got["comm"]
    if zero == 2:  # one reduce-scatter per micro-batch and bucket, never an all-reduce of grads
        assert got["comm"]["reduce_scatter"]["count"] % m == 0
        assert got["comm"]["all_reduce"]["count"] == 2  # loss and grad norm


def test_zero2_holds_one_nth_of_the_grads_during_accumulation(zero_accounting):
    """After 3 of 4 micro-batches, ZeRO-2 holds only its accumulated 1/N chunks; ZeRO-0 and
    ZeRO-1 hold the full gradients (ZeRO-1 does not shard them)."""
    n, results = zero_accounting
    full = results["zero0 m4"]["held_grads"]
    assert full == 4 * results["zero0 m4"]["n_params"]
    assert results["zero1 m4"]["held_grads"] == full
    assert results["zero2 m4"]["held_grads"] == pytest.approx(full / n, rel=1e-3)
