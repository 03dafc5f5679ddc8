"""Tests for tenax.checkpoint.format.catalog: commit marker, verification, fallback, retention.

Every test runs on file:// and memory:// alike; expected retention sets are computed here
independently of `retention_plan`, from the rule as the design states it.
"""
from __future__ import annotations

import json
import logging
import pickle
import uuid
from typing import Any, Iterator

import pytest

from tenax.checkpoint.errors import CatalogError, ManifestError, StorageError
from tenax.checkpoint.format.catalog import (Catalog, FileEntry, Manifest, parse_version_name,
                                             spec_hash, version_name)
from tenax.checkpoint.format.manifest import FORMAT_VERSION, CommitInfo
from tenax.checkpoint.format.storage import Storage

META = dict(layout={"dp": 2, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero": 1}, world_size=2,
            model_hash="abc", data_cursor=0, seed=7, lr_step=0)


def commit_info(step: int, **fields: Any) -> CommitInfo:
    """The commit of `step` with META's manifest fields, `fields` replacing any of them."""
    return CommitInfo(step=step, **{**META, **fields})


@pytest.fixture(params=["file", "memory"])
def cat(request: pytest.FixtureRequest, tmp_path) -> Iterator[Catalog]:
    if request.param == "file":
        yield Catalog(Storage(f"file://{tmp_path}/ckpt"))
    else:
        s = Storage(f"memory://tenax-tests/{uuid.uuid4().hex}")
        yield Catalog(s)
        if s.fs.exists(s.root):  # the memory filesystem is process-wide
            s.fs.rm(s.root, recursive=True)


def shard(step: int, rank: int) -> bytes:
    return f"step {step} rank {rank} ".encode() * 50


def save(cat: Catalog, step: int, commit: bool = True) -> Manifest | None:
    """What the manager will do: begin, every rank writes its shard, one process commits."""
    cat.begin(step)
    name = version_name(step)
    for rank in range(2):
        cat.storage.write_bytes(f"{name}/__{rank}_0.distcp", shard(step, rank))
    cat.storage.write_bytes(f"{name}/.metadata", b"dcp metadata")
    if not commit:
        return None
    return cat.commit(commit_info(step, data_cursor=step * 32, lr_step=step))


def flip_byte(cat: Catalog, rel: str, at: int = 3) -> None:
    data = bytearray(cat.storage.read_bytes(rel))
    data[at] ^= 0x01
    cat.storage.write_bytes(rel, bytes(data))


# ---- names and hashes ------------------------------------------------------------------------
def test_version_names_are_pinned_eight_digits() -> None:
    assert version_name(40) == "step-00000040"
    assert version_name(0) == "step-00000000"
    assert parse_version_name("step-00000040") == 40
    for bad in ("step-40", "step-000000040", "step-0000004x", "tmp", "step-00000040.tmp"):
        assert parse_version_name(bad) is None
    for bad_step in (-1, 100_000_000, 1.0, "40", True):
        with pytest.raises(CatalogError):
            version_name(bad_step)


def test_spec_hash_is_canonical() -> None:
    a = {"dim": 256, "n_layers": 4, "moe": None, "extra": {"b": 1, "a": [1, 2]}}
    b = {"extra": {"a": [1, 2], "b": 1}, "moe": None, "n_layers": 4, "dim": 256}
    assert spec_hash(a) == spec_hash(b)
    assert len(spec_hash(a)) == 64 and int(spec_hash(a), 16) >= 0
    assert spec_hash(a) != spec_hash({**a, "dim": 257})
    assert spec_hash({"x": 1}) == \
        "5041bf1f713df204784353e82f6a4a535931cb64f1f4b4a5aeaffcb720918b22"  # sha256 of {"x":1}
    with pytest.raises(CatalogError):
        spec_hash({"x": float("nan")})


# ---- manifest --------------------------------------------------------------------------------
def test_manifest_json_round_trip() -> None:
    m = Manifest(step=40, layout={"dp": 2, "tp": 2}, world_size=4, model_hash="h" * 64,
                 data_cursor=1280, seed=3, lr_step=40,
                 files={"__0_0.distcp": FileEntry(10, "crc32c:0000000a"),
                        "sub/.metadata": FileEntry(3, "crc32:00000003")},
                 blocked_s=0.01, total_s=0.4, created_at="2026-01-01T00:00:00.000+00:00",
                 extra={"note": "x", "nested": {"a": [1, 2]}})
    back = Manifest.from_json(m.to_json())
    assert back == m
    raw = json.loads(m.to_json())
    assert raw["files"]["__0_0.distcp"] == {"size": 10, "checksum": "crc32c:0000000a"}
    assert raw["format_version"] == FORMAT_VERSION


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d.pop("step"), "lacks fields"),
    (lambda d: d.update(files={"../../etc/passwd": {"size": 1, "checksum": "crc32:0"}}),
     "rejected"),
    (lambda d: d.update(files={"/abs": {"size": 1, "checksum": "crc32:0"}}), "rejected"),
    (lambda d: d.update(format_version=FORMAT_VERSION + 1), "newer"),
    (lambda d: d.update(world_size=0), "world_size"),
    (lambda d: d.update(files={"a": {"size": 1}}), "malformed"),
])
def test_manifest_rejects_bad_input(mutate, match: str) -> None:
    good = Manifest(step=1, layout={}, world_size=1, model_hash="h", data_cursor=0, seed=0,
                    lr_step=0, files={"a": FileEntry(1, "crc32:00000001")})
    raw = json.loads(good.to_json())
    mutate(raw)
    with pytest.raises(ManifestError, match=match):
        Manifest.from_json(json.dumps(raw))
    with pytest.raises(ManifestError):
        Manifest.from_json(b"{not json")


