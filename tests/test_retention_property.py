"""Retention as properties: whatever the saves, the deaths before commit, the saves in
progress and the protected steps, everything kept is justified by the rule and nothing the
rule protects is deleted. The expected sets come from `expected_kept`, a restatement of the
rule independent of `retention_plan`."""
from __future__ import annotations

import uuid

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tenax.checkpoint.format.catalog import Catalog, retention_plan
from tenax.checkpoint.format.storage import Storage
from tests.test_catalog import expected_kept, save

ops = st.lists(st.tuples(st.integers(1, 6), st.booleans()), min_size=1, max_size=14)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, keep_last=st.integers(1, 4), keep_every=st.integers(0, 9),
       busy=st.sets(st.integers(0, 14), max_size=3), protect=st.sets(st.integers(0, 14)))
def test_retention_property(ops: list[tuple[int, bool]], keep_last: int, keep_every: int,
                            busy: set[int], protect: set[int]) -> None:
    cat = Catalog(Storage(f"memory://tenax-tests/{uuid.uuid4().hex}"))
    step, committed, leftovers = 0, [], []
    for gap, ok in ops:  # saves at increasing steps; some die before their commit
        step += gap
        save(cat, step, commit=ok)
        (committed if ok else leftovers).append(step)
    in_progress = {leftovers[i] for i in busy if i < len(leftovers)}
    protected = {committed[i] for i in protect if i < len(committed)}
    before = {v.step for v in cat.versions()}
    deleted = {d.step for d in cat.apply_retention(keep_last, keep_every,
                                                   head=max(committed, default=0),
                                                   in_progress=in_progress, protect=protected)}
    after = cat.versions()
    kept = {v.step for v in after}
    assert kept | deleted == before and not kept & deleted
    if committed:
        assert max(committed) in kept and cat.manifest(max(committed)).step == max(committed)
    newest = sorted(committed)[-keep_last:]
    for v in after:  # everything kept is justified ...
        if v.committed:
            assert (v.step in newest or v.step in protected
                    or (keep_every and v.step % keep_every == 0))
        else:
            assert v.step in in_progress
    for s in deleted:  # ... and nothing justified was deleted
        assert s not in newest and s not in protected and s not in in_progress
        assert not (s in committed and keep_every and s % keep_every == 0)


@given(committed=st.sets(st.integers(0, 500), max_size=30),
       uncommitted=st.sets(st.integers(0, 500), max_size=10),
       keep_last=st.integers(1, 6), keep_every=st.integers(0, 50))
def test_retention_plan_property(committed: set[int], uncommitted: set[int], keep_last: int,
                                 keep_every: int) -> None:
    plan = retention_plan(committed, uncommitted - committed, keep_last, keep_every)
    if committed:
        want = expected_kept(sorted(committed), keep_last, keep_every)
        assert set(plan) == (committed - want) | (uncommitted - committed)
        assert max(committed) not in plan
    else:
        assert set(plan) == uncommitted
