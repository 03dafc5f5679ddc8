"""ParallelLayout: coordinates, groups, nodes, validation, and real DeviceMesh construction."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tenax.parallel.config import ModelArgs
from tenax.parallel.errors import LayoutError
from tenax.parallel.layout import MESH_DIMS, ParallelLayout, degree_problems
from tenax.workers.errors import SpecError
from tenax.workers.spec import layout_from_spec, load_spec
from tests.distributed import free_port, init_gloo, run_ranks, shutdown_gloo


@st.composite
def layouts(draw: st.DrawFn) -> ParallelLayout:
    dp, cp = draw(st.integers(1, 6)), draw(st.integers(1, 3))
    ep = draw(st.sampled_from([d for d in range(1, dp * cp + 1) if (dp * cp) % d == 0]))
    return ParallelLayout(dp=dp, tp=draw(st.sampled_from([1, 2, 4, 8])), pp=draw(st.integers(1, 4)),
                          cp=cp, ep=ep)


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_rank_coords_bijection(layout):
    seen = set()
    for r in range(layout.world_size):
        c = layout.coords(r)
        assert layout.rank(**c) == r
        seen.add(tuple(c.values()))
    assert len(seen) == layout.world_size


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_groups_partition_ranks(layout):
    for dim in MESH_DIMS + ("ep",):
        groups = layout.groups(dim)
        flat = [r for g in groups for r in g]
        assert sorted(flat) == list(range(layout.world_size)), dim
        size = {"ep": layout.ep}.get(dim, getattr(layout, dim))
        assert all(len(g) == size for g in groups)
        # within a group only this dimension's coordinate changes
        if dim in MESH_DIMS:
            for g in groups:
                coords = [layout.coords(r) for r in g]
                for other in MESH_DIMS:
                    if other != dim:
                        assert len({c[other] for c in coords}) == 1


@settings(max_examples=200, deadline=None)
@given(layouts(), st.sampled_from([1, 2, 4, 8, 16]))
def test_tp_groups_stay_in_a_node(layout, gpus_per_node):
    if layout.tp <= gpus_per_node and gpus_per_node % layout.tp == 0:
        assert not layout.crosses_nodes("tp", gpus_per_node)
    for g in layout.groups("tp"):
        assert g == list(range(g[0], g[0] + layout.tp))  # consecutive ranks


def test_known_order_and_nodes():
    lay = ParallelLayout(dp=2, tp=2, pp=2)
    assert lay.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.coords(5) == {"pp": 1, "dp": 0, "cp": 0, "tp": 1}
    assert [lay.node_of(r, 4) for r in range(8)] == [0] * 4 + [1] * 4
    assert lay.crosses_nodes("pp", 4) and not lay.crosses_nodes("dp", 4)
    assert lay.topology(4)["pp"] == {"size": 2, "groups": 4, "crosses_nodes": True}
    assert ParallelLayout(dp=2, cp=2, ep=2).groups("ep") == [[0, 1], [2, 3]]


def test_validation_messages():
    model = load_spec().model.args()
    with pytest.raises(LayoutError, match=r"parallel.tp: 3 does not divide model.n_heads=8"):
        ParallelLayout(dp=1, tp=3).validate(model, 3)
    with pytest.raises(LayoutError, match=r"= 4 != world size 6"):
        ParallelLayout(dp=4).validate(model, 6)
    with pytest.raises(LayoutError, match=r"exceeds model.n_layers=4"):
        ParallelLayout(pp=8).validate(model, 8)
    with pytest.raises(LayoutError, match=r"parallel.cp: 2\*3 does not divide model.seq_len=128"):
        ParallelLayout(cp=3).validate(model, 3)
    with pytest.raises(LayoutError, match=r"parallel.ep: 2 needs model.moe to be set"):
        ParallelLayout(dp=2, ep=2).validate(model, 2)
    with pytest.raises(LayoutError, match=r"does not divide train.global_batch_size=30"):
        ParallelLayout(dp=4, micro_batch_size=2).validate(model, 4, 30)
    with pytest.raises(LayoutError, match=r"ep: 3 does not divide dp\*cp=2"):
        ParallelLayout(dp=2, ep=3)
    with pytest.raises(LayoutError, match=r"layout.tp: 0"):
        ParallelLayout(tp=0)
    moe = load_spec(overrides=["model.moe={num_experts: 6}"]).model.args()
    with pytest.raises(LayoutError,
                       match=r"parallel.ep: 4 does not divide model.moe.num_experts=6"):
        ParallelLayout(dp=4, ep=4).validate(moe, 4)


def test_spec_and_layout_check_one_rule_set():
    """The spec's cross-field checks and the layout's validation are the same rules
    (tenax.parallel.layout.degree_problems), so they reject alike, with the same words."""
    model = load_spec().model.args()
    with pytest.raises(SpecError) as spec_err:
        load_spec(overrides=["parallel.tp=3"])
    with pytest.raises(LayoutError) as layout_err:
        ParallelLayout(dp=1, tp=3).validate(model, 3)
    for err in (spec_err, layout_err):
        assert "parallel.tp: 3 does not divide model.n_heads=8" in str(err.value)
    with pytest.raises(SpecError, match="pp_virtual_stages: 2 needs pp_schedule"):
        load_spec(overrides=["parallel.pp_virtual_stages=2"])
    assert "pp_virtual_stages: 2 needs pp_schedule" in " ".join(
        ParallelLayout(pp=2, pp_virtual_stages=2).problems(model))
    # "auto" degrees are left to the planner; dp "auto" still checks micro_batch_size alone.
    assert degree_problems(model, {"tp": "auto", "pp": "auto", "cp": "auto", "ep": "auto"}) == []
    assert degree_problems(model, {"dp": "auto", "micro_batch_size": 5}, 32) == [
        "parallel.micro_batch_size: 5 does not divide train.global_batch_size=32"]


def test_model_args_are_built_from_the_spec():
    spec = load_spec(overrides=["model.moe={num_experts: 4, top_k: 2}"])
    args = spec.model.args()
    assert isinstance(args, ModelArgs) and args.moe is not None and args.moe.num_experts == 4
    assert ModelArgs.from_dict(args.to_dict()) == args
    assert args.num_params() == spec.model.num_params() and args.head_dim == spec.model.head_dim
    with pytest.raises(ValueError, match="unknown keys \\['dimm'\\]"):
        ModelArgs.from_dict({"dimm": 8})


def test_layout_from_spec_fills_auto_dp():
    spec = load_spec(overrides=["parallel.tp=2"])
    lay = layout_from_spec(spec, 8)
    assert (lay.dp, lay.tp, lay.micro_batch_size) == (4, 2, 2)
    assert lay.accumulation_steps(32) == 4
    with pytest.raises(LayoutError, match="cannot fill world size 5"):
        layout_from_spec(spec, 5)
    with pytest.raises(LayoutError, match="needs the planner"):
        layout_from_spec(load_spec(overrides=["parallel.tp=auto"]), 4)
    assert ParallelLayout.from_dict(lay.to_dict()) == lay


def _mesh_then_rebuild(rank: int, world: int, second_port: int) -> dict:
    import torch.distributed as dist

    first = ParallelLayout(dp=2, tp=2).build_mesh("cpu")
    out = {"tp": dist.get_process_group_ranks(first["tp"].get_group()),
           "dp": dist.get_process_group_ranks(first["dp"].get_group()),
           "names": first.mesh_dim_names}
    shutdown_gloo()
    if rank < 2:  # re-form a smaller world in the same process, as warm recovery will
        init_gloo(rank, 2, second_port)
        second = ParallelLayout(dp=1, tp=2).build_mesh("cpu")
        out["second_tp"] = dist.get_process_group_ranks(second["tp"].get_group())
        out["second_size"] = second.size()
    return out


@pytest.mark.timeout(120)
def test_build_mesh_then_rebuild_smaller_in_same_process():
    results = run_ranks(_mesh_then_rebuild, 4, free_port())
    assert results[0]["names"] == MESH_DIMS
    assert [r["tp"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["dp"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert results[0]["second_tp"] == [0, 1] and results[1]["second_size"] == 2
