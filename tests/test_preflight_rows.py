"""The recovery row's columns say only what was checked."""
from __future__ import annotations


def test_an_unchecked_memory_restore_is_not_in_the_expected_column():
    from tenax.orchestrator.preflight.rows import recovery_row, with_memory

    storage = recovery_row(1, [], 1, 3.0, 3.0, "single rank zero1 (no other layout fits)")
    skipped = with_memory(storage, "warn", "in-memory restore not checked: it needs --steps >= 3",
                          checked=False)
    assert skipped.verdict == "warn" and "not checked" in skipped.detail
    assert "in-memory snapshot restored" not in skipped.expected
    ran = with_memory(storage, "pass", "in-memory snapshot of step 2 restored after a kill")
    assert ran.expected.endswith("; one in-memory snapshot restored")
