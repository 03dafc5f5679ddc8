"""Ctrl-C and SIGTERM end a job CANCELLED, naming which: the signal travels as an exception
(the runner raises `Interrupted`), not as state the signal handler writes into the controller."""
from __future__ import annotations

import os
import signal
import time

import pytest

from orchestrator.inbox import Interrupted
from orchestrator.runner import sigterm_interrupts

pytestmark = pytest.mark.timeout(60)


def _interrupted_controller(exc: BaseException):
    from orchestrator.controller import Controller
    from orchestrator.spec import load_spec
    from orchestrator.states import JobState

    events: list[dict] = []
    controller = Controller(load_spec(overrides=["name=interrupts"]), on_event=events.append)

    def step_once() -> None:
        raise exc

    controller.step_once = step_once  # the loop is interrupted wherever it is
    assert controller.run() == JobState.CANCELLED
    return controller, events


@pytest.mark.parametrize("exc, by", [(KeyboardInterrupt(), "Ctrl-C"),
                                     (Interrupted("SIGTERM"), "SIGTERM")])
def test_the_cause_names_the_interrupt(exc, by):
    controller, events = _interrupted_controller(exc)
    ended = [e for e in events if e["event"] == "state"]
    assert ended[-1]["state"] == "CANCELLED" and ended[-1]["reason"] == f"interrupted ({by})"
    assert controller.cancel_requested


def _sigterm_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the handler runs between bytecodes of this thread
        time.sleep(0.01)


def test_sigterm_raises_interrupted_once_and_the_old_handler_comes_back(caplog):
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as raised:
        with sigterm_interrupts():
            _sigterm_self()
    assert raised.value.by == "SIGTERM" and isinstance(raised.value, KeyboardInterrupt)
    assert signal.getsignal(signal.SIGTERM) == before

    with sigterm_interrupts():  # a second SIGTERM while stopping is logged, not raised
        with pytest.raises(Interrupted):
            _sigterm_self()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
    assert any("already stopping" in r.getMessage() for r in caplog.records)
