"""The environment a local Ray is started with: loopback only, and prompt connection retries."""
from __future__ import annotations

import pytest

from tenax.orchestrator import loopback


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for key in loopback.CONNECT_KEYS:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_ray_processes_retry_local_connections_every_50_ms_within_rays_10_s_budget(
        clean_env: pytest.MonkeyPatch) -> None:
    import os

    loopback.loopback_env()
    retry_ms = int(os.environ["RAY_raylet_client_connect_timeout_milliseconds"])
    attempts = int(os.environ["RAY_raylet_client_num_connect_attempts"])
    assert retry_ms == 50
    assert retry_ms * attempts == 10 * 1000  # Ray's default: 10 attempts, 1 s apart


@pytest.mark.parametrize("key", loopback.CONNECT_KEYS)
def test_a_user_who_set_either_connect_setting_keeps_both_of_theirs(
        clean_env: pytest.MonkeyPatch, key: str) -> None:
    import os

    clean_env.setenv(key, "7")
    loopback.loopback_env()
    assert os.environ[key] == "7"
    other = next(k for k in loopback.CONNECT_KEYS if k != key)
    assert other not in os.environ
