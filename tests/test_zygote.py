"""A node's zygote: one forkserver whose children other processes start, kill and reap, with
their own environment and output; a child dies with the forkserver it came from, and a dead
forkserver is replaced when next asked."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from tenax.workers.zygote import ForkSource, Zygote
from tenax.workers.zygote_process import Endpoint, ZygoteProcess

pytestmark = pytest.mark.timeout(300)


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as stat:  # a zombie counts as gone
        return stat.read().split(") ")[-1].startswith("Z")


@pytest.fixture(scope="module")
def zygote():
    z = Zygote(timeout_s=120)
    yield z
    z.endpoint(120)
    os.kill(z.endpoint(120)["pid"], signal.SIGKILL)


def test_a_child_runs_with_its_starters_environment_output_priority_group_and_exit_status(
        zygote, tmp_path: Path, capfd) -> None:
    endpoint = Endpoint(**zygote.endpoint(120))
    assert endpoint.ready_at > 0 and endpoint.pid != os.getpid()
    out = tmp_path / "env.txt"
    command = (f"echo $TENAX_ZYGOTE_PROBE > {out}; echo to-stdout; "
               f"ps -o ni=,pgid= -p $$ > {tmp_path}/nice.txt")
    started: dict = {}

    def start() -> None:
        """On Linux niceness is per thread: this starter thread runs 3 below the zygote's, as
        Ray's workers run at 15 while a forkserver a driver started runs at 0."""
        os.nice(3)
        started["nice"] = os.nice(0)
        started["proc"] = proc = ZygoteProcess(endpoint, os.system, (command,))
        proc.start()

    os.environ["TENAX_ZYGOTE_PROBE"] = "from-the-starter"  # set after the zygote started
    try:
        starter = threading.Thread(target=start)
        starter.start()
        starter.join(60)
    finally:
        del os.environ["TENAX_ZYGOTE_PROBE"]
    proc = started["proc"]
    proc.join(60)
    assert out.read_text().strip() == "from-the-starter"
    nice, group = map(int, (tmp_path / "nice.txt").read_text().split())
    assert (nice, group) == (started["nice"], os.getpgrp())
    assert "to-stdout" in capfd.readouterr().out  # the starter's fd 1, not the zygote's
    exiting = ZygoteProcess(endpoint, os._exit, (3,))
    exiting.start()
    exiting.join(60)
    assert (proc.exitcode, exiting.exitcode) == (0, 3)  # as the forkserver reaped them


def test_the_starter_kills_and_reaps_a_child_of_the_zygote(zygote) -> None:
    endpoint = Endpoint(**zygote.endpoint(120))
    proc = ZygoteProcess(endpoint, time.sleep, (600,))
    proc.start()
    assert proc.is_alive() and proc.pid != endpoint.pid
    proc.kill()
    proc.join(30)
    assert proc.exitcode == -signal.SIGKILL


def test_children_die_with_their_forkserver_and_a_new_one_replaces_it(zygote) -> None:
    old = Endpoint(**zygote.endpoint(120))
    proc = ZygoteProcess(old, time.sleep, (600,))
    proc.start()
    child = proc.pid
    os.kill(old.pid, signal.SIGKILL)
    proc.join(30)
    # The forkserver that would have reported it is gone; PR_SET_PDEATHSIG killed it.
    assert proc.exitcode == -signal.SIGKILL and proc.forkserver_died
    wait_until(lambda: pid_gone(child), 30, "the orphaned child to die (PR_SET_PDEATHSIG)")
    new = Endpoint(**zygote.endpoint(120))
    assert new.pid != old.pid and new.address != old.address
    again = ZygoteProcess(new, os._exit, (0,))
    again.start()
    again.join(30)
    assert again.exitcode == 0


class DeadZygote:
    """Stands in for an actor handle whose calls fail (what a dead Ray actor's do)."""

    class Method:
        def remote(self, *args):
            raise ConnectionError("the zygote actor is dead")

    endpoint = Method()


def test_an_agent_whose_zygote_does_not_answer_forks_from_its_own_forkserver() -> None:
    source = ForkSource(DeadZygote(), timeout_s=120)
    proc = source.start(os._exit, (4,), "tenax-test")
    proc.join(60)
    assert proc.exitcode == 4 and not isinstance(proc, ZygoteProcess)
    assert source.ready_at(120) > 0


def test_an_agent_on_the_launchers_node_forks_from_its_forkserver_until_it_is_gone(
        monkeypatch) -> None:
    """No zygote on the launcher's node: its agents fork from the launcher's forkserver, ready
    once the first fork returned; once it is gone, from a forkserver of their own."""
    from dataclasses import asdict

    from tenax.workers import zygote as zygote_module
    from tenax.workers.zygote import NodeForkServer

    monkeypatch.setattr(zygote_module, "_on_node", lambda node_id: node_id == "here")
    server = NodeForkServer([])
    try:
        source = ForkSource(None, timeout_s=120,
                            adopt={"node_id": "here", "endpoint": asdict(server.endpoint)})
        before = time.time()
        proc = source.start(os._exit, (3,), "tenax-test")
        proc.join(60)
        assert isinstance(proc, ZygoteProcess) and proc.exitcode == 3
        assert before <= source.ready_at(1) <= time.time()
        os.kill(server.endpoint.pid, signal.SIGKILL)
        wait_until(lambda: pid_gone(server.endpoint.pid), 30, "the launcher's forkserver to die")
        proc = source.start(os._exit, (4,), "tenax-test")
        proc.join(60)
    finally:
        server.close()
    assert proc.exitcode == 4 and not isinstance(proc, ZygoteProcess)


@pytest.mark.slow  # a local Ray
def test_an_agent_whose_zygote_has_no_restarts_left_falls_back_at_once(monkeypatch, caplog):
    """Ray says "unavailable" while it restarts an actor and "died" once its restarts are
    spent: the agent waits on the first only (a wait longer than this test's timeout here)."""
    import logging

    import ray

    from tenax.testing.clusters import local_ray
    from tenax.workers import zygote as zygote_module

    monkeypatch.setattr(zygote_module, "RESTART_WAIT_S", 3600.0)
    with local_ray(gpus=0, cpus=1):
        actor = ray.remote(num_cpus=0, max_restarts=0)(Zygote).remote(timeout_s=120)
        os.kill(ray.get(actor.pid.remote(), timeout=60), signal.SIGKILL)
        caplog.set_level(logging.INFO, logger=zygote_module.__name__)
        source = ForkSource(actor, timeout_s=120)
        proc = source.start(os._exit, (5,), "tenax-test")
        proc.join(60)
    assert proc.exitcode == 5 and not isinstance(proc, ZygoteProcess)
    said = [r.getMessage() for r in caplog.records]
    assert any("did not answer (ActorDiedError" in m for m in said), said
