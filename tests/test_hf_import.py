"""`model.init_from`: a job starts from an HF LlamaForCausalLM's weights in any layout.

The reference is transformers' loss on the same batch (the trainer's first-step loss is the
loss of the starting weights); models are tiny LlamaConfigs saved with save_pretrained here.
The error cases fail before any weight is written: the config at spec load, the tensors before
the job is placed (`tenax run`, a service submission) and again at trainer build.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import hf_jobs
from tests.distributed import run_ranks

pytest.importorskip("transformers")

LAYOUTS = {"dp1": {"dp": 1}, "tp2": {"tp": 2}, "pp2": {"pp": 2},
           "zero3": {"dp": 2, "zero": 3}}


def _world(layout: dict[str, int]) -> int:
    return layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1)


def _hf_loss(model: Any, spec: Any) -> float:
    from tenax.workers.data import TokenDataLoader

    inputs, targets = TokenDataLoader.from_job_spec(spec).next_batch(0, 1)
    logits = hf_jobs.hf_logits(model, inputs)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             targets.reshape(-1)).item()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("hf") / "model"
    return path, hf_jobs.random_hf_model(path, rope_theta=500000.0)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_first_step_loss_is_hf_loss(hf_dir: tuple[Path, Any], name: str) -> None:
    path, model = hf_dir
    extra = [f"model.init_from={path}", "model.from_hf=true", "model.seq_len=16"]
    spec = hf_jobs.hf_spec(extra)
    assert (spec.model.rope_theta, spec.model.dim, spec.model.ffn_hidden) == (500000.0, 64, 96)
    out = run_ranks(hf_jobs.first_step_job, _world(LAYOUTS[name]), LAYOUTS[name], extra)
    assert out[0]["loss"] == pytest.approx(_hf_loss(model, spec), rel=1e-5, abs=1e-6)
    hf_params = dict(model.named_parameters())
    from tenax.workers.hf.names import hf_name

    for key, value in out[0]["params"].items():  # every rank's share landed where it belongs
        torch.testing.assert_close(value, hf_params[hf_name(key)].detach(), rtol=0, atol=0)


@pytest.mark.slow
def test_tied_model_imports(tmp_path: Path) -> None:
    model = hf_jobs.random_hf_model(tmp_path / "hf", tie_word_embeddings=True)
    extra = [f"model.init_from={tmp_path / 'hf'}", "model.from_hf=true", "model.seq_len=16"]
    spec = hf_jobs.hf_spec(extra)
    assert spec.model.tie_embeddings
    out = run_ranks(hf_jobs.first_step_job, 2, {"dp": 2, "zero": 1}, extra)
    assert out[0]["loss"] == pytest.approx(_hf_loss(model, spec), rel=1e-5, abs=1e-6)


@pytest.mark.slow
def test_resumed_job_ignores_init_from(tmp_path: Path) -> None:
    path = tmp_path / "hf"
    model = hf_jobs.random_hf_model(path)  # the checkpoint's shape (rope_theta 10000)
    uri = f"file://{tmp_path}/ckpt"
    saved = run_ranks(hf_jobs.save_job, 1, uri, {"dp": 1}, [])[0]  # seeded init, 1 step
    extra = [f"model.init_from={path}", "model.from_hf=true", "model.seq_len=16"]
    out = run_ranks(resume_job, 1, uri, extra)[0]
    assert out["resumed"] == 1
    for key, value in saved.items():
        torch.testing.assert_close(out["params"][key], value, rtol=0, atol=0)
    from tenax.workers.hf.load import HFLoadError, check_init_from

    cut = _truncated(path, tmp_path / "cut")  # a resumed job never reads it: not checked
    bad = [f"model.init_from={cut}", "model.from_hf=true", "model.seq_len=16"]
    assert check_init_from(hf_jobs.hf_spec(bad + [f"checkpoint.uri={uri}"])) is False
    with pytest.raises(HFLoadError, match="truncated"):
        check_init_from(hf_jobs.hf_spec(bad + [f"checkpoint.uri=file://{tmp_path}/empty"]))
    fresh = run_ranks(resume_job, 1, f"file://{tmp_path}/empty", extra)[0]
    assert fresh["resumed"] is None  # nothing to resume: the HF weights
    hf_params = dict(model.named_parameters())
    from tenax.workers.hf.names import hf_name

    for key, value in fresh["params"].items():
        torch.testing.assert_close(value, hf_params[hf_name(key)].detach(), rtol=0, atol=0)


def test_resume_after_init_from_is_deleted(tmp_path: Path) -> None:
    """Weeks into a run the HF directory may be gone: the job resumes from its checkpoint, the
    model keys from_hf took coming from the checkpoint's saved spec. A fresh job still names
    the missing config.json."""
    import shutil

    from tenax.workers.spec import load_spec

    path = tmp_path / "hf"
    hf_jobs.random_hf_model(path)
    uri = f"file://{tmp_path}/ckpt"
    saved = run_ranks(hf_jobs.save_job, 1, uri, {"dp": 1}, [f"model.init_from={path}"])[0]
    shutil.rmtree(path)
    # the shape only from_hf knew: every model key left to the (now gone) config.json
    minimal = [x for x in hf_jobs.HF_TINY if not x.startswith("model.")] + \
        [f"model.init_from={path}", "model.from_hf=true"]
    spec = load_spec(overrides=minimal + [f"checkpoint.uri={uri}"])
    assert spec.model.init_from is None
    assert (spec.model.dim, spec.model.n_layers, spec.model.vocab_size) == (64, 2, 128)
    out = run_ranks(resume_job, 1, uri, minimal, False)[0]
    assert out["resumed"] == 1
    for key, value in saved.items():
        torch.testing.assert_close(out["params"][key], value, rtol=0, atol=0)
    with pytest.raises(ValueError, match="config.json"):
        load_spec(overrides=minimal + [f"checkpoint.uri=file://{tmp_path}/empty"])


def resume_job(rank: int, world: int, uri: str, extra: list[str],
               tiny: bool = True) -> dict[str, Any]:
    """What the rank loop does on a restart: build without init, resume or initialise.
    `tiny`: the spec is HF_TINY + `extra`, else `extra` alone."""
    from tenax.checkpoint.manager import CheckpointManager
    from tenax.parallel.layout import ParallelLayout
    from tenax.workers.checkpoint_config import checkpoint_config
    from tenax.workers.memory_options import begin_rank
    from tenax.workers.trainer import Trainer

    from tenax.workers.spec import load_spec

    overrides = extra + [f"checkpoint.uri={uri}"]
    spec = hf_jobs.hf_spec(overrides) if tiny else load_spec(overrides=overrides)
    trainer = Trainer(spec, ParallelLayout(micro_batch_size=1), initialise=False)
    with CheckpointManager(checkpoint_config(spec), trainer, rank, world, timeout_s=60) as mgr:
        resumed, _ = begin_rank(mgr, trainer, None, True, rank, world)
    return {"resumed": resumed, "params": trainer.full_params()}


# ---- errors: each clear, and before any training ---------------------------------------------
def test_mismatched_config_names_each_key(hf_dir: tuple[Path, Any]) -> None:
    from tenax.workers.errors import SpecError

    path, _ = hf_dir
    with pytest.raises(SpecError) as info:
        hf_jobs.hf_spec([f"model.init_from={path}", "model.dim=128", "model.n_heads=8",
                         "model.n_kv_heads=4"])
    text = str(info.value)
    assert "model.dim: the spec has 128, config.json has 64" in text
    assert "model.n_heads: the spec has 8, config.json has 4" in text
    assert "model.rope_theta: the spec has 10000.0, config.json has 500000.0" in text


def test_from_hf_needs_init_from_and_a_config(tmp_path: Path) -> None:
    from tenax.workers.errors import SpecError

    with pytest.raises(SpecError, match="model.from_hf: true needs model.init_from"):
        hf_jobs.hf_spec(["model.from_hf=true"])
    with pytest.raises(SpecError, match="cannot read .*config.json"):
        hf_jobs.hf_spec([f"model.init_from={tmp_path}/absent", "model.from_hf=true"])


def _copy_without(src: Path, dst: Path, drop: str | None = None,
                  reshape: str | None = None) -> Path:
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    (dst / "config.json").write_bytes((src / "config.json").read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    tensors.pop(drop, None)
    if reshape is not None:
        tensors[reshape] = tensors[reshape][:-1].contiguous()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _args(path: Path) -> Any:
    return hf_jobs.hf_spec([f"model.init_from={path}", "model.from_hf=true"]).model.args()


def test_missing_tensor_shape_mismatch_and_truncation(hf_dir: tuple[Path, Any],
                                                      tmp_path: Path) -> None:
    from tenax.workers.hf.load import HFLoadError, check_hf_weights

    path, _ = hf_dir
    missing = _copy_without(path, tmp_path / "missing",
                            drop="model.layers.1.self_attn.k_proj.weight")
    with pytest.raises(HFLoadError, match=r"'model.layers.1.self_attn.k_proj.weight' \(Tenax "
                                          r"'layers.1.attention.wk.weight'\) is missing"):
        check_hf_weights(str(missing), _args(path))
    shaped = _copy_without(path, tmp_path / "shape", reshape="model.layers.0.mlp.up_proj.weight")
    with pytest.raises(HFLoadError, match=r"'model.layers.0.mlp.up_proj.weight' has shape "
                                          r"\[95, 64\], the model needs \[96, 64\]"):
        check_hf_weights(str(shaped), _args(path))
    cut = _copy_without(path, tmp_path / "cut")
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(HFLoadError, match="truncated: tensor .* ends at byte"):
        check_hf_weights(str(cut), _args(path))
    (cut / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(HFLoadError, match="truncated or not safetensors"):
        check_hf_weights(str(cut), _args(path))
    assert check_hf_weights(str(path), _args(path))  # the intact directory passes


@pytest.mark.slow
def test_bad_weights_stop_the_trainer_build(hf_dir: tuple[Path, Any], tmp_path: Path) -> None:
    path, _ = hf_dir
    missing = _copy_without(path, tmp_path / "missing", drop="model.norm.weight")
    extra = [f"model.init_from={missing}", "model.from_hf=true", "model.seq_len=16"]
    with pytest.raises(RuntimeError, match="'model.norm.weight' .* is missing"):
        run_ranks(hf_jobs.first_step_job, 2, {"tp": 2}, extra)


def _truncated(src: Path, dst: Path) -> Path:
    cut = _copy_without(src, dst)
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[:-100])
    return cut


def _run_sets(init_from: Path, tmp_path: Path) -> list[str]:
    return hf_jobs.HF_TINY + [f"model.init_from={init_from}", "model.from_hf=true",
                              f"checkpoint.uri=file://{tmp_path}/ckpt"]


def test_bad_weights_refuse_tenax_run_before_ray(hf_dir: tuple[Path, Any], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture) -> None:
    """`tenax run` reads init_from's headers before anything starts: bad weights exit 2
    naming the file (or the tensor), and Ray is never started; good ones go on to start it."""
    import tenax.orchestrator.loopback as loopback
    from tenax.orchestrator.cli import runner
    from tenax.orchestrator.cli.main import main

    def no_ray(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("Ray was started")

    monkeypatch.setattr(runner, "ray_session", no_ray)
    monkeypatch.setattr(loopback, "loopback_env", lambda: None)  # leave os.environ alone
    path, _ = hf_dir

    def run(init_from: Path) -> int:
        return main(["run"] + [a for s in _run_sets(init_from, tmp_path) for a in ("--set", s)])

    cut = _truncated(path, tmp_path / "cut")
    assert run(cut) == 2
    assert f"{cut}/model.safetensors: truncated: tensor" in capsys.readouterr().err
    missing = _copy_without(path, tmp_path / "missing", drop="model.norm.weight")
    assert run(missing) == 2
    assert "tensor 'model.norm.weight' (Tenax 'norm.weight') is missing" in \
        capsys.readouterr().err
    with pytest.raises(AssertionError, match="Ray was started"):
        run(path)


def test_bad_weights_refuse_a_service_submission(hf_dir: tuple[Path, Any],
                                                 tmp_path: Path) -> None:
    """A submission is refused (SpecError: INVALID_ARGUMENT) naming the file and tensor."""
    from tenax.orchestrator.service.submission import parse_submission
    from tenax.workers.errors import SpecError

    path, _ = hf_dir
    shaped = _copy_without(path, tmp_path / "shape", reshape="model.layers.0.mlp.up_proj.weight")
    with pytest.raises(SpecError, match=r"model.init_from: .*shape cannot initialise this model: "
                                        r"tensor 'model.layers.0.mlp.up_proj.weight' has shape"):
        parse_submission("{}", _run_sets(shaped, tmp_path))
    cut = _truncated(path, tmp_path / "cut")
    with pytest.raises(SpecError, match=f"{cut}/model.safetensors: truncated"):
        parse_submission("{}", _run_sets(cut, tmp_path))
    assert parse_submission("{}", _run_sets(path, tmp_path)).model.init_from == str(path)


def test_sharded_hf_directory_reads_through_its_index(tmp_path: Path) -> None:
    """save_pretrained with a small max_shard_size writes an index; init_from follows it."""
    from tenax.workers.hf.load import check_hf_weights

    model = hf_jobs.random_hf_model(tmp_path / "one")
    model.save_pretrained(str(tmp_path / "many"), max_shard_size="100KB")
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    found = check_hf_weights(str(tmp_path / "many"), _args(tmp_path / "many"))
    assert len({e.file for e in found.values()}) > 1


def test_tied_head_refused_where_it_cannot_work() -> None:
    from tenax.workers.errors import SpecError

    with pytest.raises(SpecError, match="tie_embeddings: true needs parallel.pp=1"):
        hf_jobs.hf_spec(["model.tie_embeddings=true", "parallel.pp=2"])
    with pytest.raises(SpecError, match="not supported with parallel.zero=3"):
        hf_jobs.hf_spec(["model.tie_embeddings=true", "parallel.zero=3"])
    spec = hf_jobs.hf_spec(["model.tie_embeddings=true"])
    untied = hf_jobs.hf_spec([])
    # one vocab x dim matrix less
    assert untied.model.num_params() - spec.model.num_params() == 128 * 64


def test_new_keys_at_defaults_keep_the_model_hash() -> None:
    """Checkpoints saved before these keys existed still resume: same model hash."""
    from tenax.checkpoint import spec_hash
    from tenax.workers.checkpoint_config import checkpoint_config

    spec = hf_jobs.hf_spec([])
    before = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 128,
              "seq_len": 16, "ffn_hidden": 96, "moe": None}
    assert checkpoint_config(spec).model_hash == spec_hash(before)
    changed = checkpoint_config(hf_jobs.hf_spec(["model.rope_theta=500000"])).model_hash
    assert changed != spec_hash(before)
