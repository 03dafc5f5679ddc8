"""Tests for tenax.checkpoint.format.storage: confinement to the root, I/O on file://, memory://
and s3://.

The s3:// tests run against a moto S3 server on 127.0.0.1 (no network leaves the machine); they
are skipped, saying why, only when moto or s3fs is not installed.
"""
from __future__ import annotations

import os
import pickle
import socket
import time
import uuid
import zlib
from typing import Iterator

import fsspec
import pytest

from tenax.checkpoint.errors import StorageError, StorageNotFoundError, StorageTimeoutError
from tenax.checkpoint.format import storage as storage_mod
from tenax.checkpoint.format.catalog import Catalog
from tenax.checkpoint.format.manifest import CommitInfo
from tenax.checkpoint.format.storage import Storage, validate_relpath

ESCAPES = [
    "..", "../x", "a/..", "a/../../b", "a/../b", "/abs", "/etc/passwd", "//x", "~/x", "~",
    "a//b", "a/", "./a", "a/./b", ".", "a\\b", "..\\x", "C:/x", "C:x", "c:\\windows",
    "s3://other/x", "file:///etc/passwd", "a/\x00b", "a/\nb",
]


@pytest.fixture(scope="module")
def s3_options() -> Iterator[dict]:
    """A moto S3 server on 127.0.0.1 with dummy credentials and one bucket."""
    server_mod = pytest.importorskip(
        "moto.server", reason="moto[server] is not installed (pip install 'moto[server]')")
    pytest.importorskip("s3fs", reason="s3fs is not installed (pip install s3fs)")
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                           "AWS_DEFAULT_REGION": "us-east-1",
                           "AWS_EC2_METADATA_DISABLED": "true"}.items():
            mp.setenv(key, value)
        options = {"endpoint_url": f"http://{host}:{port}", "key": "testing",
                   "secret": "testing", "skip_instance_cache": True}
        try:
            fsspec.filesystem("s3", **options).mkdir("tenax-test")
        except FileExistsError:  # moto's backend is process-wide: another module made it
            pass
        yield options
    server.stop()


def _memory_root() -> str:
    return f"memory://tenax-tests/{uuid.uuid4().hex}"


@pytest.fixture(params=["file", "memory", "s3"])
def store(request: pytest.FixtureRequest, tmp_path) -> Iterator[Storage]:
    if request.param == "file":
        yield Storage(f"file://{tmp_path}/ckpt")
    elif request.param == "memory":
        s = Storage(_memory_root())
        yield s
        if s.fs.exists(s.root):  # the memory filesystem is process-wide
            s.fs.rm(s.root, recursive=True)
    else:
        opts = request.getfixturevalue("s3_options")
        yield Storage(f"s3://tenax-test/{uuid.uuid4().hex}", storage_options=opts)


# ---- confinement -----------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ESCAPES)
def test_validate_relpath_rejects_escapes(bad: str) -> None:
    with pytest.raises(StorageError):
        validate_relpath(bad)


@pytest.mark.parametrize("good", ["a", "a/b.c", ".metadata", "__0_0.distcp", "step-00000040",
                                  "step-00000040/manifest.json", "x/y/z/..a", "a..b"])
def test_validate_relpath_accepts_plain_names(good: str) -> None:
    assert validate_relpath(good) == good


def test_empty_path_only_allowed_for_root_queries(tmp_path) -> None:
    with pytest.raises(StorageError, match="empty"):
        validate_relpath("")
    assert validate_relpath("", allow_root=True) == ""
    s = Storage(str(tmp_path / "root"))
    with pytest.raises(StorageError):
        s.delete_tree("")
    with pytest.raises(StorageError):
        s.write_bytes("", b"x")


@pytest.mark.parametrize("bad", ESCAPES)
def test_storage_refuses_escapes_before_any_io(bad: str, tmp_path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"keep me")
    s = Storage(str(tmp_path / "root"))
    for op in (lambda: s.write_bytes(bad, b"x"), lambda: s.read_bytes(bad),
               lambda: s.delete_tree(bad), lambda: s.delete(bad), lambda: s.exists(bad),
               lambda: s.list_files(bad), lambda: s.size(bad), lambda: s.open_read(bad)):
        with pytest.raises(StorageError) as info:
            op()
        assert str(tmp_path / "root") in str(info.value)  # the error names the root
    assert (outside / "victim").read_bytes() == b"keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside"]