def test_errors_are_picklable() -> None:
    for exc in (CatalogError("c"), ManifestError("m")):
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and str(back) == str(exc)


def test_every_checkpoint_and_parallel_error_pickles() -> None:
    """They cross Ray actor boundaries: a message-only constructor and a stable home."""
    import tenax.checkpoint.errors as checkpoint_errors
    import tenax.parallel.errors as parallel_errors

    classes = [c for module in (checkpoint_errors, parallel_errors) for c in vars(module).values()
               if isinstance(c, type) and issubclass(c, Exception)
               and c.__module__ == module.__name__]
    assert len(classes) == 17
    for cls in classes:
        back = pickle.loads(pickle.dumps(cls("why")))
        assert type(back) is cls and str(back) == "why"


# ---- commit ----------------------------------------------------------------------------------
def test_commit_records_every_file_and_round_trips(cat: Catalog) -> None:
    m = save(cat, 40)
    assert set(m.files) == {"__0_0.distcp", "__1_0.distcp", ".metadata"}
    assert m.files["__1_0.distcp"].size == len(shard(40, 1))
    assert m.data_cursor == 1280 and m.lr_step == 40 and m.world_size == 2
    assert m.created_at.endswith("+00:00") and m.total_s >= 0
    assert cat.manifest(40) == m
    assert cat.verify(40) == []


def test_commit_writes_manifest_last(cat: Catalog, monkeypatch) -> None:
    events: list[tuple[str, str]] = []
    storage = cat.storage
    real_checksum, real_write = storage.checksum, storage.write_bytes
    monkeypatch.setattr(storage, "checksum",
                        lambda rel, *a: events.append(("read", rel)) or real_checksum(rel, *a))
    monkeypatch.setattr(storage, "write_bytes",
                        lambda rel, d: events.append(("write", rel)) or real_write(rel, d))
    save(cat, 10)
    reads = [rel for kind, rel in events if kind == "read"]
    assert sorted(reads) == sorted(f"step-00000010/{n}" for n in
                                   ("__0_0.distcp", "__1_0.distcp", ".metadata"))
    assert events[-1] == ("write", "step-00000010/manifest.json")
    assert [e for e in events if e[1].endswith("manifest.json")] == [events[-1]]


def test_failed_commit_leaves_version_uncommitted(cat: Catalog, monkeypatch) -> None:
    save(cat, 10)
    save(cat, 20, commit=False)

    def broken(rel: str, *a):
        raise StorageError(f"boom {rel}")

    monkeypatch.setattr(cat.storage, "checksum", broken)
    with pytest.raises(CatalogError, match="boom"):
        cat.commit(commit_info(20))
    monkeypatch.undo()
    assert [(v.step, v.committed) for v in cat.versions()] == [(10, True), (20, False)]
    assert cat.latest_committed().step == 10


