"""`tenax export hf` of a job that started from an HF directory, and of a version that cannot be
read whole.

The source's config.json keys that no model key fixes (Llama 3.1's max_position_embeddings of
131072, the token ids) come back in the export while the source is readable and still
describes the model. A version damaged (or removed by keep_last) while exported is refused with
exit 2 naming it, and leaves no truncated shard behind.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import hf_jobs
from tests.distributed import run_ranks

pytest.importorskip("transformers")

# Llama 3.1's shape of config (scaled rope, a context that no scaling key gives), tiny
SOURCE = dict(rope_theta=500000.0, max_position_embeddings=131072, bos_token_id=5,
              eos_token_id=[6, 7],
              rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8})


def _extra(path: Path) -> list[str]:
    return [f"model.init_from={path}", "model.from_hf=true"]


def _model(path: Path) -> dict[str, Any]:
    from tenax.workers.hf.source import model_section

    return model_section(hf_jobs.hf_spec(_extra(path)).to_dict())


def test_source_keys_kept_only_while_they_describe_the_model(tmp_path: Path) -> None:
    from tenax.workers.hf.config import hf_config_from_model, inherited_from_source

    hf_jobs.random_hf_model(tmp_path / "src", **SOURCE)
    model = _model(tmp_path / "src")
    source = inherited_from_source(model, str(tmp_path / "src"))
    assert source == {"max_position_embeddings": 131072, "bos_token_id": 5,
                      "eos_token_id": [6, 7]}
    config = hf_config_from_model(model, "float32", {}, source)
    assert (config["max_position_embeddings"], config["bos_token_id"],
            config["eos_token_id"]) == (131072, 5, [6, 7])
    # the job's own tokenizer names the ids; the context stays the source's
    config = hf_config_from_model(model, "float32", {"eos_token_id": 9, "bos_token_id": None},
                                  source)
    assert (config["max_position_embeddings"], config["bos_token_id"],
            config["eos_token_id"]) == (131072, None, 9)
    # a source that no longer describes the model, or is gone: the model section's rule
    assert inherited_from_source({**model, "norm_eps": 1e-6}, str(tmp_path / "src")) == {}
    assert inherited_from_source(model, str(tmp_path / "gone")) == {}
    assert hf_config_from_model(model, "float32")["max_position_embeddings"] == 8 * 8


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, dict[str, torch.Tensor]]:
    """(HF source, checkpoint URI, params at step 1) of a tp2 job started from the source."""
    root = tmp_path_factory.mktemp("hf_source")
    hf_jobs.random_hf_model(root / "src", **SOURCE)
    uri = f"file://{root}/ckpt"
    params = run_ranks(hf_jobs.save_job, 2, uri, {"tp": 2}, _extra(root / "src"))[0]
    return root / "src", uri, params


@pytest.mark.slow
def test_import_then_export_keeps_the_source_context(job: Any, tmp_path: Path) -> None:
    from tenax.workers.hf.export import export_hf

    src, uri, params = job
    export_hf(uri, str(tmp_path / "hf"), dtype="float32")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["max_position_embeddings"], config["bos_token_id"],
            config["eos_token_id"]) == (131072, 5, [6, 7])
    tokens = hf_jobs.tokens_for()
    theirs = hf_jobs.hf_logits(hf_jobs.hf_model(tmp_path / "hf"), tokens)
    ours = hf_jobs.tenax_logits(hf_jobs.hf_spec(_extra(src)), params, tokens)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_damaged_version_refused_and_no_partial_shard_left(job: Any, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture
                                                           ) -> None:
    from tenax.orchestrator.cli.main import main

    _, uri, _ = job
    copy = tmp_path / "ckpt"
    shutil.copytree(uri.removeprefix("file://"), copy)
    victim = sorted((copy / "step-00000001").glob("*.distcp"))[-1]
    victim.unlink()  # as keep_last would while the export reads the version
    out = tmp_path / "hf"
    assert main(["export", "hf", f"file://{copy}", "--out", str(out), "--quiet",
                 "--shard-size", "100KB"]) == 2
    err = capsys.readouterr().err
    assert f"cannot read file://{copy}/step-00000001" in err and victim.name in err
    assert not list(out.glob("*.safetensors"))


def test_tensors_the_model_does_not_use_are_named(tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A file with more than config.json describes (here a third layer) imports what the model
    needs, and says which tensors it left unused."""
    from safetensors.torch import load_file, save_file

    from tenax.workers.hf.load import check_hf_weights

    hf_jobs.random_hf_model(tmp_path / "src")
    tensors = load_file(str(tmp_path / "src" / "model.safetensors"))
    tensors["model.layers.2.mlp.gate_proj.weight"] = torch.zeros(96, 64)
    save_file(tensors, str(tmp_path / "src" / "model.safetensors"), metadata={"format": "pt"})
    spec = hf_jobs.hf_spec(_extra(tmp_path / "src"))
    with caplog.at_level("WARNING", logger="tenax.workers.hf.load"):
        found = check_hf_weights(str(tmp_path / "src"), spec.model.args())
    assert "layers.2.feed_forward.w1.weight" not in found and len(found) == 21
    assert "1 tensor(s) this model does not use" in caplog.text
    assert "model.layers.2.mlp.gate_proj.weight" in caplog.text
