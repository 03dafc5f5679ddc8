"""The embedded Ray of `tenax serve`: its temp dir goes where RAY_TMPDIR says and goes away
with it, so restarts (and `tenax run`, which starts the same embedded Ray) leave nothing
behind in the temp dir.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.service_helpers import ServerProcess, kill_mentioning, pids_mentioning, wait_until

pytestmark = pytest.mark.timeout(300)


def ray_dirs(parent: str) -> list[Path]:
    return sorted(Path(parent).glob("tenax-ray-*"))


@pytest.mark.slow
def test_embedded_ray_temp_dir_follows_ray_tmpdir_and_is_removed_at_exit(tmp_path):
    # Short paths: Ray's socket paths must fit in 107 characters.
    ray_tmp = tempfile.mkdtemp(prefix="txr-", dir="/tmp")
    other_tmp = tempfile.mkdtemp(prefix="txo-", dir="/tmp")
    server = None
    try:
        server = ServerProcess(["--state-dir", str(tmp_path / "state"), "--gpus", "1",
                                "--cpus", "2", "--no-metrics"], tmp_path / "serve.log",
                               {"RAY_TMPDIR": ray_tmp, "TMPDIR": other_tmp})
        assert len(ray_dirs(ray_tmp)) == 1, (os.listdir(ray_tmp), server.tail())
        assert ray_dirs(other_tmp) == [], os.listdir(other_tmp)
        assert server.terminate(timeout_s=120) == 0, server.tail()
        assert ray_dirs(ray_tmp) == [], (os.listdir(ray_tmp), server.tail())
        wait_until(lambda: not pids_mentioning(ray_tmp), 60, "the embedded Ray to exit")
    finally:
        if server is not None:
            server.kill()
        kill_mentioning(ray_tmp)  # only what this test started
        shutil.rmtree(ray_tmp, ignore_errors=True)
        shutil.rmtree(other_tmp, ignore_errors=True)
