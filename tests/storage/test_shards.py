"""WebDataset shards: written by ShardWriter to a local folder and to S3 (SeaweedFS on 127.0.0.1), read back
by the readers users have (the `webdataset` library, Hugging Face `datasets`), and exactly once when the
writing process is SIGKILLed with a shard open."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from snapref_ray.storage.backends import open_storage
from snapref_ray.storage.ledger import committed_item_ids
from snapref_ray.storage.metadata import METADATA_SCHEMA, read_item_ids, read_metadata_table
from snapref_ray.storage.shards import (
    ShardWriter,
    committed_shards,
    remove_orphan_shards,
    shard_member_key,
)

REPO = Path(__file__).resolve().parents[2]


def _row(item_id: str) -> dict:
    return dict.fromkeys(METADATA_SCHEMA.names) | {"item_id": item_id, "prompt": f"prompt of {item_id}"}


def _image(item_id: str) -> bytes:
    return f"not really a png: {item_id}".encode() * 3


def _members(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


@pytest.fixture(params=["local", "s3"])
def storage(request, tmp_path):
    if request.param == "local":
        return open_storage(str(tmp_path / "out"))
    server = request.getfixturevalue("s3_server")
    return open_storage(f"s3://{server.bucket}/shards-{uuid.uuid4().hex[:8]}", server.s3_options())


def test_items_go_into_shards_closed_at_a_count_with_an_index_and_metadata(storage, tmp_path):
    ids = [f"item-{i:02d}" for i in range(7)]
    writer = ShardWriter(storage, name="w1", max_items=3)
    rows = [writer.add(_row(i), _image(i), "png", f"prompt of {i}") for i in ids]
    assert len(writer.shards_committed) == 2 and writer.pending == 1
    assert read_item_ids(storage) == ids[:6]  # the open shard's item is not committed yet
    writer.commit()
    shards = writer.shards_committed
    assert len(shards) == 3 and committed_shards(storage) == sorted(shards)
    assert [k for k in storage.list("shards/") if k.endswith(".tar")] == sorted(shards)
    seen = {}
    for shard in shards:
        local = tmp_path / Path(shard).name
        local.write_bytes(storage.get_bytes(shard))
        members = _members(local)
        index = pq.read_table(io.BytesIO(storage.get_bytes(shard.removesuffix(".tar") + ".parquet"))).to_pylist()
        for entry in index:
            item = entry["item_id"]
            assert members[entry["image_member"]] == _image(item)
            data = local.read_bytes()
            assert data[entry["image_offset"] : entry["image_offset"] + entry["image_size"]] == _image(item)
            assert members[f"{item}.txt"] == f"prompt of {item}".encode()
            assert json.loads(members[f"{item}.json"])["item_id"] == item
            seen[item] = shard
    assert sorted(seen) == ids
    table = read_metadata_table(storage)
    assert sorted(table.column("item_id").to_pylist()) == ids
    by_id = {r["item_id"]: r for r in table.to_pylist()}
    assert all(by_id[i]["shard_key"] == seen[i] and by_id[i]["shard_member"] == f"{i}.png" for i in ids)
    assert [r["shard_key"] for r in rows] == [seen[i] for i in ids]


@pytest.mark.slow  # importing `datasets` is most of it
def test_the_readers_users_have_see_every_item_once(tmp_path):
    webdataset = pytest.importorskip("webdataset")
    datasets = pytest.importorskip("datasets")
    storage = open_storage(str(tmp_path / "out"))
    ids = [f"item-{i:02d}" for i in range(7)]
    writer = ShardWriter(storage, name="w1", max_items=3)
    for i in ids[:4]:
        writer.add(_row(i), _image(i), "png", f"prompt of {i}")
    other = ShardWriter(storage, name="w2", max_items=3)  # a second worker
    for i in ids[4:]:
        other.add(_row(i), _image(i), "png", f"prompt of {i}")
    writer.commit()
    other.commit()
    urls = sorted(str(tmp_path / "out" / k) for k in storage.list("shards/") if k.endswith(".tar"))
    assert len(urls) == 3
    samples = list(webdataset.WebDataset(urls, shardshuffle=False))
    assert sorted(s["__key__"] for s in samples) == ids
    for s in samples:
        assert s["png"] == _image(s["__key__"]) and s["txt"] == f"prompt of {s['__key__']}".encode()
        assert json.loads(s["json"])["item_id"] == s["__key__"]
    loaded = datasets.load_dataset(
        "webdataset", data_files={"train": urls}, split="train", cache_dir=str(tmp_path / "hf-cache")
    )
    assert sorted(loaded["__key__"]) == ids
    assert sorted(r["item_id"] for r in loaded["json"]) == ids


def test_an_item_id_with_a_dot_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"item id 'row\.7-0' cannot be a WebDataset sample key"):
        shard_member_key("row.7-0")


_WRITER = textwrap.dedent(
    """
    import sys
    from snapref_ray.storage.backends import open_storage
    from snapref_ray.storage.metadata import METADATA_SCHEMA
    from snapref_ray.storage.shards import ShardWriter

    writer = ShardWriter(open_storage(sys.argv[1]), name="doomed", max_items=3)
    for i in range(5):
        item = f"item-{i:02d}"
        writer.add(dict.fromkeys(METADATA_SCHEMA.names) | {"item_id": item}, item.encode(), "png", item)
    print("added", flush=True)
    sys.stdin.readline()
    """
)


def test_a_worker_killed_mid_shard_leaves_nothing_visible_and_a_rerun_makes_every_item_once(tmp_path):
    webdataset = pytest.importorskip("webdataset")
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.stdout.readline().strip() == "added"
    proc.send_signal(signal.SIGKILL)  # one shard of 3 committed, 2 items in the open one
    proc.wait()
    storage = open_storage(str(out))
    ids = [f"item-{i:02d}" for i in range(5)]
    visible = [k for k in storage.list("shards/") if k.endswith(".tar")]
    assert len(visible) == 1
    assert sorted(committed_item_ids(storage)) == ids[:3]
    # The rerun renders what is not committed, into a new shard.
    rerun = ShardWriter(storage, name="rerun", max_items=3)
    for i in ids:
        if i not in committed_item_ids(storage):
            rerun.add(_row(i), i.encode(), "png", i)
    rerun.commit()
    urls = sorted(str(out / k) for k in storage.list("shards/") if k.endswith(".tar"))
    keys = [s["__key__"] for s in webdataset.WebDataset(urls, shardshuffle=False)]
    assert sorted(keys) == ids  # every item in exactly one committed shard
    assert sorted(read_item_ids(storage)) == ids


def test_a_shard_published_without_its_commit_is_removed_before_a_rerun(storage):
    writer = ShardWriter(storage, name="w1", max_items=2)
    for i in ("a", "b", "c", "d"):
        writer.add(_row(i), _image(i), "png", i)
    first, second = writer.shards_committed
    # The worker died between publishing the second tar and committing its rows.
    (part,) = [k for k in storage.list("metadata/") if second.rsplit("/", 1)[-1].removesuffix(".tar") in k]
    storage.delete(part)
    assert remove_orphan_shards(storage) == [second]
    assert [k for k in storage.list("shards/")] == sorted([first, first.removesuffix(".tar") + ".parquet"])
    assert sorted(committed_item_ids(storage)) == ["a", "b"]


def test_a_worker_whose_driver_lost_the_lease_commits_no_shard(tmp_path):
    import functools

    from snapref_ray.storage.lease import LeaseLostError, OutputLease, check_holder

    storage = open_storage(str(tmp_path / "out"))
    stalled = OutputLease.acquire(storage, job_id="stalled", duration_s=30)
    writer = ShardWriter(storage, name="w1", guard=functools.partial(check_holder, storage, stalled.record.holder_id))
    writer.add(_row("a"), _image("a"), "png", "a")
    assert writer.commit() is not None  # its driver holds the output: committed
    writer.add(_row("b"), _image("b"), "png", "b")
    stalled.release()  # (as good as) taken over: another driver holds the output now
    successor = OutputLease.acquire(storage, job_id="successor", duration_s=30)
    with pytest.raises(LeaseLostError, match="taken over by job successor"):
        writer.commit()
    successor.release()
    assert sorted(committed_item_ids(storage)) == ["a"]
    assert len([k for k in storage.list("shards/") if k.endswith(".tar")]) == 1
    assert not [p for p in (tmp_path / "out" / "shards").iterdir() if ".tmp-" in p.name]  # no leftover spool


def test_the_writer_tells_which_shards_it_closed_and_whether_each_was_committed(tmp_path):
    from snapref_ray.storage.shards import ClosedShard, shard_is_committed

    storage = open_storage(str(tmp_path / "out"))
    refusing = [False]

    def guard() -> None:
        if refusing[0]:
            raise PermissionError("lease lost")

    writer = ShardWriter(storage, name="w1", max_items=2, guard=guard)
    for i in range(3):
        writer.add(_row(f"item-{i}"), _image(f"item-{i}"), "png", "p")
    (first,) = writer.shards_committed
    assert writer.drain() == [ClosedShard(first, 2, True)] and writer.drain() == []
    assert shard_is_committed(storage, first)
    refusing[0] = True
    with pytest.raises(PermissionError):
        writer.commit()
    (refused,) = writer.drain()
    assert (refused.items, refused.committed, refused.error) == (1, False, "PermissionError: lease lost")
    assert not shard_is_committed(storage, refused.key)


def test_a_lost_writers_shard_is_kept_when_committed_and_its_orphan_files_go_when_not(tmp_path):
    from snapref_ray.storage.shards import settle_lost_shard

    storage = open_storage(str(tmp_path / "out"))
    writer = ShardWriter(storage, name="w1")
    writer.add(_row("item-0"), _image("item-0"), "png", "p")
    committed = writer.commit()
    # What a writer killed between its tar and its metadata part leaves: the tar and the index, no commit.
    orphan = "shards/w2-000001-0123abcd.tar"
    storage.put_bytes(orphan, b"a tar")
    storage.put_bytes("shards/w2-000001-0123abcd.parquet", b"an index")
    assert settle_lost_shard(storage, committed) is True
    assert settle_lost_shard(storage, orphan) is False
    assert settle_lost_shard(storage, "shards/w3-000001-never0pub.tar") is False  # nothing was published
    assert storage.list("shards/") == sorted([committed, committed.removesuffix(".tar") + ".parquet"])
