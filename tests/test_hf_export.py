"""`tenax export hf`: checkpoints saved in dp2, tp2, pp2 and ZeRO-3 load into transformers'
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

LAYOUTS = {"dp2": {"dp": 2}, "tp2": {"tp": 2}, "pp2": {"pp": 2}, "zero3": {"dp": 2, "zero": 3}}


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
    (tmp_path / "a_file").write_text("not a directory")
    assert main(["export", "hf", uri, "--out", str(tmp_path / "a_file"), "--quiet"]) == 2
    assert f"--out: '{tmp_path / 'a_file'}': exists and is not a directory" in \
        capsys.readouterr().err
    assert main(["export", "hf", uri, "--out", "/proc/tenax-export", "--quiet"]) == 2
    assert "--out: '/proc/tenax-export': " in capsys.readouterr().err


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
def test_spec_that_is_not_the_checkpoints_refused(checkpoints: dict[str, Any], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    """A --spec whose model section differs from the checkpoint's saved one is refused naming
    the first differing key and both values, before anything is written."""
    import yaml

    from tenax.orchestrator.cli.main import main
    from tenax.workers.hf.export import ExportError, export_hf

    uri, _ = checkpoints["dp2"]
    with pytest.raises(ExportError, match=r"--spec: model.rope_theta is 500000.0, the "
                                          r"checkpoint's is 10000.0"):
        export_hf(uri, str(tmp_path / "theta"), spec=_job(["model.rope_theta=500000"]))
    with pytest.raises(ExportError, match=r"--spec: model.moe is \{.*\}, the checkpoint's is "
                                          r"None"):
        export_hf(uri, str(tmp_path / "moe"), spec=_job(hf_jobs.MOE_TINY))
    (tmp_path / "wide.yaml").write_text(yaml.safe_dump(_job(["model.dim=128"])))
    assert main(["export", "hf", uri, "--out", str(tmp_path / "wide"), "--spec",
                 str(tmp_path / "wide.yaml"), "--quiet"]) == 2
    assert "--spec: model.dim is 128, the checkpoint's is 64" in capsys.readouterr().err
    assert not any((tmp_path / name).exists() for name in ("theta", "moe", "wide"))


@pytest.mark.slow
def test_tokenizer_files_and_eos(checkpoints: dict[str, Any], tmp_path: Path) -> None:
    """The job's tokenizer.json is copied with a tokenizer_config.json naming the EOS it was
    trained with (merged into the source's config, whose BOS it keeps), so AutoTokenizer loads
    the directory with its EOS; config.json carries the ids."""
    from transformers import AutoTokenizer

    from tenax.workers.hf.export import export_hf

    uri, _ = checkpoints["dp2"]
    tokenizer = _word_tokenizer(tmp_path / "tok.json")
    with_tok = _job([f"data.tokenizer={tokenizer}"])
    export_hf(uri, str(tmp_path / "hf"), spec=with_tok)
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["eos_token_id"], config.get("bos_token_id")) == (1, None)
    loaded = AutoTokenizer.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    assert (loaded.eos_token, loaded.eos_token_id, loaded.model_max_length) == ("</s>", 1, 16)
    assert loaded("w3 w4")["input_ids"] == [5, 6]
    source = tmp_path / "src"  # a tokenizer directory whose config names a BOS
    source.mkdir()
    tokenizer = _word_tokenizer(source / "tokenizer.json")
    (source / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "w0", "eos_token": "</s>", "clean_up_tokenization_spaces": False}))
    export_hf(uri, str(tmp_path / "hf2"), spec=_job([f"data.tokenizer={tokenizer}",
                                                     "data.eos_id=3"]))
    config = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert (config["eos_token_id"], config["bos_token_id"]) == (3, 2)
    loaded = AutoTokenizer.from_pretrained(str(tmp_path / "hf2"), local_files_only=True)
    assert (loaded.eos_token, loaded.eos_token_id, loaded.bos_token_id) == ("w1", 3, 2)


# ---- checks that need no checkpoint ------------------------------------------------------------
def _job(extra: list[str] | None = None) -> dict[str, Any]:
    return hf_jobs.hf_spec(extra).model_dump(mode="json", by_alias=True)


def test_spec_checked_against_the_saved_spec_or_model_hash() -> None:
    """With a saved spec, the first differing model key is named (nested keys dotted); other
    sections of --spec are used. Without one (older checkpoints), the model section must hash
    to the manifest's model_hash, the hash a job writes (checkpoint_config)."""
    from types import SimpleNamespace

    from tenax.workers.checkpoint_config import checkpoint_config
    from tenax.workers.hf.source import ExportError, job_spec_of, model_hash, model_section

    saved = _job([hf_jobs.LLAMA31_SCALING])
    written = checkpoint_config(hf_jobs.hf_spec([hf_jobs.LLAMA31_SCALING])).model_hash
    assert model_hash(model_section(saved)) == written
    manifest = SimpleNamespace(step=3, extra={"spec": saved}, model_hash=written)
    assert job_spec_of(manifest, None, "file:///ck") == saved
    scaled = [hf_jobs.LLAMA31_SCALING.replace("factor: 8.0", "factor: 4.0")]
    with pytest.raises(ExportError, match=r"--spec: model.rope_scaling.factor is 4.0, the "
                                          r"checkpoint's is 8.0 \(file:///ck step 3\)"):
        job_spec_of(manifest, _job(scaled), "file:///ck")
    with pytest.raises(ExportError, match=r"--spec: model.rope_scaling is None, the "
                                          r"checkpoint's is \{"):
        job_spec_of(manifest, _job(), "file:///ck")
    same = _job([hf_jobs.LLAMA31_SCALING, "train.steps=7"])
    assert job_spec_of(manifest, same, "file:///ck")["train"]["steps"] == 7
    old = SimpleNamespace(step=3, extra={}, model_hash=written)
    assert job_spec_of(old, same, "file:///ck") == same
    with pytest.raises(ExportError, match=r"--spec: its model section hashes to [0-9a-f]{16}"
                                          r"\.\.\., the checkpoint file:///ck step 3 was saved "
                                          r"by a model hashing to " + written[:16]):
        job_spec_of(old, _job(), "file:///ck")
    with pytest.raises(ExportError, match="carries no job spec"):
        job_spec_of(old, None, "file:///ck")


def test_stored_tensors_checked_by_name_and_shape() -> None:
    from torch.distributed.checkpoint.metadata import (Metadata, TensorProperties,
                                                       TensorStorageMetadata)

    from tenax.workers.hf.source import ExportError, check_stored, expected_shapes, model_section

    def stored(shapes: dict[str, tuple[int, ...]]) -> Metadata:
        return Metadata({f"model.{n}": TensorStorageMetadata(
            TensorProperties(dtype=torch.float32), torch.Size(s), []) for n, s in shapes.items()})

    shapes = expected_shapes(model_section(_job()))
    assert (shapes["tok_embeddings.weight"], shapes["layers.1.feed_forward.w1.weight"]) == \
        ((128, 64), (96, 64))
    check_stored(shapes, stored(shapes), "ck")
    wide = expected_shapes(model_section(_job(["model.ffn_hidden=128"])))
    with pytest.raises(ExportError, match=r"ck: the checkpoint's layers.0.feed_forward.w1.weight "
                                          r"is \[96, 64\], the job's model section needs "
                                          r"\[128, 64\] \(6 tensor\(s\) differ\)"):
        check_stored(wide, stored(shapes), "ck")
    moe = expected_shapes(model_section(_job(hf_jobs.MOE_TINY)))
    with pytest.raises(ExportError, match=r"the checkpoint lacks \['layers.0.feed_forward."
                                          r"experts.w1.weight'"):
        check_stored(moe, stored(shapes), "ck")


def test_out_that_cannot_be_a_directory_named(tmp_path: Path) -> None:
    from tenax.workers.hf.export import ExportError, open_out

    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ExportError, match=r"--out: '.*a_file': exists and is not a directory"):
        open_out(str(tmp_path / "a_file"))
    with pytest.raises(ExportError, match=r"--out: '.*a_file/sub': .*Not a directory"):
        open_out(str(tmp_path / "a_file" / "sub"))
    with pytest.raises(ExportError, match=r"--out: '/proc/tenax-export': "):
        open_out("/proc/tenax-export")
    with pytest.raises(ExportError, match=r"--out: 'nosuch://x': Protocol not known"):
        open_out("nosuch://x")
    open_out(str(tmp_path / "new" / "dir"))
    assert (tmp_path / "new" / "dir").is_dir()


def _word_tokenizer(path: Path) -> Path:
    """A tiny word-level HF tokenizer.json built locally (id 1 is the EOS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(20)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def test_export_refuses_the_directory_the_job_started_from(tmp_path: Path) -> None:
    from tenax.workers.hf.export import ExportError
    from tenax.workers.hf.out_dir import check_not_source

    source = tmp_path / "hf"
    source.mkdir()
    (tmp_path / "link").symlink_to(source)
    for out in (str(source), f"file://{source}/", str(tmp_path / "link"),
                str(tmp_path / "x" / ".." / "hf")):
        with pytest.raises(ExportError, match="model.init_from"):
            check_not_source(out, str(source))
    check_not_source(str(tmp_path / "out"), str(source))
    check_not_source(str(source), None)
    check_not_source("memory://hf", str(source))
