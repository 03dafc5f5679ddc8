"""The recovery and throughput rows' columns say only what was checked."""
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


def test_the_throughput_row_quotes_the_planner_only_for_gpu_ranks():
    """The planner prices every rank as a GPU: beside CPU ranks its figure means nothing."""
    from tenax.orchestrator.preflight.rows import throughput_row

    on_gpus = throughput_row({0: 9e4, 1: 1e5}, 2.5e5)
    assert on_gpus.expected == "planner 2.5e+05 tok/s (job)" and on_gpus.verdict == "pass"
    on_cpus = throughput_row({0: 9e4, 1: 1e5}, None)
    assert "planner" not in on_cpus.expected.replace("no planner figure", "")
    assert on_cpus.expected.endswith("(no planner figure for cpu)")
