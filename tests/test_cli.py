"""`tenax plan ...` and `tenax data prepare` as a user runs them, through the installed script."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tenax.orchestrator.cli.main import main


def run_json(capsys, *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_memory_7b_on_8(capsys):
    doc = run_json(capsys, "plan", "memory", "--params-b", "7", "--world", "8")
    got = {name: round(s["total_gib"], 1) for name, s in doc["stages"].items()}
    # 16 B/param: DDP 16P, ZeRO-1 4P+12P/8, ZeRO-2 2P+14P/8, ZeRO-3 16P/8 (P = 7e9, GiB = 2^30)
    assert got == {"DDP": 104.3, "ZeRO-1": 35.9, "ZeRO-2": 24.4, "ZeRO-3": 13.0}


def test_plan_comm_tp(capsys):
    doc = run_json(capsys, "plan", "comm", "--batch", "4", "--seq", "2048", "--hidden", "4096",
                   "--tp", "8", "--layers", "100")
    assert round(doc["per_rank_per_step"]["gib"], 2) == 43.75
    doc = run_json(capsys, "plan", "comm", "--batch", "1", "--seq", "1024", "--hidden", "1024",
                   "--tp", "2", "--layers", "1", "--dtype-bytes", "4")
    # 4 all-reduces x 2*(2-1)/2 x (1*1024*1024*4 B) = 16 MiB
    assert doc["per_rank_per_step"]["bytes"] == pytest.approx(16 * 2**20)


def test_plan_bubble(capsys):
    doc = run_json(capsys, "plan", "bubble", "--pp", "4", "--microbatches", "16")
    fractions = {k: round(100 * v["fraction"], 1) for k, v in doc["schedules"].items()}
    assert fractions["1f1b"] == 15.8  # 9 / (16*3 + 9)
    assert fractions["zero_bubble"] == 11.1  # 3*(3-1) / (48 + 6)
    doc = run_json(capsys, "plan", "bubble", "--pp", "4", "--microbatches", "16", "--virtual", "2")
    assert doc["schedules"]["interleaved_1f1b"]["bubble"] == pytest.approx(4.5)


def test_plan_layout_preset_and_spec(capsys, tmp_path):
    doc = run_json(capsys, "plan", "layout", "--model-preset", "llama3-70b", "--gpus", "64",
                   "--gpus-per-node", "8")
    lay = doc["layout"]
    assert lay["dp"] * lay["tp"] * lay["pp"] * lay["cp"] == 64 and 8 % lay["tp"] == 0
    assert doc["estimate"]["memory"]["total_gib"] <= doc["memory_budget_gib"]
    assert doc["runners_up"] and all(r["reason"] for r in doc["runners_up"])
    spec = tmp_path / "job.yaml"
    spec.write_text("parallel: {dp: auto, tp: 2}\ntrain: {global_batch_size: 32}\n")
    doc = run_json(capsys, "plan", "layout", "--spec", str(spec), "--gpus", "8",
                   "--gpus-per-node", "4")
    assert doc["layout"]["tp"] == 2 and doc["layout"]["dp"] == 4


def test_plan_layout_assumes_the_share_of_peak_it_is_given(capsys, tmp_path):
    """`--mfu`: the compute part of the step time is the model's FLOPs at that share of peak."""
    from tenax.parallel import DEFAULT_MFU

    spec = tmp_path / "job.yaml"
    spec.write_text("parallel: {dp: 4, tp: 2, recompute: none}\ntrain: {global_batch_size: 32}\n")
    argv = ["plan", "layout", "--spec", str(spec), "--gpus", "8", "--gpus-per-node", "8",
            "--gpu", "h100"]
    assumed, given = run_json(capsys, *argv), run_json(capsys, *argv, "--mfu", "0.6")
    assert assumed["hardware"]["mfu_assumed"] == DEFAULT_MFU
    assert given["hardware"]["mfu_assumed"] == 0.6 and given["layout"] == assumed["layout"]
    compute = [d["estimate"]["step_time"]["compute_s"] for d in (assumed, given)]
    assert compute[0] * DEFAULT_MFU == pytest.approx(compute[1] * 0.6, rel=1e-12)
    assert given["chosen"]["tokens_per_s"] > assumed["chosen"]["tokens_per_s"]
    for bad, why in (("1.5", "1.5 is not in (0, 1]"), ("0", "0.0 is not in (0, 1]"),
                     ("lots", "'lots' is not a number")):
        with pytest.raises(SystemExit) as exited:
            main([*argv, "--mfu", bad])
        assert exited.value.code == 2 and f"argument --mfu: {why}" in capsys.readouterr().err

def test_user_errors_exit_2_with_field(capsys, tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text("parallel: {tp: 3}\n")
    assert main(["plan", "layout", "--spec", str(spec), "--gpus", "6", "--gpus-per-node", "2"]) == 2
    assert "parallel.tp: 3 does not divide model.n_heads=8" in capsys.readouterr().err
    assert main(["plan", "layout", "--model-preset", "gpt9", "--gpus", "8",
                 "--gpus-per-node", "8"]) == 2
    assert "unknown preset 'gpt9'" in capsys.readouterr().err


def test_data_prepare_writes_tokens(capsys, tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("hello tenax")
    out = tmp_path / "tokens"  # an indexed dataset prefix: tokens.bin + tokens.idx
    doc = run_json(capsys, "data", "prepare", str(text), "--out", f"file://{out}",
                   "--workers", "1")
    assert doc["documents"] == 1 and doc["tokens"] == len("hello tenax") + 1  # + end-of-document
    assert (tmp_path / "tokens.bin").stat().st_size == doc["tokens"] * 2
    assert (tmp_path / "tokens.idx").is_file()


def test_console_script_runs():
    proc = subprocess.run([sys.executable, "-m", "tenax.orchestrator.cli.main", "plan", "bubble",
                           "--pp", "2", "--microbatches", "8", "--json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["schedules"]["1f1b"]["fraction"] == pytest.approx(3 / 27)


def test_version_names_tenax_torch_ray_and_python():
    """What a bug report starts with; the installed distribution and the package agree on it."""
    import platform
    from importlib.metadata import version

    import tenax

    proc = subprocess.run([sys.executable, "-m", "tenax.orchestrator.cli.main", "--version"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (f"tenax {tenax.__version__} (torch {version('torch')}, "
                           f"ray {version('ray')}, python {platform.python_version()})\n")
    assert version("tenax") == tenax.__version__
