"""Chaos as users write it: the `--chaos` text parsed into events, its errors named, checked
against the job's ranks, nodes and steps, and the driver acting once through the doors a user
has (scale, report a node lost, publish)."""
from __future__ import annotations

import pytest

from tenax.orchestrator.chaos.faults import ChaosEvent, parse_chaos, validate_for_job
from tenax.orchestrator.errors import ChaosError
from tenax.orchestrator.spec import load_spec


def test_chaos_parsing():
    events = parse_chaos("kill rank=1 at=30; kill node=1 at=40 ;hang rank=0 at=50;"
                         "slow rank=2 factor=1.5 at=10; scale nodes=2 at=60; "
                         "corrupt-checkpoint at=25")
    assert events[0] == ChaosEvent("kill", 30, rank=1)
    assert events[1] == ChaosEvent("kill", 40, node=1)
    assert events[3].factor == 1.5 and events[4].nodes == 2
    assert events[1].targets(2, 2) and events[1].targets(3, 2) and not events[1].targets(1, 2)
    assert not events[5].targets(0, 2)


@pytest.mark.parametrize("text, message", [
    ("explode rank=1 at=3", "unknown fault 'explode'"),
    ("kill rank=1", "missing at=STEP"),
    ("kill at=3", "exactly one of rank=R or node=N"),
    ("slow rank=1 factor=0.5 at=3", "factor=0.5 must be > 1"),
    ("hang node=1 at=3", "hang needs rank=R"),
    ("kill rank=x at=3", "invalid literal"),
    ("kill rank=1 at=3 extra", "cannot read 'extra'"),
])
def test_chaos_errors(text, message):
    with pytest.raises(ChaosError, match=message):
        parse_chaos(text)


def test_chaos_validated_against_job():
    with pytest.raises(ChaosError, match="ranks 0..3"):
        validate_for_job(parse_chaos("kill rank=4 at=3"), world=4, nodes=2, steps=10)
    with pytest.raises(ChaosError, match="train.steps=10"):
        validate_for_job(parse_chaos("kill rank=0 at=11"), world=4, nodes=2, steps=10)


class _Doors:
    """The entry points a chaos driver may use, recording what it asked for."""

    def __init__(self) -> None:
        self.calls, self.subscribers = [], []
        self.spec = load_spec(overrides=["resources.max_nodes=2"])

    def subscribe(self, callback) -> None:
        self.subscribers.append(callback)

    def scale(self, nodes: int) -> None:
        if nodes > 2:
            raise ValueError(f"nodes: {nodes} is outside [min_nodes=1, max_nodes=2]")
        self.calls.append(("scale", nodes))

    def report_node_lost(self, block: int, reason: str) -> None:
        self.calls.append(("lost", block))

    def publish(self, event: str, /, **fields) -> None:
        self.calls.append((event, fields.get("detail")))


def test_chaos_driver_acts_once_through_the_user_doors():
    from tenax.orchestrator.chaos.driver import ChaosDriver

    doors = _Doors()
    driver = ChaosDriver(parse_chaos("scale nodes=2 at=5; scale nodes=9 at=6; kill node=1 at=8"))
    driver.attach(doors)
    for step in (3, 4, 4, 5, 6):
        doors.subscribers[0]({"event": "step", "step": step})
    doors.subscribers[0]({"event": "failure", "step": 6})  # before the kill's step: not it
    doors.subscribers[0]({"event": "failure", "step": 7})
    doors.subscribers[0]({"event": "failure", "step": 9})
    assert doors.calls == [("scale", 2), ("chaos", "target nodes 2"),
                           ("chaos", "refused: nodes: 9 is outside [min_nodes=1, max_nodes=2]"),
                           ("lost", 1)]
    assert driver.fired == {e.id for e in driver.events}