def test_version_without_manifest_is_never_latest(cat: Catalog) -> None:
    assert cat.latest_committed() is None
    save(cat, 10)
    save(cat, 20, commit=False)
    assert cat.committed_steps() == [10]
    assert [(v.step, v.committed) for v in cat.versions()] == [(10, True), (20, False)]
    assert cat.latest_committed().step == 10
    assert cat.latest_committed(verify=False).step == 10
    with pytest.raises(CatalogError, match="not committed"):
        cat.manifest(20)
    assert any("not committed" in p for p in cat.verify(20))


def test_commit_refuses_missing_empty_or_incomplete_versions(cat: Catalog) -> None:
    with pytest.raises(CatalogError, match="does not exist") as info:
        cat.commit(commit_info(10))
    assert cat.storage.url("step-00000010") in str(info.value)
    cat.begin(10)
    with pytest.raises(CatalogError, match="no files|does not exist"):
        cat.commit(commit_info(10))
    cat.storage.write_bytes("step-00000010/__0_0.distcp", b"x")
    with pytest.raises(CatalogError, match="missing files.*__1_0.distcp"):
        cat.commit(commit_info(10, expected_files=["__0_0.distcp", "__1_0.distcp"]))
    cat.storage.write_bytes("step-00000010/__1_0.distcp", b"")
    with pytest.raises(CatalogError, match="empty files.*__1_0.distcp"):
        cat.commit(commit_info(10))
    assert cat.committed_steps() == []
    m = cat.commit(commit_info(10, expected_files=["__0_0.distcp"], allow_empty_files=True))
    assert m.files["__1_0.distcp"].size == 0
    with pytest.raises(CatalogError, match="already committed"):
        cat.commit(commit_info(10))


def test_begin_wipes_leftover_and_guards_committed(cat: Catalog) -> None:
    save(cat, 10, commit=False)
    cat.storage.write_bytes("step-00000010/stale", b"from a crashed save")
    uri = cat.begin(10)
    assert uri == cat.storage.url("step-00000010")
    assert cat.storage.list_files("step-00000010") == {}
    save(cat, 20)
    with pytest.raises(CatalogError, match="already committed"):
        cat.begin(20)
    assert cat.verify(20) == []
    cat.begin(20, replace_committed=True)
    assert cat.committed_steps() == []


# ---- damage and fallback ---------------------------------------------------------------------
def test_flipped_byte_is_caught_and_latest_falls_back(cat: Catalog, caplog) -> None:
    save(cat, 10)
    save(cat, 20)
    flip_byte(cat, "step-00000020/__1_0.distcp")
    problems = cat.verify(20)
    assert len(problems) == 1 and "checksum mismatch" in problems[0]
    assert cat.storage.url("step-00000020/__1_0.distcp") in problems[0]
    assert cat.verify(10) == []
    with caplog.at_level(logging.WARNING, logger="tenax.checkpoint.format.catalog"):
        latest = cat.latest_committed()
    assert latest is not None and latest.step == 10
    assert any("step 20" in r.getMessage() and "checksum mismatch" in r.getMessage()
               for r in caplog.records if r.levelno == logging.WARNING)
    assert cat.latest_committed(verify=False).step == 20


def test_missing_truncated_and_garbled_versions_are_skipped(cat: Catalog, caplog) -> None:
    for step in (10, 20, 30, 40):
        save(cat, step)
    cat.storage.write_bytes("step-00000040/manifest.json", b"{garbled")
    cat.storage.write_bytes("step-00000030/__0_0.distcp", b"short")
    cat.storage.delete("step-00000020/.metadata")
    assert any("size mismatch" in p for p in cat.verify(30))
    assert any("missing file" in p for p in cat.verify(20))
    assert any("not valid JSON" in p for p in cat.verify(40))
    with caplog.at_level(logging.WARNING, logger="tenax.checkpoint.format.catalog"):
        assert cat.latest_committed().step == 10
    text = caplog.text
    assert "step 40" in text and "step 30" in text and "step 20" in text
    flip_byte(cat, "step-00000010/.metadata", at=0)
    assert cat.latest_committed() is None


