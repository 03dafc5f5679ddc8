"""MoE models leave for (and come from) Hugging Face as Mixtral.

Export: checkpoints of real 2-rank MoE jobs (dp2, and ep2 where the experts are Shard(0)
DTensors) load into transformers' MixtralForCausalLM without complaint and give the engine's
logits. Import: a MixtralForCausalLM saved with save_pretrained starts a Tenax MoE job whose
first-step loss is transformers' loss on the same batch. The capacity is set to
num_experts / top_k so Tenax drops nothing (HF's Mixtral is dropless); models are tiny
MixtralConfigs built here, nothing is downloaded.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import hf_jobs
from tests.distributed import run_ranks

pytest.importorskip("transformers")

EXPORT_LAYOUTS = {"dp2": {"dp": 2}, "ep2": {"dp": 2, "ep": 2}}
IMPORT_LAYOUTS = {"dp1": {"dp": 1}, "ep2": {"dp": 2, "ep": 2}, "zero3": {"dp": 2, "zero": 3}}
E, TOP_K = 4, 2


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """name -> (checkpoint URI, full params at the saved step), from 2-rank MoE jobs."""
    return hf_jobs.save_checkpoints(tmp_path_factory.mktemp("mixtral_ckpts"), EXPORT_LAYOUTS,
                                    hf_jobs.MOE_TINY)


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("mixtral") / "model"
    return path, hf_jobs.random_hf_mixtral(path, rope_theta=500000.0)


def _expected_keys(params: dict[str, torch.Tensor]) -> set[str]:
    from tenax.workers.hf.names import hf_parts

    return {key for n, p in params.items() for key, _ in hf_parts(n, tuple(p.shape))}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPORT_LAYOUTS))
def test_export_gives_tenax_logits(checkpoints: dict[str, Any], tmp_path: Path, name: str,
                                   caplog: pytest.LogCaptureFixture) -> None:
    from safetensors import safe_open

    from tenax.workers.hf.export import export_hf

    uri, params = checkpoints[name]
    with caplog.at_level(logging.INFO, logger="tenax.workers.hf.export"):
        result = export_hf(uri, str(tmp_path / "hf"), dtype="float32")
    assert "HF's MixtralForCausalLM is dropless" in caplog.text
    assert result.extra["drops_possible"] is False
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert config["model_type"] == "mixtral"
    assert (config["num_local_experts"], config["num_experts_per_tok"],
            config["router_aux_loss_coef"], config["sliding_window"]) == (E, TOP_K, 0.01, None)
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as handle:
        assert set(handle.keys()) == _expected_keys(params)
        assert result.tensors == len(handle.keys())
        w2 = handle.get_tensor("model.layers.1.block_sparse_moe.experts.3.w2.weight")
    # HF's Linear weight [out, in] is the transpose of Tenax's stacked slice [in, out]
    torch.testing.assert_close(w2, params["layers.1.feed_forward.experts.w2.weight"][3].t(),
                               rtol=0, atol=0)
    tokens = hf_jobs.tokens_for()
    theirs = hf_jobs.hf_logits(hf_jobs.hf_model(tmp_path / "hf", "MixtralForCausalLM"), tokens)
    ours = hf_jobs.tenax_logits(hf_jobs.hf_spec(hf_jobs.MOE_TINY), params, tokens)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_sharded_export_and_drop_warning(checkpoints: dict[str, Any], tmp_path: Path,
                                         caplog: pytest.LogCaptureFixture) -> None:
    """Shards split between stacked tensors, the index names every expert; a capacity that can
    drop is a warning that says why HF's logits may differ (the checkpoint's capacity 2.0
    cannot; a --spec saying 1.25 is refused, not exported as another model)."""
    from tenax.workers.hf.export import ExportError, export_hf, note_dropless
    from tenax.workers.hf.source import model_section

    uri, params = checkpoints["ep2"]
    spec = hf_jobs.hf_spec(["model.moe={num_experts: 4, top_k: 2, capacity_factor: 1.25}"])
    dump = spec.model_dump(mode="json", by_alias=True)
    with pytest.raises(ExportError, match=r"--spec: model.moe.capacity_factor is 1.25, the "
                                          r"checkpoint's is 2.0"):
        export_hf(uri, str(tmp_path / "hf"), spec=dump)
    with caplog.at_level(logging.WARNING, logger="tenax.workers.hf.export"):
        assert note_dropless(model_section(dump))["drops_possible"] is True
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("dropless" in m and "capacity_factor=1.25 < num_experts/top_k=2" in m
               for m in warned), warned
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tenax.workers.hf.export"):
        result = export_hf(uri, str(tmp_path / "hf"), dtype="float32", shard_bytes=60_000,
                           batch_bytes=10_000)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    assert result.extra["drops_possible"] is False and len(result.files) > 2
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == _expected_keys(params)
    assert set(index["weight_map"].values()) == set(result.files)
    tokens = hf_jobs.tokens_for()
    theirs = hf_jobs.hf_logits(hf_jobs.hf_model(tmp_path / "hf", "MixtralForCausalLM"), tokens)
    ours = hf_jobs.tenax_logits(hf_jobs.hf_spec(hf_jobs.MOE_TINY), params, tokens)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def _hf_loss(model: Any, spec: Any) -> float:
    from tenax.workers.data import TokenDataLoader

    inputs, targets = TokenDataLoader.from_job_spec(spec).next_batch(0, 1)
    logits = hf_jobs.hf_logits(model, inputs)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             targets.reshape(-1)).item()


def _import_extra(path: Path) -> list[str]:
    # from_hf takes the experts and top_k; the capacity is Tenax's own key
    return [f"model.init_from={path}", "model.from_hf=true", "model.seq_len=16",
            "model.moe.capacity_factor=2.0"]


def _world(layout: dict[str, int]) -> int:
    return layout.get("dp", 1)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(IMPORT_LAYOUTS))
def test_first_step_loss_is_hf_loss(mixtral_dir: tuple[Path, Any], name: str) -> None:
    path, model = mixtral_dir
    extra = _import_extra(path)
    spec = hf_jobs.hf_spec(extra)
    assert (spec.model.moe.num_experts, spec.model.moe.top_k) == (E, TOP_K)
    assert (spec.model.moe.capacity_factor, spec.model.moe.aux_loss_coef) == (2.0, 0.01)
    assert spec.model.rope_theta == 500000.0
    layout = IMPORT_LAYOUTS[name]
    out = run_ranks(hf_jobs.first_step_job, _world(layout), layout, extra)
    assert out[0]["loss"] == pytest.approx(_hf_loss(model, spec), rel=1e-5, abs=1e-6)
    _assert_params_are_hf(out[0]["params"], path)


def _assert_params_are_hf(params: dict[str, torch.Tensor], directory: Path) -> None:
    """Every Tenax tensor equals the HF model's (stacked experts: per-expert transposes)."""
    from safetensors import safe_open

    from tenax.workers.hf.names import hf_parts

    # the on-disk per-expert tensors (transformers 5 fuses experts in memory)
    with safe_open(str(directory / "model.safetensors"), framework="pt") as handle:
        for key, value in params.items():
            parts = hf_parts(key, tuple(value.shape))
            want = torch.stack([handle.get_tensor(k).t() for k, _ in parts]) \
                if len(parts) > 1 else handle.get_tensor(parts[0][0])
            torch.testing.assert_close(value, want.reshape(value.shape), rtol=0, atol=0)


