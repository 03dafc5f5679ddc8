"""`tenax export hf`: checkpoints saved in dp2, tp2 and pp2 load into transformers'
LlamaForCausalLM without complaint and give the engine's logits (MoE models, exported as
Mixtral: tests/test_hf_mixtral.py).

Checkpoints come from real 2-rank jobs (tests/hf_jobs.py), one per layout, made once per module.
The reference is transformers itself; the Tenax side is the engine's own forward over the
parameters the job gathered, so a wrong name, layout, rotary pairing, norm eps or shard split
shows as a logits mismatch.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import hf_jobs
from tests.distributed import run_ranks

pytest.importorskip("transformers")

LAYOUTS = {"dp2": {"dp": 2}, "tp2": {"tp": 2}, "pp2": {"pp": 2}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """name -> (checkpoint URI, full params at the saved step), from 2-rank jobs."""
    return hf_jobs.save_checkpoints(tmp_path_factory.mktemp("hf_ckpts"), LAYOUTS, [])


def _assert_logits(out: Path, params: dict[str, torch.Tensor], extra: list[str]) -> None:
    tokens = hf_jobs.tokens_for()
    theirs = hf_jobs.hf_logits(hf_jobs.hf_model(out), tokens)
    ours = hf_jobs.tenax_logits(hf_jobs.hf_spec(extra), params, tokens)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_export_gives_tenax_logits(checkpoints: dict[str, Any], tmp_path: Path,
                                   name: str) -> None:
    from tenax.workers.hf.export import export_hf

    uri, params = checkpoints[name]
    result = export_hf(uri, str(tmp_path / "hf"), dtype="float32")
    assert result.step == 1 and result.files == ["model.safetensors"]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "float32"
    assert (config["hidden_size"], config["num_key_value_heads"], config["rms_norm_eps"]) == \
        (64, 2, 1e-5)
    _assert_logits(tmp_path / "hf", params, [])


@pytest.mark.slow
def test_sharded_export_with_index(checkpoints: dict[str, Any], tmp_path: Path) -> None:
    from tenax.workers.hf.export import export_hf

    uri, params = checkpoints["tp2"]
    result = export_hf(uri, str(tmp_path / "hf"), dtype="float32", shard_bytes=60_000,
                       batch_bytes=10_000)
    assert len(result.files) > 2
    assert result.files[0] == f"model-00001-of-{len(result.files):05d}.safetensors"
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(result.files)
    assert index["metadata"]["total_size"] == result.total_bytes
    _assert_logits(tmp_path / "hf", params, [])
    export_hf(uri, str(tmp_path / "hf"), dtype="float32")  # again, unsharded, same directory
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == \
        ["config.json", "model.safetensors"]  # the earlier shards and index are gone
    _assert_logits(tmp_path / "hf", params, [])


@pytest.mark.slow
def test_cli_export_bf16_and_errors(checkpoints: dict[str, Any], tmp_path: Path,
                                    capsys: pytest.CaptureFixture) -> None:
    from safetensors import safe_open

    from tenax.orchestrator.cli.main import main

    uri, params = checkpoints["pp2"]
    out = tmp_path / "hf"
    assert main(["export", "hf", uri, "--out", str(out), "--quiet"]) == 0
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        embed = handle.get_tensor("model.embed_tokens.weight")
    assert embed.dtype == torch.bfloat16
    torch.testing.assert_close(embed, params["tok_embeddings.weight"].bfloat16())
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert main(["export", "hf", uri, "--out", str(out), "--step", "7"]) == 2
    assert "--step 7: not a committed version" in capsys.readouterr().err
    assert main(["export", "hf", f"file://{tmp_path}/nothing", "--out", str(out)]) == 2
    assert "no committed checkpoint" in capsys.readouterr().err


@pytest.mark.slow
def test_tied_embeddings_export(tmp_path: Path) -> None:
    from safetensors import safe_open

    from tenax.workers.hf.export import export_hf

    extra = ["model.tie_embeddings=true"]
    uri = f"file://{tmp_path}/ckpt"
    params = run_ranks(hf_jobs.save_job, 2, uri, {"tp": 2}, extra)[0]
    assert "output.weight" not in params  # one tensor, one name
    export_hf(uri, str(tmp_path / "hf"), dtype="float32")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["tie_word_embeddings"]
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as handle:
        assert "lm_head.weight" not in handle.keys()
    _assert_logits(tmp_path / "hf", params, extra)


@pytest.mark.slow
def test_export_refusals_and_tokenizer(checkpoints: dict[str, Any], tmp_path: Path) -> None:
    """An MoE spec over a dense checkpoint is refused naming the expert tensors it lacks; the
    job's tokenizer.json is copied, its EOS in config.json."""
    from tenax.workers.hf.export import ExportError, export_hf

    uri, _ = checkpoints["dp2"]
    spec = hf_jobs.hf_spec().model_dump(mode="json", by_alias=True)
    moe = {**spec, "model": {**spec["model"], "moe": {"num_experts": 4, "top_k": 2}}}
    with pytest.raises(ExportError, match=r"the checkpoint lacks \['layers.0.feed_forward."
                                          r"experts.w1.weight'"):
        export_hf(uri, str(tmp_path / "moe"), spec=moe)
    assert not (tmp_path / "moe" / "config.json").exists()
    tokenizer = _word_tokenizer(tmp_path / "tok.json")
    with_tok = {**spec, "data": {**spec["data"], "tokenizer": str(tokenizer)}}
    export_hf(uri, str(tmp_path / "hf"), spec=with_tok)
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == 1


def _word_tokenizer(path: Path) -> Path:
    """A tiny word-level HF tokenizer.json built locally (id 1 is the EOS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(20)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path