def test_root_uri_must_be_a_directory_of_its_own() -> None:
    for uri in ("", "   ", "/", "file:///"):
        with pytest.raises(StorageError):
            Storage(uri)
    with pytest.raises(StorageError, match="timeout_s"):
        Storage("memory://x", timeout_s=0)


# ---- I/O on every backend --------------------------------------------------------------------
def test_read_write_list_delete(store: Storage) -> None:
    assert store.list_dirs() == [] and store.list_files() == {}
    store.write_bytes("step-00000010/__0_0.distcp", b"abc" * 1000)
    store.write_bytes("step-00000010/.metadata", b"meta")
    store.write_bytes("step-00000010/sub/x", b"12345")
    store.write_bytes("step-00000020/y", b"y")
    assert store.list_dirs() == ["step-00000010", "step-00000020"]
    assert store.list_files("step-00000010") == {
        ".metadata": 4, "__0_0.distcp": 3000, "sub/x": 5}
    assert store.read_bytes("step-00000010/.metadata") == b"meta"
    assert store.size("step-00000010/__0_0.distcp") == 3000
    assert store.exists("step-00000010/sub/x") and store.isdir("step-00000010")
    assert not store.exists("step-00000010/nope")

    store.write_bytes("step-00000010/.metadata", b"new meta")  # overwrite
    assert store.read_bytes("step-00000010/.metadata") == b"new meta"
    assert store.delete("step-00000010/.metadata") is True
    assert store.delete("step-00000010/.metadata") is False
    assert store.delete_tree("step-00000010") is True
    assert store.delete_tree("step-00000010") is False
    assert store.list_dirs() == ["step-00000020"]
    assert store.list_files() == {"step-00000020/y": 1}


def test_ranged_reads(store: Storage) -> None:
    data = bytes(range(256)) * 64
    store.write_bytes("f.bin", data)
    assert store.read_range("f.bin", 100, 356) == data[100:356]
    assert store.read_range("f.bin", 5, 5) == b""
    with store.open_read("f.bin") as f:
        f.seek(1000)
        assert f.read(10) == data[1000:1010]
    with pytest.raises(StorageError):
        store.read_range("f.bin", 10, 5)


def test_missing_file_errors_name_the_uri(store: Storage) -> None:
    for op in (lambda: store.read_bytes("no/such"), lambda: store.size("no/such")):
        with pytest.raises(StorageNotFoundError) as info:
            op()
        assert store.url("no/such") in str(info.value)


