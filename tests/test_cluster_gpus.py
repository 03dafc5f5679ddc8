"""The controller plans with the GPUs the cluster has: their memory from Ray's accelerator type,
or the spec's `resources.gpu_mem_gib`; 80 GiB only when neither says."""
from __future__ import annotations

import tempfile

import pytest

from tenax.orchestrator.job.scaling_policy import ScalingPolicy
from tenax.orchestrator.placement.capacity import Capacity
from tenax.orchestrator.presets import PRESETS
from tenax.orchestrator.spec import JobSpec, load_spec, plan_for_spec
from tenax.parallel import GPUS, gpus_from_ray_resources


def llama8b(**resources: object) -> JobSpec:
    """llama3-8b pinned to tp8 on one 8-GPU node: `none` fits 80 GiB, not 24."""
    return JobSpec.model_validate({
        "model": PRESETS["llama3-8b"], "parallel": {"tp": 8, "dp": 1, "micro_batch_size": 1},
        "resources": {"gpus_per_node": 8, "nodes": 1, "min_nodes": 1, "device": "cuda",
                      **resources},
        "train": {"global_batch_size": 64, "dtype": "bfloat16"},
        "checkpoint": {"memory_every_steps": 0}})


def test_the_smallest_named_gpu_of_the_nodes_with_gpus_is_planned_with() -> None:
    h200 = {"GPU": 8, "CPU": 64, "accelerator_type:H200": 1}
    l4 = {"GPU": 4, "accelerator_type:L4": 1}
    found = gpus_from_ray_resources([{"CPU": 4}, h200])  # a GPU-less head is no GPU node
    assert found is not None and found.label == "H200" and found.model is GPUS["h200"]
    assert found.gpu_mem_gib == pytest.approx(141e9 / 2 ** 30)
    assert found.options()["peak_flops"] == GPUS["h200"].peak_bf16_flops
    mixed = gpus_from_ray_resources([h200, l4])
    assert mixed is not None and mixed.label == "L4" and mixed.model is None
    assert mixed.gpu_mem_gib == pytest.approx(24e9 / 2 ** 30) and mixed.options() == {}
    a100 = gpus_from_ray_resources([{"GPU": 8, "accelerator_type:A100": 1}])
    assert a100 is not None and a100.gpu_mem_gib == pytest.approx(40e9 / 2 ** 30)
    a100_80 = gpus_from_ray_resources([{"GPU": 8, "accelerator_type:A100": 1,
                                        "accelerator_type:A100-80G": 1}])
    assert a100_80 is not None and a100_80.label == "A100"  # the smaller of what it is called
    assert gpus_from_ray_resources([{"GPU": 8}]) is None  # unnamed: unknown
    assert gpus_from_ray_resources([h200, {"GPU": 8, "accelerator_type:X9": 1}]) is None
    assert gpus_from_ray_resources([]) is None


def test_the_controller_plans_with_the_named_gpus_memory_and_says_so() -> None:
    spec = llama8b()
    assumed = ScalingPolicy().make_decision(spec, Capacity(1), 1)
    assert assumed.recompute == "none" and "as Ray names them" not in assumed.reason
    small = gpus_from_ray_resources([{"GPU": 8, "accelerator_type:L4": 1}])
    decision = ScalingPolicy().make_decision(spec, Capacity(1, gpus=small), 1)
    assert decision.recompute != "none", decision.reason  # 22 GiB: something is recomputed
    assert "(L4, 22.4 GiB each, as Ray names them)" in decision.reason
    reference = plan_for_spec(spec, 8, 8, gpu_mem_gib=24e9 / 2 ** 30, pin_zero=True).best
    assert decision.recompute == reference.recompute
    assert f"of {reference.budget_bytes / 2 ** 30:.1f} GiB" in decision.reason  # its budget


def test_the_specs_gpu_memory_wins_over_the_named_gpus_and_cpu_ranks_ignore_them() -> None:
    small = gpus_from_ray_resources([{"GPU": 8, "accelerator_type:L4": 1}])
    told = ScalingPolicy().make_decision(llama8b(gpu_mem_gib=80), Capacity(1, gpus=small), 1)
    assert told.recompute == "none" and "as Ray names them" not in told.reason
    cpu = load_spec(overrides=["resources.device=cpu"])  # each slot's share of the host's RAM
    with_gpus = plan_for_spec(cpu, 2, 2, pin_zero=True, detected=small)
    without = plan_for_spec(cpu, 2, 2, pin_zero=True)
    assert with_gpus.best.budget_bytes == without.best.budget_bytes
    assert with_gpus.best.budget_bytes != plan_for_spec(cpu, 2, 2, gpu_mem_gib=small.gpu_mem_gib,
                                                        pin_zero=True).best.budget_bytes


def test_gpu_mem_gib_must_be_positive() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="gpu_mem_gib"):
        llama8b(gpu_mem_gib=0)


def test_ray_names_the_nodes_gpus_and_capacity_reads_them() -> None:
    """A real Ray node whose resources carry an accelerator type, as Ray sets them on a GPU
    host: the capacity the controller plans from names it."""
    import ray

    from tenax.testing.clusters import loopback
    from tenax.orchestrator.placement.capacity import cluster_capacity, cluster_gpus

    loopback()
    ray.init(num_cpus=1, num_gpus=2, resources={"accelerator_type:H200": 1},
             include_dashboard=False, _node_ip_address="127.0.0.1",
             _temp_dir=tempfile.mkdtemp(prefix="tenax-ray-"),
             log_to_driver=False, configure_logging=False)
    try:
        capacity = cluster_capacity(2, {})
        assert capacity.nodes == 1 and capacity.gpus is not None
        assert capacity.gpus.label == "H200" and cluster_gpus(2) == capacity.gpus
        assert cluster_capacity(4, {}).gpus is None  # no whole node of 4: nothing to plan on
    finally:
        ray.shutdown()
