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


def test_a_started_node_is_looked_up_once_its_raylet_is_listed_and_an_unknown_one_is_not() -> None:
    from tenax.testing import local_ray

    with local_ray(gpus=0, cpus=1):
        import ray
        import ray._private.services as services

        assert getattr(services.get_node, loopback.PROMPT_MARK, False)  # installed by the start
        node = ray.get_runtime_context().get_node_id()
        gcs = ray.get_runtime_context().gcs_address
        assert loopback.await_registration(gcs, node, wait_s=5.0)
        assert not loopback.await_registration(gcs, "ab" * 28, wait_s=0.2)
        assert services.get_node(gcs, node)["node_id"] == node  # Ray's answer, passed through


def test_the_lookup_is_wrapped_once_and_asks_ray_only_after_the_registration_wait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import ray._private.services as services

    order: list[str] = []
    monkeypatch.setattr(loopback, "await_registration",
                        lambda gcs, node, wait_s=0.0: order.append("wait") or True)
    monkeypatch.setattr(services, "get_node", lambda gcs, node: order.append("ray") or {"n": node})
    loopback.prompt_node_start()
    wrapped = services.get_node
    loopback.prompt_node_start()
    assert services.get_node is wrapped  # not wrapped twice
    assert wrapped("127.0.0.1:1", "ff") == {"n": "ff"}
    assert order == ["wait", "ray"]


def test_an_unreachable_gcs_leaves_the_decision_to_rays_own_lookup() -> None:
    assert not loopback.await_registration("127.0.0.1:1", "ab" * 28, wait_s=0.3)