def test_checksum_matches_reference_implementations(store: Storage) -> None:
    data = os.urandom(3 * storage_mod.READ_CHUNK_BYTES // 2)  # spans two read chunks
    store.write_bytes("blob", data)
    assert store.checksum("blob", "crc32") == (len(data), f"crc32:{zlib.crc32(data):08x}")
    if "crc32c" in storage_mod.checksum_algorithms():
        import crc32c
        assert store.checksum("blob", "crc32c") == (len(data), f"crc32c:{crc32c.crc32c(data):08x}")
    with pytest.raises(StorageError, match="md5"):
        store.checksum("blob", "md5")
    got = store.checksum_many(["blob", "missing"], "crc32")
    assert got["blob"][1] == f"crc32:{zlib.crc32(data):08x}"
    assert isinstance(got["missing"], StorageNotFoundError)


def test_pickles_and_reopens_the_same_root(store: Storage) -> None:
    store.write_bytes("k", b"v")
    clone = pickle.loads(pickle.dumps(store))
    assert clone.uri == store.uri and clone.read_bytes("k") == b"v"


# ---- file:// specifics -----------------------------------------------------------------------
def test_plain_path_is_file_protocol_and_exposes_local_path(tmp_path) -> None:
    s = Storage(str(tmp_path / "job"))
    assert s.is_local and s.uri == f"file://{tmp_path}/job"
    s.write_bytes("step-00000001/a", b"x")
    assert open(os.path.join(s.local_path("step-00000001"), "a"), "rb").read() == b"x"
    with pytest.raises(StorageError, match="not on a local filesystem"):
        Storage(_memory_root()).local_path("x")


def test_local_write_is_atomic_and_leaves_no_temp_files(tmp_path, monkeypatch) -> None:
    s = Storage(str(tmp_path / "job"))
    s.write_bytes("d/manifest.json", b"old")

    def broken_replace(src: str, dst: str) -> None:
        raise OSError("disk went away")

    monkeypatch.setattr(storage_mod.os, "replace", broken_replace)
    with pytest.raises(StorageError, match="disk went away") as info:
        s.write_bytes("d/manifest.json", b"new")
    assert s.url("d/manifest.json") in str(info.value)
    monkeypatch.undo()
    assert s.read_bytes("d/manifest.json") == b"old"
    assert os.listdir(tmp_path / "job" / "d") == ["manifest.json"]


def test_errors_are_picklable() -> None:
    for exc in (StorageError("m"), StorageNotFoundError("n"), StorageTimeoutError("t")):
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and str(back) == str(exc)


# ---- s3:// specifics -------------------------------------------------------------------------
def test_catalog_commit_verify_on_s3(s3_options: dict) -> None:
    s = Storage(f"s3://tenax-test/{uuid.uuid4().hex}", storage_options=s3_options)
    cat = Catalog(s)
    for step in (10, 20):
        cat.begin(step)
        s.write_bytes(f"step-{step:08d}/__0_0.distcp", b"w" * 1000 + bytes([step]))
        cat.commit(CommitInfo(step=step, layout={"dp": 1}, world_size=1, model_hash="h",
                              data_cursor=step, seed=0, lr_step=step))
    s.write_bytes("step-00000030/__0_0.distcp", b"partial")  # an uncommitted leftover
    assert [(v.step, v.committed) for v in cat.versions()] == [(10, True), (20, True),
                                                                (30, False)]
    s.write_bytes("step-00000020/__0_0.distcp", b"W" + b"w" * 999 + bytes([20]))
    assert any("checksum mismatch" in p for p in cat.verify(20))
    assert cat.latest_committed().step == 10
    deleted = cat.apply_retention(keep_last=1, head=20)
    assert {d.step for d in deleted} == {10, 30}  # 20 is damaged but newest: never deleted
    assert cat.committed_steps() == [20]


def test_s3_sees_writes_of_other_ranks_after_listing(s3_options: dict) -> None:
    uri = f"s3://tenax-test/{uuid.uuid4().hex}"
    mine, other_rank = (Storage(uri, storage_options=dict(s3_options)) for _ in range(2))
    assert mine.fs is not other_rank.fs
    mine.write_bytes("step-00000010/__0_0.distcp", b"0")
    assert mine.list_dirs() == ["step-00000010"]  # fills s3fs's listing cache
    assert mine.list_files("step-00000010") == {"__0_0.distcp": 1}
    assert not mine.exists("step-00000010/__1_0.distcp")
    other_rank.write_bytes("step-00000010/__1_0.distcp", b"11")
    other_rank.write_bytes("step-00000020/__1_0.distcp", b"11")
    assert mine.list_dirs() == ["step-00000010", "step-00000020"]
    assert mine.list_files("step-00000010") == {"__0_0.distcp": 1, "__1_0.distcp": 2}
    assert mine.exists("step-00000010/__1_0.distcp")
    assert mine.size("step-00000010/__1_0.distcp") == 2


def test_s3_calls_time_out_instead_of_hanging() -> None:
    pytest.importorskip("s3fs", reason="s3fs is not installed (pip install s3fs)")
    with socket.socket() as sink:  # accepts connections (kernel backlog), never answers
        sink.bind(("127.0.0.1", 0))
        sink.listen(16)
        port = sink.getsockname()[1]
        s = Storage("s3://tenax-test/hung", timeout_s=1.0, storage_options={
            "endpoint_url": f"http://127.0.0.1:{port}", "key": "k", "secret": "s",
            "skip_instance_cache": True, "config_kwargs": {"retries": {"max_attempts": 1}}})
        t0 = time.monotonic()
        with pytest.raises(StorageTimeoutError) as info:
            s.exists("step-00000001/manifest.json")
        assert time.monotonic() - t0 < 10
        assert "s3://tenax-test/hung" in str(info.value)
