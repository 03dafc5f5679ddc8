"""Host memory of the in-memory snapshots: pure tables, no Ray, no torch."""
from __future__ import annotations

import json
import sys
import threading
import types

import pytest

from tenax.orchestrator.cli.main import main
from tenax.orchestrator.placement.host_memory import (SAFE_FRACTION, plan_snapshot_memory,
                                                      ray_node_memory_bytes)
from tenax.parallel.config import ModelArgs, MoEArgs
from tenax.parallel.host_memory import (CURSOR_RNG_BYTES, human_bytes, node_snapshot_footprint,
                                        rank_snapshot_bytes, snapshot_footprint)
from tenax.parallel.layout import ParallelLayout
from tenax.workers.spec import spec_from_dict

MODEL = ModelArgs()
P = MODEL.num_params()
C = CURSOR_RNG_BYTES


# ---- one rank's state: the ledger's params + optimizer ----------------------------------------
@pytest.mark.parametrize("layout, dtype, fp32_params, per_param", [
    # this engine: fp32 weights (4 B) + AdamW m, v (8 B), ZeRO-s shards over dp*cp
    (ParallelLayout(dp=4, zero=0), "float32", True, 4 + 8),
    (ParallelLayout(dp=4, zero=1), "float32", True, 4 + 8 / 4),
    (ParallelLayout(dp=4, zero=2), "float32", True, 4 + 8 / 4),
    (ParallelLayout(dp=4, zero=3), "float32", True, 12 / 4),
    (ParallelLayout(dp=2, tp=2, zero=1), "float32", True, (4 + 8 / 2) / 2),
    (ParallelLayout(dp=2, pp=2, zero=0), "float32", True, 12 / 2),
    (ParallelLayout(dp=2, cp=2, zero=1), "float32", True, 4 + 8 / 4),
    # the engine keeps fp32 params whatever train.dtype says: bf16 snapshots the same bytes
    (ParallelLayout(dp=4, zero=1), "bfloat16", True, 4 + 8 / 4),
    # an engine with bf16 weights: 2 B + fp32 master and moments (12 B) sharded by ZeRO
    (ParallelLayout(dp=4, zero=1), "bfloat16", False, 2 + 12 / 4),
])
def test_rank_state_follows_the_ledger(layout, dtype, fp32_params, per_param):
    got = rank_snapshot_bytes(MODEL, layout, dtype, fp32_params=fp32_params)
    assert got == pytest.approx(per_param * P + C, abs=1)


def test_experts_are_divided_by_ep():
    moe = ModelArgs(moe=MoEArgs(num_experts=4, top_k=2))
    total, experts = moe.num_params(), moe.expert_params()
    dense = total - experts
    # dp=2, ep=2, ZeRO-1: dense over N=2; experts split over ep=2, replicated over N_e=1
    want = 4 * dense + 8 * dense / 2 + 12 * experts / 2 + C
    got = rank_snapshot_bytes(moe, ParallelLayout(dp=2, ep=2, zero=1))
    assert got == pytest.approx(want, abs=1)


def test_more_zero_sharding_means_less_per_rank():
    sizes = [rank_snapshot_bytes(MODEL, ParallelLayout(dp=8, zero=z)) for z in (0, 1, 3)]
    assert sizes[0] > sizes[1] > sizes[2]
    with pytest.raises(ValueError, match="train.dtype: 'int8'"):
        rank_snapshot_bytes(MODEL, ParallelLayout(), "int8")


# ---- per node: 2 local buffers + 2 replica buffers, rewritten in place (steady = peak) -------
@pytest.mark.parametrize("gpn, world, every, ranks, replica, steady, peak", [
    (2, 4, 1, 2, True, 2 * 4 * 10, 2 * 4 * 10),      # 2 nodes: the ring replica
    (4, 16, 5, 4, True, 4 * 4 * 10, 4 * 4 * 10),
    (4, 4, 1, 4, False, 4 * 2 * 10, 4 * 2 * 10),     # one node: no peer, no replica
    (8, 2, 1, 2, False, 2 * 2 * 10, 2 * 2 * 10),     # fewer ranks than GPUs on the node
    (2, 4, 0, 2, True, 0, 0),                        # memory_every_steps=0: nothing
])
def test_node_footprint(gpn, world, every, ranks, replica, steady, peak):
    foot = node_snapshot_footprint(10, gpn, world, every)
    assert (foot.ranks_per_node, foot.replica) == (ranks, replica)
    assert (foot.per_node_steady_bytes, foot.per_node_peak_bytes) == (steady, peak)
    assert foot.per_rank_peak_bytes * ranks == peak
    doc = foot.to_dict()
    assert doc["per_node_peak_bytes"] == peak and doc["summary"]