def test_import_in_process_gives_hf_logits(tmp_path: Path) -> None:
    """The loader alone (one process, no job): Tenax's forward equals HF Mixtral's."""
    from tenax.parallel import Transformer
    from tenax.workers.hf.load import ExpertStack, check_hf_weights, load_hf_into

    model = hf_jobs.random_hf_mixtral(tmp_path / "hf", seed=3)
    spec = hf_jobs.hf_spec(_import_extra(tmp_path / "hf"))
    args = spec.model.args()
    found = check_hf_weights(str(tmp_path / "hf"), args)
    stack = found["layers.0.feed_forward.experts.w1.weight"]
    assert isinstance(stack, ExpertStack) and len(stack.parts) == E
    with torch.device("meta"):
        tenax = Transformer(args)
    tenax.to_empty(device="cpu")
    assert load_hf_into([tenax], args, str(tmp_path / "hf")) == len(found)
    tokens = hf_jobs.tokens_for()
    with torch.no_grad():
        ours = tenax(tokens).float()
    torch.testing.assert_close(ours, hf_jobs.hf_logits(model, tokens), rtol=1e-5, atol=1e-5)


# ---- config mapping and errors ---------------------------------------------------------------
def test_config_round_trip() -> None:
    from tenax.workers.hf.config import hf_config_from_model, model_fields_from_hf
    from tenax.workers.hf.source import model_section

    spec = hf_jobs.hf_spec(hf_jobs.MOE_TINY).model_dump(mode="json", by_alias=True)
    model = model_section(spec)
    config = hf_config_from_model(model, "bfloat16")
    assert {k: config[k] for k in ("architectures", "model_type", "num_local_experts",
                                   "num_experts_per_tok", "router_aux_loss_coef")} == \
        {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
         "num_local_experts": E, "num_experts_per_tok": TOP_K, "router_aux_loss_coef": 0.01}
    fields = model_fields_from_hf(config)
    assert fields["moe"] == {"num_experts": E, "top_k": TOP_K}
    assert {k: fields[k] for k in ("dim", "n_layers", "n_kv_heads", "ffn_hidden")} == \
        {"dim": 64, "n_layers": 2, "n_kv_heads": 2, "ffn_hidden": 96}


