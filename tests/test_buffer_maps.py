"""BufferMaps: a reused snapshot buffer is mapped once; no mapping outlives its file's name."""
from __future__ import annotations

import os

import pytest

from tenax.checkpoint.memory.buffer_maps import BufferMaps


def _write(maps: BufferMaps, path: str, data: bytes):
    mapped = maps.mapping(path, len(data))
    mapped[:len(data)] = data
    return mapped


def test_a_buffer_is_mapped_once_and_its_writes_are_the_files_bytes(tmp_path):
    maps = BufferMaps(limit=2)
    first = _write(maps, str(tmp_path / "s1"), b"a" * 5000)
    os.rename(tmp_path / "s1", tmp_path / "s2.partial")  # how a buffer is reused
    again = _write(maps, str(tmp_path / "s2.partial"), b"b" * 5000)
    assert again is first and len(maps) == 1
    assert (tmp_path / "s2.partial").read_bytes() == b"b" * 5000
    maps.close()
    assert first.closed


def test_a_deleted_buffer_is_unmapped_when_another_buffer_is_mapped(tmp_path):
    maps = BufferMaps(limit=4)
    gone = _write(maps, str(tmp_path / "old"), b"x" * 8192)
    os.unlink(tmp_path / "old")
    kept = _write(maps, str(tmp_path / "new"), b"y" * 8192)
    assert gone.closed and not kept.closed and len(maps) == 1


def test_at_most_limit_mappings_are_kept_and_the_least_recent_goes(tmp_path):
    maps = BufferMaps(limit=2)
    a = _write(maps, str(tmp_path / "a"), b"1" * 100)
    b = _write(maps, str(tmp_path / "b"), b"2" * 100)
    assert _write(maps, str(tmp_path / "a"), b"3" * 100) is a  # a is now the most recent
    c = _write(maps, str(tmp_path / "c"), b"4" * 100)
    assert b.closed and not a.closed and not c.closed and len(maps) == 2
    assert (tmp_path / "b").read_bytes() == b"2" * 100  # unmapping loses no byte


def test_another_size_maps_afresh_and_cuts_the_file(tmp_path):
    maps = BufferMaps(limit=2)
    path = str(tmp_path / "buf")
    big = _write(maps, path, b"z" * 9000)
    small = _write(maps, path, b"q" * 3000)
    assert small is not big and big.closed
    assert open(path, "rb").read() == b"q" * 3000


def test_a_mapping_still_being_written_survives_its_eviction(tmp_path):
    maps = BufferMaps(limit=1)
    mapped = maps.mapping(str(tmp_path / "a"), 4096)
    view = memoryview(mapped)  # a writer in another thread is mid-copy
    maps.mapping(str(tmp_path / "b"), 4096)  # evicts a
    view[:4] = b"late"
    view.release()
    assert (tmp_path / "a").read_bytes()[:4] == b"late" and len(maps) == 1


def test_sizes_and_limits_are_checked(tmp_path):
    with pytest.raises(ValueError, match="limit: 0"):
        BufferMaps(limit=0)
    with pytest.raises(ValueError, match="size: 0"):
        BufferMaps(limit=1).mapping(str(tmp_path / "a"), 0)
