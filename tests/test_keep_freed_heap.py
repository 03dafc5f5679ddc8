"""A training process keeps its freed heap: a step's buffers are not faulted in afresh."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")]

# Allocate, touch and free a 48 MiB buffer 10 times, after 20 that settle the heap (above
# glibc's largest dynamic mmap threshold, 32 MiB: by default each one is a fresh mapping,
# 12,288 page faults each time). Tuned, the heap keeps the freed blocks; torch's aligned
# allocations take a few rounds to settle into them, and once in ~10 runs one more than the
# warm-up (a single buffer's 12,288 faults, seen once in CI), so up to two buffers' worth
# is allowed: against ten by default (at least eight asserted).
SCRIPT = textwrap.dedent("""
    import json, os, resource, sys
    import torch
    from tenax.workers.rank import keep_freed_heap

    tuned = keep_freed_heap() if sys.argv[1] == "tune" else None
    for _ in range(20):  # the heap grows to its steady size (aligned blocks need a few)
        torch.empty(12 << 20).fill_(1.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        torch.empty(12 << 20).fill_(1.0)
    print(json.dumps({"tuned": tuned,
                      "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
""")


PAGES_PER_BUFFER = (48 << 20) // 4096


def _faults(mode: str, env: dict[str, str] | None = None) -> dict:
    import os

    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                         timeout=100, env={**os.environ, **(env or {})}, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # two subprocesses that import torch and fault in 48 MiB buffers: ~6 s
def test_freed_buffers_are_reused_without_page_faults():
    untuned, tuned = _faults("plain"), _faults("tune")
    assert untuned["faults"] >= 8 * PAGES_PER_BUFFER, untuned  # fresh pages (almost) every time
    assert tuned["tuned"] is True and tuned["faults"] <= 2 * PAGES_PER_BUFFER, tuned


def test_a_users_own_malloc_setting_is_left_alone():
    mine = _faults("tune", {"MALLOC_TRIM_THRESHOLD_": "131072"})
    assert mine["tuned"] is False and mine["faults"] >= 8 * PAGES_PER_BUFFER, mine
