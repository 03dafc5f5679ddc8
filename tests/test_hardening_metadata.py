"""Nothing read from checkpoint storage is unpickled.

A crafted `.metadata` whose unpickling would create a file is planted in a committed version
(with a manifest whose checksums match, as whoever can write the bucket could do); inspect,
verify and resume must never create that file, and the refusal must say why.
"""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tenax.checkpoint.errors import CheckpointError, MetadataFormatError
from tenax.checkpoint.format.catalog import Catalog
from tenax.checkpoint.format.manifest import CommitInfo
from tenax.checkpoint.format.metadata_codec import FORMAT, LEGACY_FORMAT, decode_metadata
from tenax.checkpoint.format.storage import Storage
from tenax.checkpoint.manager import CheckpointManager
from tenax.orchestrator.cli.main import main as tenax
from tests.ckpt_jobs import DictState, ckpt_config


class Planted:
    """Unpickling this creates `path` (what an attacker's payload would do, harmlessly)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.path,))


def manager(uri: str, state: DictState) -> CheckpointManager:
    return CheckpointManager(ckpt_config(uri), state, 0, 1, timeout_s=30, writer="sync")


def plant(root: Path, payload: bytes, fmt: str) -> str:
    """Commit step 1 normally, then swap in `payload` as .metadata and re-commit as `fmt`."""
    uri = f"file://{root}"
    state = DictState()
    with manager(uri, state) as mgr:
        state.train()
        mgr.save(1)
    catalog = Catalog(Storage(uri))
    old = catalog.manifest(1)
    catalog.storage.delete("step-00000001/manifest.json")
    catalog.storage.write_bytes("step-00000001/.metadata", payload)
    catalog.commit(CommitInfo(step=1, layout=old.layout, world_size=old.world_size,
                              model_hash=old.model_hash, data_cursor=old.data_cursor,
                              seed=old.seed, lr_step=old.lr_step,
                              extra={**old.extra, "format": fmt}))
    return uri


@pytest.mark.parametrize("fmt", [FORMAT, LEGACY_FORMAT])
def test_crafted_pickle_metadata_never_runs(tmp_path: Path, capsys, fmt: str) -> None:
    marker = tmp_path / "pwned"
    uri = plant(tmp_path / "ckpt", pickle.dumps(Planted(marker)), fmt)
    assert tenax(["ckpt", "inspect", uri, "--json"]) == 0
    assert tenax(["ckpt", "verify", uri]) == 0  # checksums match: the attacker wrote them
    with manager(uri, DictState(seed=3)) as mgr, pytest.raises(CheckpointError) as err:
        mgr.load()
    assert not marker.exists()
    assert "pickle" in str(err.value) and "older Tenax" in str(err.value)
    capsys.readouterr()


def test_json_metadata_round_trips_a_resume(tmp_path: Path) -> None:
    uri, state = f"file://{tmp_path}/ckpt", DictState()
    with manager(uri, state) as mgr:
        state.train()
        mgr.save(1)
    raw = (tmp_path / "ckpt" / "step-00000001" / ".metadata").read_bytes()
    assert json.loads(raw)["format"] == "tenax-dcp-metadata"
    fresh = DictState(seed=9)
    with manager(uri, fresh) as mgr:
        assert mgr.load() == 1
    for key, want in state.tensors.items():
        assert fresh.tensors[key].equal(want), key


GOOD = {"format": "tenax-dcp-metadata", "version": 1, "planner_data": {"w": ["w"]},
        "tensors": {"w": {"dtype": "float32", "requires_grad": False, "size": [4],
                          "chunks": [{"offsets": [0], "sizes": [4]}]}},
        "storage": [{"fqn": "w", "offset": [0], "index": 0, "file": "__0_0.distcp", "at": 0,
                     "length": 16, "shape": [4], "dtype": "float32"}]}


@pytest.mark.parametrize("change", [
    lambda d: d.update(version=2), lambda d: d.update(format="x"),
    lambda d: d["tensors"]["w"].update(dtype="__import__"),
    lambda d: d["tensors"]["w"].update(dtype="Tensor"),
    lambda d: d["tensors"]["w"].update(size=[-1]),
    lambda d: d["storage"][0].update(at=-5), lambda d: d.pop("storage"),
    lambda d: d["planner_data"].update(w={"a": 1}),
])
def test_malformed_metadata_is_refused_by_field(change) -> None:
    doc = json.loads(json.dumps(GOOD))
    decode_metadata(json.dumps(doc).encode(), "file:///x/.metadata")  # the baseline decodes
    change(doc)
    with pytest.raises(MetadataFormatError, match="/x/.metadata"):
        decode_metadata(json.dumps(doc).encode(), "file:///x/.metadata")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                    lambda kids: st.lists(kids, max_size=4)
                    | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=20))
def test_any_json_decodes_or_is_refused_cleanly(doc) -> None:
    for candidate in (doc, {**GOOD, "tensors": doc}, {**GOOD, "storage": doc}):
        try:
            decode_metadata(json.dumps(candidate).encode(), "u")
        except MetadataFormatError:
            pass
