"""Local folders and S3 (a real SeaweedFS on 127.0.0.1) pass the same Storage contract."""

from __future__ import annotations

import pickle
import threading
import time
import uuid
from pathlib import Path

import pytest

from snapref_ray.storage.backends import (
    LocalStorage,
    S3Options,
    S3Storage,
    Storage,
    StorageError,
    open_storage,
    read_uri,
)


@pytest.fixture(params=["local", "s3"])
def storage(request, tmp_path) -> Storage:
    if request.param == "local":
        return open_storage(str(tmp_path / "out"))
    server = request.getfixturevalue("s3_server")
    return open_storage(f"s3://{server.bucket}/contract-{uuid.uuid4().hex[:8]}", server.s3_options())


def test_put_get_and_overwrite(storage):
    storage.put_bytes("images/a.png", b"first")
    assert storage.get_bytes("images/a.png") == b"first"
    storage.put_bytes("images/a.png", b"second, longer")
    assert storage.get_bytes("images/a.png") == b"second, longer"
    assert storage.exists("images/a.png")
    assert not storage.exists("images/b.png")


def test_missing_key_names_storage_and_key(storage):
    with pytest.raises(StorageError) as e:
        storage.get_bytes("images/missing.png")
    assert f"no object 'images/missing.png' in storage {storage.uri}" in str(e.value)


def test_list_is_a_sorted_string_prefix(storage):
    for key in ["metadata/part-2.parquet", "metadata/part-1.parquet", "metadataX/y", "images/a.png", "summary.json"]:
        storage.put_bytes(key, b"x")
    assert storage.list("metadata/") == ["metadata/part-1.parquet", "metadata/part-2.parquet"]
    assert storage.list("meta") == ["metadata/part-1.parquet", "metadata/part-2.parquet", "metadataX/y"]
    assert storage.list("") == [
        "images/a.png",
        "metadata/part-1.parquet",
        "metadata/part-2.parquet",
        "metadataX/y",
        "summary.json",
    ]
    assert storage.list("errors/") == []


def test_delete(storage):
    storage.put_bytes("a/b", b"x")
    storage.delete("a/b")
    assert not storage.exists("a/b")
    assert storage.list("a/") == []
    storage.delete("a/b")  # missing: not an error


def test_put_if_absent_writes_once(storage):
    assert storage.put_if_absent("job.json", b"one") is True
    assert storage.put_if_absent("job.json", b"two") is False
    assert storage.get_bytes("job.json") == b"one"


def test_put_if_absent_race_has_one_winner(storage):
    results: list[bool] = []
    barrier = threading.Barrier(6)

    def claim(i: int) -> None:
        barrier.wait()
        results.append(storage.put_if_absent("marker", f"writer {i}".encode()))

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(results) == [False] * 5 + [True]
    assert storage.get_bytes("marker").startswith(b"writer ")


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_uri_for_names_where_the_object_is(kind, request, tmp_path):
    """The oracle is not the formula: the URI is the root this test opened plus the key, and a reader that is
    not the storage layer (the file system, a bare S3 client) finds the written bytes there."""
    if kind == "local":
        storage = open_storage(str(tmp_path / "out"))
        storage.put_bytes("images/a.png", b"the bytes")
        uri = storage.uri_for("images/a.png")
        assert uri == str(tmp_path) + "/out/images/a.png"
        assert open(uri, "rb").read() == b"the bytes"
    else:
        server = request.getfixturevalue("s3_server")
        prefix = f"contract-{uuid.uuid4().hex[:8]}"
        storage = open_storage(f"s3://{server.bucket}/{prefix}", server.s3_options())
        storage.put_bytes("images/a.png", b"the bytes")
        uri = storage.uri_for("images/a.png")
        assert uri == f"s3://snapref-test/{prefix}/images/a.png"
        body = server.client().get_object(Bucket="snapref-test", Key=f"{prefix}/images/a.png")["Body"].read()
        assert body == b"the bytes"


def test_pickles_for_ray_workers(storage):
    storage.put_bytes("k", b"v")
    clone = pickle.loads(pickle.dumps(storage))
    assert clone.uri == storage.uri
    assert clone.get_bytes("k") == b"v"


@pytest.mark.parametrize("key", ["../escape", "/abs", "a//b", "a/./b", ""])
def test_invalid_keys_are_refused(storage, key):
    with pytest.raises(StorageError, match="invalid storage key"):
        storage.put_bytes(key, b"x")


def test_storage_protocol(storage):
    assert isinstance(storage, Storage)


# -- local specifics ----------------------------------------------------------------------------


