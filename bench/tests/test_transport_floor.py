"""bench/transport_floor.py: the bare moves it times are whole, and its mover stops clean."""
from __future__ import annotations

import glob
import os
import time

import pytest

from bench.transport_floor import measure, mover

pytestmark = pytest.mark.timeout(120)


def test_the_bare_moves_arrive_whole_and_each_part_is_timed():
    out = measure(3 * (256 << 10) + 17, reps=3)  # several checksum stretches and a tail
    parts = ("copy_and_checksum_s", "send_s", "receive_and_checksum_s")
    assert all(out[p] > 0 for p in parts), out
    assert out["total_s"] == pytest.approx(sum(out[p] for p in parts))
    assert not glob.glob("/dev/shm/tenax-floor-*")


def test_the_mover_moves_until_the_block_ends_and_leaves_nothing():
    before = os.times()
    with mover(1 << 20, 2, 0.01):
        time.sleep(0.5)
    after = os.times()
    assert after.children_user + after.children_system > before.children_user + \
        before.children_system  # it ran, and was waited for
    assert not glob.glob("/dev/shm/tenax-mover-*")
