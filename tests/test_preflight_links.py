"""The preflight's links row: each dimension's collective timed per process group at the
planner's sizes, judged against the planner's bandwidth (CUDA) or the median group (CPU); on a
two-node cluster a drill that slows one node's ranks is named by the links and throughput rows."""
from __future__ import annotations

from pathlib import Path

import pytest

from tenax.orchestrator.preflight import GroupFigure, link_tasks, links_row, planner_sizes
from tenax.orchestrator.preflight.links import (MAX_PROBE_BYTES, MIN_PROBE_BYTES, assumed_Bps,
                                                group_figures, moved_bytes, node_names)
from tenax.orchestrator.preflight.links_probe import best_of, slow_factors
from tenax.orchestrator.preflight.rows import throughput_row
from tenax.orchestrator.spec import load_spec, plan_for_spec
from tenax.parallel import ParallelLayout
from tenax.parallel import cost_model as cm
from tenax.testing.jobs import SMALL

TWO_NODES = ["resources.nodes=2", "resources.min_nodes=2", "resources.max_nodes=2",
             "resources.gpus_per_node=2"]


def spec_and_layout(tmp_path: Path, *extra: str) -> tuple:
    spec = load_spec(overrides=[*SMALL, *TWO_NODES, f"checkpoint.uri=file://{tmp_path}/ck",
                                "name=links", *extra])
    r = spec.resources
    return spec, plan_for_spec(spec, r.world_size, r.gpus_per_node, pin_zero=True).layout


# ---- the rules, without a job ----------------------------------------------------------------
def test_sizes_are_the_planners_per_collective_bytes(tmp_path):
    spec, layout = spec_and_layout(tmp_path, "parallel.tp=2")
    assert (layout.dp, layout.tp) == (2, 2)
    m = spec.model.args()
    sizes = planner_sizes(m, layout, spec.train.global_batch_size, spec.train.dtype)
    assert set(sizes) == {"dp", "tp"}
    # the cost model's per-rank bytes are a ring all-reduce's 2(n-1)/n of the message
    assert spec.train.dtype == "float32"
    grads = m.num_params() / 2 * 4  # fp32 gradients, 4 B/param, sharded over tp=2
    assert sizes["dp"] == pytest.approx(cm.dp_comm(grads, 2, 1).nbytes / (2 * (2 - 1) / 2), 1e-6)
    b, s = spec.train.global_batch_size // 2, m.seq_len
    one_tp = cm.tp_comm(b, s, m.dim, 2, 1, 4).nbytes / 4  # 4 all-reduces of one layer
    assert moved_bytes("all_reduce", sizes["tp"], 2) == pytest.approx(one_tp, 1e-6)
    tasks = link_tasks(m, layout, spec.train.global_batch_size, spec.train.dtype)
    assert {t.dim: t.kind for t in tasks} == {"dp": "all_reduce", "tp": "all_reduce"}
    assert {t.dim: t.groups for t in tasks} == {"dp": ((0, 2), (1, 3)), "tp": ((0, 1), (2, 3))}
    assert all(MIN_PROBE_BYTES <= t.nbytes <= MAX_PROBE_BYTES for t in tasks)


def test_pipeline_and_context_groups_use_send_recv():
    m = load_spec(overrides=SMALL).model.args()
    layout = ParallelLayout(pp=2, cp=2, micro_batch_size=1)
    tasks = {t.dim: t for t in link_tasks(m, layout, 8, "bfloat16")}
    assert set(tasks) == {"pp", "cp"} and {t.kind for t in tasks.values()} == {"ring"}
    assert moved_bytes("all_to_all", 100, 4) == cm.all_to_all(100, 4).nbytes
    assert moved_bytes("ring", 100, 4) == 100


def test_links_row_compares_with_the_median_group_on_cpu_and_names_slow_nodes():
    names = node_names(["aaaaaaaaaa"] * 2 + ["bbbbbbbbbb"] * 2, 2)
    assert names[2] == "node 1 (bbbbbbbb)"
    task = link_tasks(load_spec(overrides=SMALL).model.args(), ParallelLayout(dp=2, tp=2),
                      8, "bfloat16")
    fast = {r: {"dp": 0.01, "tp": 0.01} for r in range(4)}
    sizes = {"dp": 1 << 20, "tp": 1 << 20}
    row = links_row(group_figures(task, fast, names), {"dp": None, "tp": None}, sizes)
    assert row.verdict == "pass" and "median group" in row.expected
    slow = {**fast, 3: {"dp": 0.01, "tp": 0.05}}  # tp group [2, 3] five times slower
    row = links_row(group_figures(task, slow, names), {"dp": None, "tp": None}, sizes)
    assert row.verdict == "warn" and "node 1" in row.detail and "node 0" not in row.detail
    assert "tp group [2, 3]" in row.measured


def test_links_row_against_the_planner_figure_on_cuda():
    fig = GroupFigure("dp", (0, 1), ("node 0 (x)",), 1.0, 20e9)
    assert links_row([fig], {"dp": 50e9}, {"dp": 1 << 20}).verdict == "warn"
    fig = GroupFigure("dp", (0, 1), ("node 0 (x)",), 1.0, 40e9)
    row = links_row([fig], {"dp": 50e9}, {"dp": 1 << 20})
    assert row.verdict == "pass" and "0.80x" in row.measured
    assert links_row([], {}, {}).verdict == "pass"
    layout = ParallelLayout(dp=2, tp=2)
    assert assumed_Bps(True, layout, "tp", 2) == cm.NVLINK.bandwidth_Bps
    assert assumed_Bps(True, layout, "dp", 2) == cm.INFINIBAND.bandwidth_Bps
    assert assumed_Bps(False, layout, "dp", 2) is None


