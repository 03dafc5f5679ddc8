"""`Catalog.apply_retention` needs the head of the lineage: without it `keep_last` counts by
step number, and a job that resumed below a rotten newest version loses each new commit."""
from __future__ import annotations

import uuid

import pytest

from tenax.checkpoint.format.catalog import Catalog
from tenax.checkpoint.format.manifest import CommitInfo
from tenax.checkpoint.format.storage import Storage


def commit(cat: Catalog, step: int) -> None:
    cat.storage.write_bytes(f"step-{step:08d}/__0_0.distcp", b"w" * 16)
    cat.commit(CommitInfo(step=step, layout={"dp": 1}, world_size=1, model_hash="h",
                          data_cursor=step, seed=0, lr_step=step))


def test_retention_without_a_head_is_refused_and_with_one_keeps_the_new_lineage() -> None:
    cat = Catalog(Storage(f"memory://tenax-tests/{uuid.uuid4().hex}"))
    for step in (10, 20, 30):  # 30 rots; the job resumes from 20 and commits 25
        commit(cat, step)
    commit(cat, 25)
    with pytest.raises(TypeError, match="head"):
        cat.apply_retention(1, 0)  # type: ignore[call-arg]
    deleted = {d.step for d in cat.apply_retention(1, 0, head=25)}
    assert deleted == {10, 20} and cat.committed_steps() == [25, 30]
