"""A restore from memory reads its bytes once: the ranks check the assembled snapshot while they
load it, on parallel threads, and fall back to storage together when any share is damaged.

Also the pieces that make one pass fast: a file's CRC32C computed by several threads (its
ranges joined into the single-pass value) and destinations read by several threads.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import pytest
import torch

from tenax.checkpoint.format import split_crc
from tenax.checkpoint.format.catalog import Catalog, share_of
from tenax.checkpoint.format.storage import Storage
from tenax.checkpoint.load import parallel_reads
from tests.ckpt_jobs import DictState, ckpt_config
from tests.distributed import run_ranks

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("len_a,len_b", [(0, 0), (0, 9), (9, 0), (1, 1), (100, 37),
                                         (4096, 100_003), (3, 1 << 20)])
def test_joined_crcs_equal_one_pass_over_the_concatenation(len_a: int, len_b: int) -> None:
    rng = np.random.default_rng(len_a * 7 + len_b)
    a, b = rng.bytes(len_a), rng.bytes(len_b)
    assert split_crc.crc32c_join(crc32c.crc32c(a), crc32c.crc32c(b), len_b) == \
        crc32c.crc32c(a + b)


def test_a_file_and_a_buffer_checksummed_in_ranges_match_one_pass(tmp_path: Path,
                                                                  monkeypatch) -> None:
    monkeypatch.setattr(split_crc, "MIN_RANGE_BYTES", 1000)  # many ranges from a small file
    monkeypatch.setattr(split_crc, "READ_BYTES", 333)  # several reads per range
    data = np.random.default_rng(1).integers(0, 256, 123_457, dtype=np.uint8)
    path = tmp_path / "f"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        for threads in (1, 2, 5):
            assert split_crc.file_crc32c(fd, data.size, threads) == crc32c.crc32c(data)
            assert split_crc.buffer_crc32c(data, threads) == crc32c.crc32c(data)
        with pytest.raises(OSError, match="file ended at byte 123457"):
            split_crc.file_crc32c(fd, data.size + 10, 3)
    finally:
        os.close(fd)
    storage = Storage(f"file://{tmp_path}")
    assert storage.checksum("f") == (data.size, f"crc32c:{crc32c.crc32c(data):08x}")


def test_destinations_cut_into_pieces_over_threads_get_their_bytes(tmp_path: Path,
                                                                   monkeypatch) -> None:
    monkeypatch.setattr(parallel_reads, "PIECE_BYTES", 4096)  # one tensor over every thread
    from tenax.checkpoint.load.local_reads import LocalChunkReader

    data = np.random.default_rng(2).integers(0, 256, 200_000, dtype=np.uint8)
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "f").write_bytes(data.tobytes())
    targets = [torch.empty(30_000, dtype=torch.float32), torch.empty(5, 3, dtype=torch.int64),
               torch.empty(0)]
    offsets = [100, 130_000, 7]
    with LocalChunkReader(Storage(f"file://{tmp_path}"), "v") as files:
        files.open("f")
        parallel_reads.read_pieces(files, [("f", off, t) for off, t in zip(offsets, targets)],
                                   threads=3)
    for off, t in zip(offsets, targets):
        got = t.reshape(-1).view(torch.uint8).numpy()
        assert np.array_equal(got, data[off:off + got.size])


def save_job(rank: int, world: int, uri: str) -> None:
    from tenax.checkpoint.manager import CheckpointManager

    state = DictState(numel=200_000)
    with CheckpointManager(ckpt_config(uri), state, rank, world, timeout_s=60,
                           writer="sync") as mgr:
        for step in (1, 2):
            state.train()
            mgr.save(step)


def resume_job(rank: int, world: int, storage_uri: str, memory_uri: str) -> Any:
    """What a restarted rank does: resume from the assembled snapshot, else storage; returns
    (step, source, the loaded weights' first value) or the error it stopped with."""
    from tenax.checkpoint.errors import CheckpointError
    from tenax.checkpoint.manager import CheckpointManager
    from tenax.workers.memory_options import MemoryOptions, resume_rank

    state = DictState(seed=9, numel=200_000)  # other values than the saved ones
    with CheckpointManager(ckpt_config(storage_uri), state, rank, world, timeout_s=60) as mgr:
        try:
            step, source = resume_rank(mgr, MemoryOptions(restore_uri=memory_uri))
        except CheckpointError as exc:
            return f"stopped: {exc}"
    return step, source, float(state.tensors["model.w"][0])


def _saved_first_value() -> float:
    state = DictState(numel=200_000)
    state.train()
    state.train()
    return float(state.tensors["model.w"][0])


def test_a_snapshot_damaged_in_one_share_loads_from_storage_on_every_rank(tmp_path: Path) -> None:
    storage = f"file://{tmp_path}/ckpt"
    run_ranks(save_job, 2, storage)
    memory_root = tmp_path / "memory"
    shutil.copytree(tmp_path / "ckpt", memory_root)  # stands in for an assembled snapshot
    memory = f"file://{memory_root}"
    want = _saved_first_value()
    assert run_ranks(resume_job, 2, storage, memory) == [(2, "memory", want)] * 2
    manifest = Catalog(Storage(memory)).manifest(2)
    victim = sorted(share_of(manifest.files, 1, 2))[0]  # only rank 1 checks this file
    path = memory_root / "step-00000002" / victim
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x10
    path.write_bytes(bytes(data))
    # every rank falls back, and storage replaces whatever the damaged load wrote
    assert run_ranks(resume_job, 2, storage, memory) == [(2, "storage", want)] * 2
    said = run_ranks(resume_job, 2, f"file://{tmp_path}/empty", memory)
    assert all(s.startswith("stopped:") and "partly loaded" in s for s in said), said