def test_llama_dir_into_moe_spec_and_the_reverse(tmp_path: Path) -> None:
    from tenax.workers.errors import SpecError

    llama, mixtral = tmp_path / "llama", tmp_path / "mixtral"
    hf_jobs.random_hf_model(llama)
    hf_jobs.random_hf_mixtral(mixtral)
    with pytest.raises(SpecError, match="model.moe: the spec has .*config.json describes a "
                                        "dense Llama"):
        hf_jobs.hf_spec([f"model.init_from={llama}", "model.from_hf=true"] + hf_jobs.MOE_TINY)
    with pytest.raises(SpecError, match="model.moe: the spec has None, config.json describes "
                                        "a Mixtral with num_experts=4, top_k=2"):
        hf_jobs.hf_spec([f"model.init_from={mixtral}"])
    with pytest.raises(SpecError, match="model.moe: the spec has None"):
        hf_jobs.hf_spec([f"model.init_from={mixtral}", "model.from_hf=true", "model.moe=null"])
    # past the spec (the loader's own check): each expert tensor the Llama lacks is named
    from tenax.workers.hf.load import HFLoadError, check_hf_weights

    with pytest.raises(HFLoadError, match=r"'model.layers.0.block_sparse_moe.gate.weight' "
                                          r"\(Tenax 'layers.0.feed_forward.router.weight'\) is "
                                          r"missing"):
        check_hf_weights(str(llama), hf_jobs.hf_spec(hf_jobs.MOE_TINY).model.args())


def test_expert_keys_differ_by_name(tmp_path: Path) -> None:
    from tenax.workers.errors import SpecError

    hf_jobs.random_hf_mixtral(tmp_path / "hf")
    with pytest.raises(SpecError) as info:
        hf_jobs.hf_spec([f"model.init_from={tmp_path / 'hf'}",
                         "model.moe={num_experts: 8, top_k: 1}"])
    text = str(info.value)
    assert "model.moe.num_experts: the spec has 8, config.json has 4 (num_local_experts)" in text
    assert "model.moe.top_k: the spec has 1, config.json has 2 (num_experts_per_tok)" in text
    with pytest.raises(SpecError, match="model.moe.top_k: the spec has 1, config.json has 2"):
        hf_jobs.hf_spec([f"model.init_from={tmp_path / 'hf'}", "model.from_hf=true",
                         "model.moe.top_k=1"])


def test_sliding_window_refused(tmp_path: Path) -> None:
    from tenax.workers.errors import SpecError

    hf_jobs.random_hf_mixtral(tmp_path / "hf", sliding_window=8)
    with pytest.raises(SpecError, match="sliding_window=8 is not supported"):
        hf_jobs.hf_spec([f"model.init_from={tmp_path / 'hf'}", "model.from_hf=true"])


def test_missing_expert_tensor_named(mixtral_dir: tuple[Path, Any], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from tenax.workers.hf.load import HFLoadError, check_hf_weights

    path, _ = mixtral_dir
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "config.json").write_bytes((path / "config.json").read_bytes())
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    tensors["model.layers.0.block_sparse_moe.gate.weight"] = \
        tensors["model.layers.0.block_sparse_moe.gate.weight"][:-1].contiguous()
    save_file(tensors, str(tmp_path / "cut" / "model.safetensors"), metadata={"format": "pt"})
    args = hf_jobs.hf_spec(_import_extra(tmp_path / "cut")).model.args()
    with pytest.raises(HFLoadError) as info:
        check_hf_weights(str(tmp_path / "cut"), args)
    assert ("'model.layers.1.block_sparse_moe.experts.3.w2.weight' (Tenax "
            "'layers.1.feed_forward.experts.w2.weight') is missing") in str(info.value)
    assert ("'model.layers.0.block_sparse_moe.gate.weight' has shape [3, 64], the model needs "
            "[4, 64]") in str(info.value)