def test_local_root_is_created_and_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    st = open_storage("out/run1")
    assert isinstance(st, LocalStorage)
    assert st.uri == str(tmp_path / "out" / "run1")
    assert (tmp_path / "out" / "run1").is_dir()


def test_local_writes_leave_no_temporary_files_and_list_skips_inflight_ones(tmp_path):
    st = LocalStorage(tmp_path)
    st.put_bytes("images/a.png", b"x")
    st.put_if_absent("images/a.png", b"y")
    st.put_if_absent("images/b.png", b"y")
    assert sorted(p.name for p in (tmp_path / "images").iterdir()) == ["a.png", "b.png"]
    (tmp_path / "images" / ".c.png.tmp-0123").write_bytes(b"half")
    assert st.list("images/") == ["images/a.png", "images/b.png"]


def test_read_uri_local(tmp_path):
    (tmp_path / "m.bin").write_bytes(b"abc")
    assert read_uri(str(tmp_path / "m.bin")) == b"abc"
    assert read_uri(f"file://{tmp_path / 'm.bin'}") == b"abc"
    with pytest.raises(StorageError, match=f"file {tmp_path / 'nope.bin'} does not exist"):
        read_uri(str(tmp_path / "nope.bin"))


# -- S3 specifics -------------------------------------------------------------------------------


def test_open_storage_s3_uri_forms():
    st = open_storage("s3://bucket/a/b/", S3Options(endpoint_url="http://127.0.0.1:1"))
    assert isinstance(st, S3Storage)
    assert (st.bucket, st.prefix, st.uri) == ("bucket", "a/b", "s3://bucket/a/b")
    assert open_storage("s3://bucket").uri == "s3://bucket"
    assert open_storage("s3://bucket").uri_for("x/y") == "s3://bucket/x/y"
    with pytest.raises(StorageError, match="no bucket"):
        open_storage("s3:///x")


def test_read_uri_s3(s3_server):
    s3_server.client().put_object(Bucket=s3_server.bucket, Key="models/x.bin", Body=b"weights")
    assert read_uri(f"s3://{s3_server.bucket}/models/x.bin", s3_server.s3_options()) == b"weights"
    with pytest.raises(StorageError, match=r"s3://snapref-test/models/none.bin does not exist"):
        read_uri(f"s3://{s3_server.bucket}/models/none.bin", s3_server.s3_options())
    with pytest.raises(StorageError, match="expected an object URI"):
        read_uri(f"s3://{s3_server.bucket}/models/")