def test_a_second_measurement_keeps_each_groups_better_figure():
    first = {0: {"dp": 0.5, "tp": 0.1}, 1: {"dp": 0.2, "tp": 0.1}}
    again = [{"cuda": False, "seconds": {"dp": 0.1, "tp": 0.3}},
             {"cuda": False, "seconds": {"dp": 0.3, "tp": 0.1}}]
    assert best_of(first, again) == {0: {"dp": 0.1, "tp": 0.1}, 1: {"dp": 0.2, "tp": 0.1}}
    assert best_of({}, again) == {0: {"dp": 0.1, "tp": 0.3}, 1: {"dp": 0.3, "tp": 0.1}}


def test_slow_drills_and_the_throughput_row_name_the_node():
    from tenax.orchestrator.chaos.faults import parse_chaos

    drill = parse_chaos("slow rank=2 at=1 factor=3; kill rank=0 at=2")
    assert slow_factors(drill, 4, 2) == [1.0, 1.0, 3.0, 1.0]
    names = node_names(["a" * 8] * 2 + ["b" * 8] * 2, 2)
    row = throughput_row({0: 100.0, 1: 100.0, 2: 20.0, 3: 100.0}, 1000.0, names)
    assert row.verdict == "warn" and "2 (20)" in row.detail and "node 1" in row.detail


# ---- real Ray: two raylets -----------------------------------------------------------------------
@pytest.mark.slow
def test_a_slowed_node_is_named_and_a_healthy_cluster_warns_nothing(tmp_path):
    """On a `cluster_utils` cluster of two nodes (tp groups inside each node): healthy, the
    links row passes; with chaos `slow` (8x) on node 1's ranks, the links row warns naming node 1
    and the throughput row names it too."""
    from tenax.orchestrator.chaos.faults import parse_chaos
    from tenax.orchestrator.preflight import links_check, run_preflight
    from tenax.testing.clusters import ray_cluster

    spec, layout = spec_and_layout(tmp_path, "parallel.tp=2")
    with ray_cluster(2):
        healthy = links_check(spec, layout)
        assert healthy.verdict == "pass", healthy
        drill = parse_chaos("slow rank=2 at=1 factor=8; slow rank=3 at=1 factor=8")
        report = run_preflight(spec, 4, chaos=drill)
    rows = {r.name: r for r in report.rows}
    assert rows["links"].verdict == "warn", rows["links"]
    assert "node 1" in rows["links"].detail and "node 0" not in rows["links"].detail
    assert "tp group [2, 3]" in rows["links"].measured
    assert rows["throughput"].verdict == "warn" and "node 1" in rows["throughput"].detail
    assert "node 0" not in rows["throughput"].detail


# ---- bad node screening --------------------------------------------------------------------
def test_the_node_named_most_is_singled_out_and_ties_name_none():
    from tenax.orchestrator.preflight.screening import singled_out

    nodes = {"a", "b", "c"}
    assert singled_out([("b",)], ["b"], nodes) == "b"
    assert singled_out([("a", "b")], [], nodes) == ""  # one cross-node group: either could be
    assert singled_out([("a", "b"), ("b", "c")], [], nodes) == "b"
    assert singled_out([], [], nodes) == ""
    assert singled_out([("a",)], ["a"], {"a"}) == ""  # the job's only node stays


@pytest.mark.slow
@pytest.mark.timeout(600)  # two preflights (three job starts each) and the job
def test_exclude_slow_nodes_replaces_the_job_without_the_named_node(tmp_path):
    """Three raylets, a two-node job: the first preflight names the node of the slowed ranks;
    that node is held from the job, the preflight repeated runs on the two others, and the
    hold is given back on release."""
    import ray

    from tenax.orchestrator.chaos.faults import parse_chaos
    from tenax.orchestrator.preflight import run_preflight
    from tenax.orchestrator.service.scheduler import cluster_now
    from tenax.testing.clusters import ray_cluster

    spec, _ = spec_and_layout(tmp_path, "parallel.tp=2", "resources.max_nodes=3",
                              "resources.exclude_slow_nodes=true")
    drill = parse_chaos("slow rank=2 at=1 factor=8; slow rank=3 at=1 factor=8")
    with ray_cluster(3):
        events: list = []
        report = run_preflight(spec, 3, publish=lambda kind, f: events.append((kind, f)),
                               chaos=drill)
        rows = {r.name: r for r in report.rows}
        assert "screening" in rows, report.rows
        held = report.cordon.node_id
        assert rows["screening"].measured.startswith("excluded node 1 (" + held[:8])
        others = " ".join(r.detail + r.measured for r in report.rows if r.name != "screening")
        assert held[:8] not in others  # the repeated preflight ran on the two other nodes
        assert held in {n["NodeID"] for n in ray.nodes()}
        assert ray.get(report.cordon.actor.ready.remote(), timeout=30)  # the hold lives
        # The service's scheduler counts the held node as taken: no job is admitted onto it.
        assert report.held_node == held
        everyone = cluster_now().node_gpus
        assert len(cluster_now(held=frozenset({held})).node_gpus) == len(everyone) - 1 == 2
        report.release()
        assert report.cordon is None and report.held_node == ""
    assert [k for k, _ in events] == ["preflight"]  # one event: the final report
    assert events[0][1]["rows"][-1]["name"] == "screening"
