"""RawReader's local path (pread straight into the destination, or rows then a cut) reads the
same bytes as its fsspec path, for whole chunks, row ranges, column cuts, scalars and
non-contiguous destinations; short files and names outside the root fail clearly."""
from __future__ import annotations

import uuid

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from tenax.checkpoint.errors import ShardError, StorageError
from tenax.checkpoint.format.metadata_codec import ShardLocation
from tenax.checkpoint.format.storage import Storage
from tenax.checkpoint.load.local_reads import LocalChunkReader
from tenax.checkpoint.load.raw_reader import RawReader
from tenax.checkpoint.tensor_bytes import byte_view

VERSION = "step_00000001"
FILE = "__0_0.distcp"


class DictPlanner:
    """The two planner calls a reader makes, over named destination tensors."""

    def __init__(self, dest: dict[str, torch.Tensor]) -> None:
        self.dest, self.committed = dest, []

    def resolve_tensor(self, req: ReadItem) -> torch.Tensor:
        t = self.dest[req.dest_index.fqn]
        for dim, (off, n) in enumerate(zip(req.dest_offsets, req.lengths)):
            t = t.narrow(dim, off, n)
        return t

    def commit_tensor(self, req: ReadItem, tensor: torch.Tensor) -> None:
        self.committed.append(req.dest_index.fqn)


def stored() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(6, 5, generator=g), "b": torch.randn(7, generator=g),
            "s": torch.tensor(3.5), "h": torch.randn(4, 3, generator=g).to(torch.bfloat16)}


def write_version(storage: Storage, tensors: dict[str, torch.Tensor]) -> dict:
    """One file of raw bytes at planned offsets, as DeferredWriter lays it out."""
    blob, locations = b"", {}
    for name, t in tensors.items():
        index = MetadataIndex(name, torch.Size([0] * t.dim()))
        data = byte_view(t).tobytes()
        locations[index] = ShardLocation(FILE, len(blob), len(data), tuple(t.shape),
                                         str(t.dtype).removeprefix("torch."))
        blob += data
    storage.write_bytes(f"{VERSION}/{FILE}", blob)
    return locations


def item(name: str, dim: int, storage_offsets: list[int], lengths: list[int],
         dest: str | None = None) -> ReadItem:
    """Rows/columns `storage_offsets` + `lengths` of stored `name` into all of `dest`."""
    return ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(dest or name),
                    dest_offsets=torch.Size([0] * dim),
                    storage_index=MetadataIndex(name, torch.Size([0] * dim)),
                    storage_offsets=torch.Size(storage_offsets), lengths=torch.Size(lengths))


def plan_and_destinations() -> tuple[list[ReadItem], dict[str, torch.Tensor]]:
    dest = {"w_rows": torch.zeros(3, 5), "w_cols": torch.zeros(6, 2), "b": torch.zeros(7),
            "s": torch.zeros(()), "h": torch.zeros(4, 3, dtype=torch.bfloat16),
            "w_t": torch.zeros(5, 6).t()}  # a non-contiguous destination
    items = [item("w", 2, [2, 0], [3, 5], "w_rows"), item("w", 2, [0, 3], [6, 2], "w_cols"),
             item("b", 1, [0], [7]), item("s", 0, [], []), item("h", 2, [0, 0], [4, 3]),
             item("w", 2, [0, 0], [6, 5], "w_t")]
    return items, dest


def load(storage: Storage, locations: dict) -> dict[str, torch.Tensor]:
    items, dest = plan_and_destinations()
    reader = RawReader(storage, VERSION)
    reader.storage_data = dict(locations)
    planner = DictPlanner(dest)
    reader.read_data(LoadPlan(items), planner).wait()
    assert sorted(planner.committed) == sorted(dest)
    return dest


def test_local_reads_equal_fsspec_reads_and_the_stored_slices(tmp_path):
    tensors = stored()
    local = Storage(f"file://{tmp_path}", timeout_s=10)
    remote = Storage(f"memory://tenax-tests/{uuid.uuid4().hex}", timeout_s=10)
    assert local.is_local and not remote.is_local
    got_local = load(local, write_version(local, tensors))
    got_remote = load(remote, write_version(remote, tensors))
    want = {"w_rows": tensors["w"][2:5], "w_cols": tensors["w"][:, 3:5], "b": tensors["b"],
            "s": tensors["s"], "h": tensors["h"], "w_t": tensors["w"]}
    for name, t in want.items():
        assert torch.equal(got_local[name], t), name
        assert torch.equal(got_remote[name], t), name


def test_a_short_local_file_is_an_error_not_zeros(tmp_path):
    storage = Storage(f"file://{tmp_path}", timeout_s=10)
    locations = write_version(storage, stored())
    data = storage.read_bytes(f"{VERSION}/{FILE}")
    storage.write_bytes(f"{VERSION}/{FILE}", data[:-10])
    with pytest.raises(StorageError, match="short read"):
        load(storage, locations)


def test_rows_outside_the_stored_chunk_are_refused(tmp_path):
    storage = Storage(f"file://{tmp_path}", timeout_s=10)
    locations = write_version(storage, stored())
    reader = RawReader(storage, VERSION)
    reader.storage_data = dict(locations)
    bad = item("w", 2, [4, 0], [3, 5])
    with pytest.raises(ShardError, match="outside the stored chunk"):
        reader.read_data(LoadPlan([bad]), DictPlanner({"w": torch.zeros(3, 5)}))


def test_local_reader_stays_under_the_root_and_names_missing_files(tmp_path):
    storage = Storage(f"file://{tmp_path}/root", timeout_s=10)
    with LocalChunkReader(storage, "../elsewhere") as files, pytest.raises(StorageError):
        files.read_into(FILE, 0, bytearray(4))
    with LocalChunkReader(storage, VERSION) as files, \
            pytest.raises(StorageError, match="not found"):
        files.read_into(FILE, 0, bytearray(4))
