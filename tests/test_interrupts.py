"""Ctrl-C and SIGTERM end a job CANCELLED, naming which (what `tenax run` prints)."""
from __future__ import annotations

import os
import signal
import time
from typing import Any, Callable

import pytest

from tenax.orchestrator.cli.runner import sigterm_interrupts

pytestmark = pytest.mark.timeout(60)


def _controller(count_gpus: Callable[..., Any] | None = None) -> tuple[Any, list[dict[str, Any]]]:
    """A controller whose capacity count (its first call into a cluster, at PLACING) runs
    `count_gpus`: the real loop runs up to there without Ray."""
    from tenax.orchestrator.job.controller import Controller, ControllerOptions
    from tenax.orchestrator.spec import load_spec

    events: list[dict[str, Any]] = []
    seams = {"cluster_capacity": count_gpus} if count_gpus else {}
    options = ControllerOptions(on_event=events.append, **seams)
    return Controller(load_spec(overrides=["name=interrupts"]), options), events


def _sigterm_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the handler runs between bytecodes of this thread
        time.sleep(0.01)


@pytest.mark.parametrize("signalled", [False, True], ids=["ctrl-c", "sigterm"])
def test_the_cancelled_state_names_the_interrupt(signalled):
    from tenax.orchestrator.job.states import JobState

    def count_gpus(*_: Any) -> Any:  # the loop is interrupted wherever it is
        if signalled:
            _sigterm_self()
        raise KeyboardInterrupt

    controller, events = _controller(count_gpus)
    with sigterm_interrupts(controller):
        assert controller.run() == JobState.CANCELLED
    ended = [e for e in events if e["event"] == "state"][-1]
    by = "SIGTERM" if signalled else "Ctrl-C"
    assert ended["state"] == "CANCELLED" and ended["reason"] == f"interrupted ({by})"


def test_a_second_sigterm_while_stopping_is_logged_and_the_old_handler_comes_back(caplog):
    controller, _ = _controller()
    before = signal.getsignal(signal.SIGTERM)
    with sigterm_interrupts(controller):
        with pytest.raises(KeyboardInterrupt):
            _sigterm_self()
        os.kill(os.getpid(), signal.SIGTERM)  # stopping now: not raised
        time.sleep(0.2)
    assert signal.getsignal(signal.SIGTERM) == before
    assert any("already stopping" in r.getMessage() for r in caplog.records)


def test_a_changed_grant_has_the_loop_look_at_capacity_at_once_not_at_its_next_periodic_look(
) -> None:
    import time

    controller, _ = _controller()
    controller.next_capacity_check = time.monotonic() + 3600.0
    controller.capacity_changed("grown to 2 node(s): a job left")
    controller._drain_inbox()
    assert controller.next_capacity_check == 0.0
