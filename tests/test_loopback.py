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
        # The API server started beside the raylet, and was handed to the node once up: Ray
        # stops it with the node.
        from ray._private.node import Node

        assert getattr(Node.start_api_server, loopback.PROMPT_MARK, False)
        head = ray._private.worker._global_node
        assert "dashboard" in head.all_processes and not loopback.API_SERVERS
        # and it outlives the start: Linux's death signal follows the thread that started it
        assert head.all_processes["dashboard"][0].process.poll() is None


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


class FakeNode:
    """What Ray's `Node.start_api_server` reads and writes of its node."""

    def __init__(self, isolated: bool = False) -> None:
        self.node_id = "ab" * 28
        self.all_processes: dict[str, list] = {"gcs_server": ["gcs"]}
        self._webui_url = None
        self.resource_isolation_config = type("Isolation", (), {
            "is_enabled": lambda _self: isolated})()


def fake_start(node: object, *, include_dashboard: bool | None, raise_on_failure: bool,
               fail: bool = False, release: object = None) -> None:
    if release is not None:
        release.wait(10)
    node._webui_url = "127.0.0.1:8265"
    assert node._webui_url == "127.0.0.1:8265"  # Ray reads back what it assigned
    if fail:
        raise ValueError("port 8265 is taken")
    node.all_processes["dashboard"] = ["api"]


def test_the_api_server_starts_beside_the_raylet_and_is_handed_to_the_node_at_the_lookup(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    release = threading.Event()
    monkeypatch.setattr(loopback, "await_registration", lambda gcs, node, wait_s=0.0: True)
    lookup = loopback.registered_lookup(lambda gcs, node: {"n": node})
    start = loopback.beside_raylet(
        lambda node, **kw: fake_start(node, release=release, **kw))
    node = FakeNode()
    assert start(node, include_dashboard=False, raise_on_failure=False) is None  # at once
    assert node.all_processes == {"gcs_server": ["gcs"]}  # untouched while the raylet starts
    assert node._webui_url is None
    release.set()
    assert lookup("127.0.0.1:1", node.node_id) == {"n": node.node_id}
    assert node.all_processes == {"gcs_server": ["gcs"], "dashboard": ["api"]}
    assert node._webui_url == "127.0.0.1:8265"
    assert node.node_id not in loopback.API_SERVERS


def test_a_failed_api_server_start_fails_the_node_lookup_as_it_would_have_failed_the_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loopback, "await_registration", lambda gcs, node, wait_s=0.0: True)
    lookup = loopback.registered_lookup(lambda gcs, node: {"n": node})
    start = loopback.beside_raylet(lambda node, **kw: fake_start(node, fail=True, **kw))
    node = FakeNode()
    start(node, include_dashboard=None, raise_on_failure=False)
    with pytest.raises(ValueError, match="port 8265 is taken"):
        lookup("127.0.0.1:1", node.node_id)


@pytest.mark.parametrize("dashboard,isolated", [(True, False), (None, True)])
def test_a_requested_dashboard_or_resource_isolation_keeps_rays_order(
        dashboard: bool | None, isolated: bool) -> None:
    start = loopback.beside_raylet(lambda node, **kw: fake_start(node, **kw))
    node = FakeNode(isolated=isolated)
    start(node, include_dashboard=dashboard, raise_on_failure=bool(dashboard))
    assert node.all_processes["dashboard"] == ["api"]  # started before returning
    assert node.node_id not in loopback.API_SERVERS
