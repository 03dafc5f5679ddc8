"""Chaos soak, CI size: one fault of every kind in one job on local Ray (two logical nodes),
then the soak's own checks: the job succeeds with the clean run's losses, restarts equal the
unplanned faults that fired, every resume loaded a committed intact checkpoint, and no
committed step was lost. The checkers are also fed bad histories, to show they can fail."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench.soak import (KINDS, UNPLANNED, SoakConfig, checkpoint_order_violations, checks,
                        draw_faults, lost_committed_steps, run_soak)

pytestmark = pytest.mark.timeout(600)


def test_fault_draw_is_seeded_and_covers_every_kind():
    cfg = SoakConfig(n_faults=6, seed=3)
    faults = draw_faults(cfg)
    assert faults == draw_faults(SoakConfig(n_faults=6, seed=3))
    assert sorted(f.kind for f in faults) == sorted(KINDS)
    ats = [f.at for f in faults]
    assert len(set(ats)) == len(ats) and max(ats) < cfg.steps
    assert draw_faults(SoakConfig(n_faults=6, seed=4)) != faults
    with pytest.raises(ValueError, match="leave room"):
        draw_faults(SoakConfig(n_faults=6, steps=12))


def _events(*items: tuple) -> SimpleNamespace:
    return SimpleNamespace(events=[dict(event=kind, **fields) for kind, fields in items])


def test_lost_committed_steps_flags_a_resume_older_than_the_newest_intact_commit():
    history = [("checkpoint", {"step": 5}), ("checkpoint", {"step": 10}),
               ("failure", {"step": 12}), ("recovered", {"step": 5})]
    assert [r["lost"] for r in lost_committed_steps(_events(*history), keep_last=3)] == [5]
    corrupted = history[:2] + [("chaos", {"kind": "corrupt-checkpoint",
                                          "detail": "flipped 16 bytes of step-00000010/x"})
                              ] + history[2:]
    assert [r["lost"] for r in lost_committed_steps(_events(*corrupted), keep_last=3)] == [0]


def test_a_corrupted_version_whose_commit_event_arrives_late_is_not_intact():
    """The drill damaged step 10 on storage before the controller saw step 10's commit: the
    fallback to 5 is correct (0 lost); only a re-commit after a rollback makes 10 intact."""
    late = [("checkpoint", {"step": 5}),
            ("chaos", {"kind": "corrupt-checkpoint",
                       "detail": "flipped 16 bytes of step-00000010/x"}),
            ("checkpoint", {"step": 10}), ("failure", {"step": 12}), ("recovered", {"step": 5})]
    assert [r["lost"] for r in lost_committed_steps(_events(*late), keep_last=3)] == [0]
    again = late + [("checkpoint", {"step": 10}), ("failure", {"step": 11}),
                    ("recovered", {"step": 5})]
    assert [r["lost"] for r in lost_committed_steps(_events(*again), keep_last=3)] == [0, 5]


def test_checkpoint_order_violations_allow_only_rollbacks_through_recovery():
    ok = [("checkpoint", {"step": 5}), ("checkpoint", {"step": 10}), ("recovered", {"step": 5}),
          ("checkpoint", {"step": 10})]
    assert checkpoint_order_violations(_events(*ok)) == []
    bad = [("checkpoint", {"step": 10}), ("checkpoint", {"step": 5})]
    assert checkpoint_order_violations(_events(*bad)) == ["checkpoint step 5 after step 10"]


@pytest.mark.slow  # a clean and a chaos job on local Ray
def test_soak_with_every_fault_kind_loses_no_committed_step(tmp_path):
    # One GPU slot per logical node keeps it CI-sized: 2 ranks, or 1 after a scale-down.
    cfg = SoakConfig(n_faults=6, seed=1, gpus_per_node=1, timeout_s=400)
    result = run_soak(cfg, str(tmp_path))
    c = checks(result)
    assert c["state"] == "SUCCEEDED", c["cause"]
    assert c["faults_fired"] == 6 and all(c["fired_by_kind"][k] == 1 for k in KINDS), \
        c["fired_by_kind"]
    assert c["unplanned_fired"] == len(UNPLANNED)
    assert c["restarts"] == c["unplanned_fired"], c["recoveries"]
    assert c["final_loss"] == pytest.approx(c["clean_final_loss"], rel=1e-5)
    assert c["loss_mismatched_steps"] == []
    assert c["resumes_audited"] == c["resumes_expected"] > 0  # every resume was audited
    assert c["resumes_not_committed"] == []
    assert c["scaled_lost_steps"] == 0
    assert c["lost_committed_steps"] == 0, c["recoveries"]
    assert c["checkpoint_order_violations"] == []