def test_a_device_state_adds_one_pinned_staging_buffer_outside_tmpfs():
    host = node_snapshot_footprint(10, 2, 4, 1)
    dev = node_snapshot_footprint(10, 2, 4, 1, device=True)
    assert (dev.staging_bytes, dev.per_rank_peak_bytes) == (10, 5 * 10)
    assert dev.per_node_peak_bytes == 2 * 5 * 10 == host.per_node_peak_bytes + 2 * 10
    assert dev.per_node_tmpfs_bytes == host.per_node_peak_bytes == host.per_node_tmpfs_bytes
    assert "pinned staging buffer" in dev.what() and "pinned" not in host.what()
    assert node_snapshot_footprint(10, 2, 4, 0, device=True).per_node_peak_bytes == 0


def test_footprint_text_and_errors():
    on = snapshot_footprint(MODEL, ParallelLayout(dp=4), 2, 1)
    assert on.what() == "in-memory snapshots: 2 local buffers + 2 peer replica buffers"
    assert "per node (2 ranks)" in on.summary() and "MiB peak" in on.summary()
    assert "single node" in snapshot_footprint(MODEL, ParallelLayout(dp=2), 2).what()
    assert "memory_every_steps=0" in snapshot_footprint(MODEL, ParallelLayout(dp=2), 2, 0).what()
    assert [human_bytes(n) for n in (512, 1536, 3 * 2**30)] == ["512 B", "1.5 KiB", "3.0 GiB"]
    with pytest.raises(ValueError, match="checkpoint.memory_every_steps: -1"):
        node_snapshot_footprint(10, 2, 4, -1)
    with pytest.raises(ValueError, match="resources.gpus_per_node: 0"):
        node_snapshot_footprint(10, 0, 4, 1)


# ---- the decision ------------------------------------------------------------------------------
def spec(every: int = 1, gpn: int = 2):
    return spec_from_dict({"checkpoint": {"memory_every_steps": every},
                           "resources": {"gpus_per_node": gpn}})


LAYOUT = ParallelLayout(dp=4)   # 2 nodes x 2 ranks
PEAK = 2 * 4 * rank_snapshot_bytes(MODEL, LAYOUT)


def test_off_is_disabled_with_the_field():
    plan = plan_snapshot_memory(spec(every=0), LAYOUT, 1e12)
    assert (plan.enabled, plan.reason, plan.per_node_peak_bytes) == (
        False, "checkpoint.memory_every_steps=0", 0)
    assert (plan.requested_every, plan.every_steps) == (0, 0)


def test_node_memory_is_read_only_when_snapshots_are_asked_for():
    asked = []

    def node_memory():
        asked.append(1)
        return 1e12

    assert plan_snapshot_memory(spec(every=0), LAYOUT, node_memory).every_steps == 0
    assert asked == []
    assert plan_snapshot_memory(spec(every=3), LAYOUT, node_memory).every_steps == 3
    assert asked == [1]


def test_a_node_too_small_disables_them_naming_the_numbers():
    small = {"node-a": 1e12, "node-b": PEAK}   # node-b: peak > 0.5 x its memory
    plan = plan_snapshot_memory(spec(), LAYOUT, small)
    assert not plan.enabled
    assert (plan.requested_every, plan.every_steps) == (1, 0)  # the ranks take none
    assert plan.per_node_peak_bytes == PEAK
    assert plan.per_rank_bytes == rank_snapshot_bytes(MODEL, LAYOUT)
    for text in ("checkpoint.memory_every_steps=1", f"{PEAK} B", "'node-b'",
                 f"{SAFE_FRACTION} x", "2 rank(s) x 4 x", "in-memory snapshots off"):
        assert text in plan.reason


@pytest.mark.parametrize("memory, enabled", [
    (2 * PEAK, True),           # exactly at the safe fraction
    (2 * PEAK - 1, False),
    ({"a": 4 * PEAK, "b": 3 * PEAK}, True),
    (None, True),               # unknown: not checked, said so
    ({}, True),
])
def test_fit_table(memory, enabled):
    plan = plan_snapshot_memory(spec(), LAYOUT, memory)
    assert plan.enabled is enabled
    assert plan.every_steps == (1 if enabled else 0)
    if memory in (None, {}):
        assert "unknown" in plan.reason


