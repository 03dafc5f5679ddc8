"""bench/device_snapshot_bench.py (run by gpu_check.sh on a lent GPU) keeps working: on CPU it
times steps with and without per-step snapshots, reads two snapshots back against the state
they were taken from, and restores the same step from memory and from disk."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow  # a subprocess that imports torch and trains on gloo: 10-20 s on 2 cores
def test_the_smoke_run_times_both_modes_checks_each_snapshot_and_restores(tmp_path):
    out = tmp_path / "snap.json"
    done = subprocess.run([sys.executable, "-m", "bench.device_snapshot_bench", "--quick",
                           "--device", "cpu", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert set(result["median_step_s"]) == {"off", "every_step"}
    assert all(v > 0 for v in result["median_step_s"].values())
    # On the host path a snapshot is waited for, never skipped: every one asked is taken
    assert result["snapshots_taken"] == result["snapshots_asked"] == 2
    assert result["staged_on_device"] is False
    exact = result["exactness"]
    assert exact["exact"] and exact["state_changed_after_each"]
    assert len(exact["snapshots"]) == 2
    assert set(result["restore"]["median_s"]) == {"memory", "disk_warm", "disk_cold"}
    assert not os.path.exists(result["snapshot_dir"])  # the bench leaves no tmpfs behind