# ---- retention -------------------------------------------------------------------------------
def expected_kept(steps: list[int], keep_last: int, keep_every: int) -> set[int]:
    """The retention rule, restated independently of the implementation."""
    kept = set(sorted(steps)[-keep_last:])
    if keep_every:
        kept |= {s for s in steps if s % keep_every == 0}
    return kept | {max(steps)}


@pytest.mark.parametrize("keep_last, keep_every", [(3, 0), (1, 0), (3, 50), (2, 40), (5, 30),
                                                   (25, 0), (1, 1000)])
@pytest.mark.parametrize("every_save", [True, False])
def test_retention_over_twenty_saves(cat: Catalog, keep_last: int, keep_every: int,
                                     every_save: bool, caplog) -> None:
    steps = [10 * i for i in range(1, 21)]
    deleted: list[int] = []
    with caplog.at_level(logging.INFO, logger="tenax.checkpoint.format.catalog"):
        for step in steps:
            save(cat, step)
            if every_save:
                deleted += [d.step for d in cat.apply_retention(keep_last, keep_every,
                                                                head=step)]
        if not every_save:
            deleted = [d.step for d in cat.apply_retention(keep_last, keep_every,
                                                           head=steps[-1])]
    want = expected_kept(steps, keep_last, keep_every)
    assert set(cat.committed_steps()) == want
    assert sorted(deleted) == sorted(set(steps) - want)
    assert {v.step for v in cat.versions()} == want  # no debris left behind
    logged = [r.getMessage() for r in caplog.records if "retention deleted" in r.getMessage()]
    assert len(logged) == len(deleted) and all("older than the last" in m for m in logged)


def test_retention_deletes_leftovers_but_not_in_progress(cat: Catalog) -> None:
    for step in (10, 20, 30):
        save(cat, step)
    save(cat, 15, commit=False)
    save(cat, 40, commit=False)  # newer than every committed one, but nobody is writing it
    save(cat, 50, commit=False)  # being written right now
    deleted = cat.apply_retention(2, 0, head=30, in_progress={50})
    assert {(d.step, d.committed) for d in deleted} == {(10, True), (15, False), (40, False)}
    assert all("uncommitted" in d.reason for d in deleted if not d.committed)
    assert [(v.step, v.committed) for v in cat.versions()] == [(20, True), (30, True),
                                                                (50, False)]


def test_newest_committed_and_protected_survive(cat: Catalog) -> None:
    for step in (10, 20, 30):
        save(cat, step)
    flip_byte(cat, "step-00000030/.metadata")  # newest is damaged: the job resumed from 20
    cat.apply_retention(1, 0, head=30, protect={20})
    assert cat.committed_steps() == [20, 30]
    assert cat.latest_committed().step == 20
    cat.apply_retention(1, 0, head=30)
    assert cat.committed_steps() == [30]
    with pytest.raises(ValueError, match="keep_last"):
        cat.apply_retention(0, 0, head=30)
    with pytest.raises(ValueError, match="keep_every"):
        cat.apply_retention(1, -1, head=30)


def test_delete_removes_manifest_before_files(cat: Catalog, monkeypatch) -> None:
    save(cat, 10)
    save(cat, 20)

    def crash(rel: str) -> bool:
        raise StorageError("crash mid-delete")

    monkeypatch.setattr(cat.storage, "delete_tree", crash)
    assert cat.apply_retention(1, 0, head=20) == []  # failure is logged, not raised
    monkeypatch.undo()
    # the manifest went first, so the half-deleted version is a leftover, not a broken commit
    assert [(v.step, v.committed) for v in cat.versions()] == [(10, False), (20, True)]
    assert [d.step for d in cat.apply_retention(1, 0, head=20)] == [10]


def test_manifest_of_another_step_is_rejected(cat: Catalog) -> None:
    save(cat, 10)
    save(cat, 20)
    cat.storage.write_bytes("step-00000020/manifest.json",
                            cat.storage.read_bytes("step-00000010/manifest.json"))
    with pytest.raises(ManifestError, match="claims step 10"):
        cat.manifest(20)
    assert cat.latest_committed().step == 10