def test_options_fall_back_to_aws_environment(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-west-2")
    assert S3Options().resolved() == S3Options(endpoint_url="http://127.0.0.1:9", region="eu-west-3")
    monkeypatch.delenv("AWS_REGION")
    assert S3Options().resolved().region == "us-west-2"
    assert S3Options(region="ap-south-1", endpoint_url="http://127.0.0.1:8").resolved() == S3Options(
        region="ap-south-1", endpoint_url="http://127.0.0.1:8"
    )


def test_credentials_and_endpoint_from_environment_reach_the_server(s3_server, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    st = open_storage(f"s3://{s3_server.bucket}/env-{uuid.uuid4().hex[:8]}")
    st.put_bytes("a", b"from env")
    assert s3_server.client().get_object(Bucket=s3_server.bucket, Key=f"{st.prefix}/a")["Body"].read() == b"from env"


def test_wrong_secret_is_an_error_not_a_retry(s3_server):
    opts = S3Options(
        endpoint_url=s3_server.endpoint_url,
        access_key=s3_server.access_key,
        secret_key="wrong",
        region="us-east-1",
        max_attempts=1,
        outage_tolerance_s=600,
    )
    st = open_storage(f"s3://{s3_server.bucket}/x", opts)
    with pytest.raises(StorageError, match=r"PUT s3://snapref-test/x/a failed .*SignatureDoesNotMatch"):
        st.put_bytes("a", b"x")


@pytest.mark.slow
def test_put_survives_a_server_restart(s3_server):
    # Few botocore attempts, so the outage is bridged by our own retry loop (outage_tolerance_s).
    st = open_storage(f"s3://{s3_server.bucket}/outage", s3_server.s3_options(max_attempts=2, outage_tolerance_s=90))
    st.put_bytes("before", b"1")
    errors: list[BaseException] = []

    def put() -> None:
        try:
            st.put_bytes("during", b"written across an outage")
        except BaseException as e:
            errors.append(e)

    s3_server.stop()
    try:
        writer = threading.Thread(target=put)
        writer.start()
        time.sleep(3)
        assert writer.is_alive(), f"the put gave up while the server was down: {errors}"
    finally:
        s3_server.start()
    writer.join(timeout=120)
    assert not writer.is_alive() and errors == []
    assert st.get_bytes("during") == b"written across an outage"
    assert st.get_bytes("before") == b"1"


@pytest.mark.slow
def test_outage_longer_than_tolerance_fails_with_a_clear_error(s3_server):
    st = open_storage(f"s3://{s3_server.bucket}/outage2", s3_server.s3_options(max_attempts=1, outage_tolerance_s=1))
    s3_server.stop(graceful=False)
    try:
        with pytest.raises(
            StorageError, match=rf"PUT s3://snapref-test/outage2/k failed for 1 s \(endpoint {s3_server.endpoint_url}\)"
        ):
            st.put_bytes("k", b"x")
    finally:
        s3_server.start()


def test_put_file_publishes_a_local_file_whole_and_consumes_it(storage, tmp_path):
    data = bytes(range(256)) * 4096  # 1 MiB
    src = storage.temp_path_for("shards/a.tar") if isinstance(storage, LocalStorage) else tmp_path / "a.tar"
    src.write_bytes(data)
    assert storage.list("shards/") == []  # a temporary file beside the target is not listed
    storage.put_file("shards/a.tar", src)
    assert storage.get_bytes("shards/a.tar") == data
    assert storage.list("shards/") == ["shards/a.tar"]
    assert not src.exists()


def test_get_range_reads_the_bytes_asked_for_and_refuses_a_short_object(storage):
    data = bytes(range(256)) * 40  # 10,240 bytes, every offset distinguishable
    storage.put_bytes("shards/s.tar", data)
    assert storage.get_range("shards/s.tar", 0, 5) == data[:5]
    assert storage.get_range("shards/s.tar", 5000, 1234) == data[5000:6234]
    assert storage.get_range("shards/s.tar", len(data) - 7, 7) == data[-7:]
    assert storage.get_range("shards/s.tar", 100, 0) == b""
    with pytest.raises(StorageError, match="shorter than the range"):
        storage.get_range("shards/s.tar", len(data) - 7, 8)
    with pytest.raises(StorageError, match="no object 'shards/missing.tar'"):
        storage.get_range("shards/missing.tar", 0, 4)


def test_put_if_absent_without_hard_links_publishes_whole_files(tmp_path, monkeypatch):
    """On a filesystem without hard links (os.link fails), put_if_absent falls back to an exclusive create: the object
    must still appear whole (never empty or half written: the lease and job.json are read by other drivers), exactly
    one of racing writers must win, and nothing else may show in listings."""
    import errno
    import os

    storage = LocalStorage(tmp_path / "out")
    target = Path(storage.uri_for("lease/1.json"))
    data = b"{" + b"x" * 1_000_000 + b"}"
    sizes_seen: list[int] = []
    real_open = os.open

    def no_link(src, dst, *args, **kwargs):
        raise OSError(errno.EPERM, "hard links not supported", str(dst))

    def watching_open(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        if target.exists():  # what a reader would get at this moment
            sizes_seen.append(target.stat().st_size)
        return fd

    monkeypatch.setattr(os, "link", no_link)
    monkeypatch.setattr(os, "open", watching_open)
    assert storage.put_if_absent("lease/1.json", data) is True
    assert storage.put_if_absent("lease/1.json", b"second") is False
    assert storage.get_bytes("lease/1.json") == data
    assert all(size == len(data) for size in sizes_seen), sizes_seen
    assert storage.list("") == ["lease/1.json"] and os.listdir(target.parent) == ["1.json"]

    results: list[bool] = []
    barrier = threading.Barrier(6)

    def claim(i: int) -> None:
        barrier.wait()
        results.append(storage.put_if_absent("marker", f"writer {i}".encode() * 1000))

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(results) == [False] * 5 + [True]
    assert storage.get_bytes("marker").startswith(b"writer ") and len(storage.get_bytes("marker")) == 8000

    # A deleted object can be created again (the claim does not outlive its writer)...
    storage.delete("lease/1.json")
    assert storage.put_if_absent("lease/1.json", b"again") is True
    # ...and a claim left by a writer that died holding it is broken once it is stale, not while it is fresh.
    claim_file = target.with_name(".2.json.tmp-claim")
    claim_file.touch()
    assert storage.put_if_absent("lease/2.json", b"held") is False
    old = time.time() - 120
    os.utime(claim_file, (old, old))
    assert storage.put_if_absent("lease/2.json", b"taken over") is True
    assert storage.get_bytes("lease/2.json") == b"taken over" and not claim_file.exists()