def test_a_cuda_job_plans_the_staging_buffers_in_host_memory_not_tmpfs():
    cuda = spec_from_dict({"checkpoint": {"memory_every_steps": 1},
                           "resources": {"gpus_per_node": 2, "device": "cuda"}})
    state = rank_snapshot_bytes(MODEL, LAYOUT)
    assert plan_snapshot_memory(cuda, LAYOUT, None).per_node_peak_bytes == 2 * 5 * state
    # The tmpfs holds the 4 buffers only: room for them is enough
    assert plan_snapshot_memory(cuda, LAYOUT, None, ("/dev/shm", PEAK)).enabled
    tight = plan_snapshot_memory(cuda, LAYOUT, None, ("/dev/shm", PEAK - 1))
    assert not tight.enabled and f"{PEAK} B" in tight.reason and "2 rank(s) x 4 x" in tight.reason
    small = plan_snapshot_memory(cuda, LAYOUT, {"n": 2 * PEAK})  # fits 4 copies, not 5
    assert not small.enabled and "2 rank(s) x 5 x" in small.reason


def test_single_node_has_no_replica_term():
    lay = ParallelLayout(dp=4)
    plan = plan_snapshot_memory(spec(gpn=4), lay, None)
    assert plan.per_node_peak_bytes == 4 * 2 * rank_snapshot_bytes(MODEL, lay)


def test_bad_node_memory_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"node_memory_bytes\['x'\]: -5"):
        plan_snapshot_memory(spec(), LAYOUT, {"x": -5})


# ---- reading Ray's node memory (a stub `ray`: no cluster) ---------------------------------------
def fake_ray(monkeypatch, nodes, delay: threading.Event | None = None):
    def read():
        if delay is not None:
            delay.wait(5)
        return nodes
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(nodes=read))


def test_ray_node_memory(monkeypatch):
    nodes = [{"NodeID": "a", "Alive": True, "Resources": {"memory": 8e9, "CPU": 4}},
             {"NodeID": "b", "Alive": True, "Resources": {"memory": 4e9}},
             {"NodeID": "c", "Alive": False, "Resources": {"memory": 1e9}},
             {"NodeID": "d", "Alive": True, "Resources": {"CPU": 1}}]
    fake_ray(monkeypatch, nodes)
    assert ray_node_memory_bytes() == {"a": 8e9, "b": 4e9}
    assert ray_node_memory_bytes(["b", "c"]) == {"b": 4e9}
    assert ray_node_memory_bytes(["zz"]) is None


def test_ray_node_memory_times_out(monkeypatch):
    hold = threading.Event()
    fake_ray(monkeypatch, [], delay=hold)
    try:
        assert ray_node_memory_bytes(timeout_s=0.05) is None
    finally:
        hold.set()


# ---- the CLI -----------------------------------------------------------------------------------
def run_json(capsys, *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_layout_reports_snapshot_memory(capsys, tmp_path):
    doc = run_json(capsys, "plan", "layout", "--model-preset", "tiny", "--gpus", "4",
                   "--gpus-per-node", "2")
    snap = doc["snapshot_memory"]
    assert snap["what"] == "in-memory snapshots: 2 local buffers + 2 peer replica buffers"
    lay = ParallelLayout.from_dict(doc["layout"])
    assert snap["rank_state_bytes"] == rank_snapshot_bytes(MODEL, lay)
    assert snap["per_node_peak_bytes"] == 2 * 4 * snap["rank_state_bytes"]
    assert set(snap["per_rank"]) == set(snap["per_node"]) == {"steady", "peak"}
    job = tmp_path / "job.yaml"
    job.write_text("checkpoint: {memory_every_steps: 0}\n")
    doc = run_json(capsys, "plan", "layout", "--spec", str(job), "--gpus", "4",
                   "--gpus-per-node", "2")
    assert doc["snapshot_memory"]["per_node_peak_bytes"] == 0
    assert main(["plan", "layout", "--model-preset", "tiny", "--gpus", "4",
                 "--gpus-per-node", "2"]) == 0
    assert "2 local buffers + 2 peer replica buffers" in capsys.readouterr().out


def test_plan_memory_reports_snapshot_memory_per_stage(capsys):
    doc = run_json(capsys, "plan", "memory", "--params-b", "1", "--world", "16",
                   "--gpus-per-node", "8")
    zero1 = doc["stages"]["ZeRO-1"]["snapshot_memory"]
    # bf16 + AdamW ledger: 2 B weights + 12 B/16 optimizer per param, 4x per rank, 8 ranks
    assert zero1["per_node_steady_bytes"] == pytest.approx(8 * 4 * ((2 + 12 / 16) * 1e9 + C),
                                                           abs=100)
