"""bench/device_snapshot_bench.py (run by gpu_check.sh on a lent GPU) keeps working: on CPU
it times the three modes and checks its last asynchronous copy against the state."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow  # a subprocess that imports torch and trains on gloo: 10-20 s on 2 cores
def test_the_smoke_run_times_every_mode_and_copies_the_whole_state(tmp_path):
    out = tmp_path / "snap.json"
    done = subprocess.run([sys.executable, "-m", "bench.device_snapshot_bench",
                           "--device", "cpu", "--steps", "1", "--reps", "1", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert set(result["median_step_s"]) == {"none", "blocking", "async"}
    assert all(v > 0 for v in result["median_step_s"].values())
    assert result["async_copy_exact"] is True


def test_state_tensors_are_every_parameter_and_its_adamw_moments():
    import torch

    from bench.device_snapshot_bench import state_tensors

    params = [torch.nn.Parameter(torch.ones(3, 2)), torch.nn.Parameter(torch.ones(5))]
    optimizer = torch.optim.AdamW(params, lr=0.1)
    assert [t.shape for t in state_tensors(optimizer)] == [(3, 2), (5,)]  # no moments yet
    sum(p.sum() for p in params).backward()
    optimizer.step()
    shapes = sorted(tuple(t.shape) for t in state_tensors(optimizer))
    assert shapes == sorted([(3, 2)] * 3 + [(5,)] * 3 + [()] * 2)  # param, 2 moments, step
