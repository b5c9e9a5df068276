"""WebDataset shards: staged by ShardWriter (a worker), committed by `commit_shard` (the driver), on a local folder
and on S3 (SeaweedFS on 127.0.0.1); read back by the readers users have (the `webdataset` library, Hugging Face
`datasets`); exactly once when the writing process is SIGKILLed with a shard open, and when a committing driver and
a driver settling what it left race for the same shard."""

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
import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from snapref_ray.storage.backends import open_storage
from snapref_ray.storage.ledger import committed_item_ids
from snapref_ray.storage.metadata import METADATA_SCHEMA, read_item_ids, read_metadata_table
from snapref_ray.storage.shards import (
    COMMITTED,
    SHARD_METADATA_SCHEMA,
    VOID,
    ClosedShard,
    ShardWriter,
    commit_shard,
    committed_shards,
    decide,
    filter_staged_shard,
    read_staged_rows,
    replace_staged_rows,
    settle_staged_shards,
    shard_member_key,
    verdict,
)
from tests.doc_blocks import block

REPO = Path(__file__).resolve().parents[2]


def _row(item_id: str) -> dict:
    return dict.fromkeys(METADATA_SCHEMA.names) | {"item_id": item_id, "prompt": f"prompt of {item_id}"}


def _image(item_id: str) -> bytes:
    return f"not really a png: {item_id}".encode() * 3


def _commit_closed(storage, writer: ShardWriter) -> list[str]:
    """What the driver does with a worker's answer: commit each shard it staged; the keys committed."""
    return [c.key for c in writer.drain() if c.staged and commit_shard(storage, c.key)]


def _tars(storage) -> list[str]:
    return [k for k in storage.list("shards/") if k.endswith(".tar")]


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
    assert len(writer.shards_staged) == 2 and writer.pending == 1
    assert read_item_ids(storage) == [] and _tars(storage) == []  # staged: nothing a reader sees yet
    assert _commit_closed(storage, writer) == writer.shards_staged
    assert read_item_ids(storage) == ids[:6]  # the open shard's item is not committed yet
    writer.close()
    _commit_closed(storage, writer)
    shards = writer.shards_staged
    assert len(shards) == 3 and committed_shards(storage) == sorted(shards)
    assert storage.list("staging/") == [] and all(verdict(storage, k) == COMMITTED for k in shards)
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


def test_the_docs_webdataset_block_reads_every_item_without_a_warning(tmp_path):
    """docs/jobs.md's `wds.WebDataset(...)` line as written (the shards' paths put in), warnings as errors:
    webdataset >= 1.0 warns when `shardshuffle` is not given."""
    pytest.importorskip("webdataset")
    storage = open_storage(str(tmp_path / "out"))
    ids = [f"item-{i:02d}" for i in range(5)]
    writer = ShardWriter(storage, name="w1", max_items=3)
    for i in ids:
        writer.add(_row(i), _image(i), "png", f"prompt of {i}")
    writer.close()
    assert len(_commit_closed(storage, writer)) == 2
    urls = sorted(str(tmp_path / "out" / k) for k in _tars(storage))
    code = block("docs/jobs.md", "jobs-webdataset")
    assert code.count('["out/shards/a.tar", ...]') == 1
    scope: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec(code.replace('["out/shards/a.tar", ...]', repr(urls)), scope)
        keys = [sample["__key__"] for sample in scope["samples"]]
    assert keys == ids  # in the order of the shards given, each item once


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
    writer.close()
    other.close()
    _commit_closed(storage, writer)
    _commit_closed(storage, other)
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
    from snapref_ray.storage.shards import ShardWriter, commit_shard

    storage = open_storage(sys.argv[1])
    writer = ShardWriter(storage, name="doomed", max_items=3)
    for i in range(5):
        item = f"item-{i:02d}"
        writer.add(dict.fromkeys(METADATA_SCHEMA.names) | {"item_id": item}, item.encode(), "png", item)
    (first,) = writer.drain()
    commit_shard(storage, first.key)  # the driver committed the full shard
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
    assert committed_item_ids(storage).sorted_ids() == ids[:3]
    # The rerun renders what is not committed, into a new shard.
    rerun = ShardWriter(storage, name="rerun", max_items=3)
    for i in ids:
        if i not in committed_item_ids(storage):
            rerun.add(_row(i), i.encode(), "png", i)
    rerun.close()
    _commit_closed(storage, rerun)
    urls = sorted(str(out / k) for k in storage.list("shards/") if k.endswith(".tar"))
    keys = [s["__key__"] for s in webdataset.WebDataset(urls, shardshuffle=False)]
    assert sorted(keys) == ids  # every item in exactly one committed shard
    assert sorted(read_item_ids(storage)) == ids


def _assert_exactly_once(storage, tmp_path) -> list[str]:
    """What a user reads: every metadata row's image is a member of the tar it names; every committed item is in
    exactly one tar of shards/; no tar there holds an uncommitted item. The committed ids."""
    committed = read_item_ids(storage)
    members: dict[str, list[str]] = {}
    for key in _tars(storage):
        local = tmp_path / f"read-{uuid.uuid4().hex}.tar"
        local.write_bytes(storage.get_bytes(key))
        for name in _members(local):
            if name.endswith(".png"):
                members.setdefault(name.removesuffix(".png"), []).append(key)
    table = read_metadata_table(storage).to_pylist()
    assert all(r["shard_key"] in members.get(r["item_id"], []) for r in table), "a row names an image no tar holds"
    assert all(len(where) == 1 for where in members.values()), f"items in two tars: {members}"
    assert sorted(members) == sorted(committed), "a tar in shards/ holds an uncommitted item"
    return committed


def test_a_sweep_that_wins_the_race_voids_the_shard_and_the_late_commit_commits_nothing(storage, tmp_path):
    writer = ShardWriter(storage, name="w1", max_items=2)
    for i in ("a", "b"):
        writer.add(_row(i), _image(i), "png", i)
    (staged,) = writer.drain()  # the driver got the answer, then paused before committing it
    settled = settle_staged_shards(storage, by="the new holder")  # a driver that took the output over
    assert settled.voided == [staged.key] and settled.committed == []
    assert storage.list("staging/") == [] and verdict(storage, staged.key) == VOID
    assert commit_shard(storage, staged.key) is False  # the paused driver wakes up: the store says no
    assert read_item_ids(storage) == [] and _tars(storage) == []
    assert _assert_exactly_once(storage, tmp_path) == []


def test_a_commit_that_wins_the_race_is_finished_by_the_sweep(storage, tmp_path):
    writer = ShardWriter(storage, name="w1", max_items=2)
    for i in ("a", "b"):
        writer.add(_row(i), _image(i), "png", i)
    (staged,) = writer.drain()
    # The committing driver decided, then was paused before it moved anything into place.
    assert decide(storage, staged.key, COMMITTED, by="the paused driver") == COMMITTED
    settled = settle_staged_shards(storage, by="the new holder")
    assert settled.committed == [staged.key] and settled.voided == []
    assert _assert_exactly_once(storage, tmp_path) == ["a", "b"]
    assert storage.list("staging/") == []
    # The paused driver resumes its commit: nothing is doubled, nothing lost.
    assert commit_shard(storage, staged.key) is True
    assert _assert_exactly_once(storage, tmp_path) == ["a", "b"]


def test_a_commit_cut_short_after_the_tar_moved_is_finished_rows_last(tmp_path):
    storage = open_storage(str(tmp_path / "out"))
    writer = ShardWriter(storage, name="w1", max_items=2)
    for i in ("a", "b"):
        writer.add(_row(i), _image(i), "png", i)
    (staged,) = writer.drain()
    decide(storage, staged.key, COMMITTED)
    # The tar and its index moved, then the driver died: the rows are still staged, so metadata/ names nothing yet.
    for name in (staged.key, staged.key.removesuffix(".tar") + ".parquet"):
        storage.copy("staging/" + name.rsplit("/", 1)[-1], name)
        storage.delete("staging/" + name.rsplit("/", 1)[-1])
    assert read_item_ids(storage) == []
    settle_staged_shards(storage)
    assert _assert_exactly_once(storage, tmp_path) == ["a", "b"]


def test_committer_and_sweeper_racing_from_threads_never_lose_or_double_an_item(tmp_path):
    import threading

    storage = open_storage(str(tmp_path / "out"))
    writer = ShardWriter(storage, name="w1", max_items=1)
    ids = [f"item-{i:02d}" for i in range(24)]
    for i in ids:
        writer.add(_row(i), _image(i), "png", i)
    staged = writer.drain()
    results: dict[str, bool] = {}
    barrier = threading.Barrier(2)

    def committer() -> None:
        barrier.wait()
        for shard in staged:
            results[shard.key] = commit_shard(storage, shard.key)

    def sweeper() -> None:
        barrier.wait()
        for _ in range(3):
            settle_staged_shards(storage)

    threads = [threading.Thread(target=committer), threading.Thread(target=sweeper)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    settle_staged_shards(storage)
    committed = _assert_exactly_once(storage, tmp_path)
    # What the committer was told is what the output holds: a shard it counted committed is, the others are not.
    for shard in staged:
        assert results[shard.key] == (verdict(storage, shard.key) == COMMITTED)
    assert len(committed) == sum(results.values())


def test_two_drivers_finishing_one_commit_write_its_rows_once(storage, tmp_path):
    """A paused committer copied the staged rows and stopped before deleting them; the driver settling after it
    finds them too: both copies land on one part (named by the decision), not the rows twice."""
    writer = ShardWriter(storage, name="w1", max_items=2)
    for i in ("a", "b"):
        writer.add(_row(i), _image(i), "png", i)
    (staged,) = writer.drain()
    settled_inside: list = []

    class PausedAfterCopy(type(storage)):
        def copy(self, src, dst):
            super().copy(src, dst)
            if src.endswith(".rows.parquet") and not settled_inside:  # the committer is paused here
                settled_inside.append(settle_staged_shards(storage, by="the next driver"))

    paused = object.__new__(PausedAfterCopy)
    paused.__dict__.update(storage.__dict__)
    assert commit_shard(paused, staged.key) is True
    assert settled_inside[0].committed == [staged.key]
    assert len([k for k in storage.list("metadata/") if k.endswith(".parquet")]) == 1
    assert read_item_ids(storage) == ["a", "b"]
    assert _assert_exactly_once(storage, tmp_path) == ["a", "b"]


def test_compaction_does_not_make_a_committed_shard_look_uncommitted(tmp_path):
    from snapref_ray.storage.metadata import compact_output_parts

    storage = open_storage(str(tmp_path / "out"))
    writer = ShardWriter(storage, name="w1", max_items=1)
    ids = [f"item-{i}" for i in range(8)]
    for i in ids:
        writer.add(_row(i), _image(i), "png", i)
    staged = writer.drain()
    for shard in staged[:4]:
        commit_shard(storage, shard.key)
    for shard in staged[4:]:  # decided, then the driver died: their files are still staged
        decide(storage, shard.key, COMMITTED)
    (part,) = [k for k in storage.list("metadata/") if "compact" not in k][:1]
    for i in range(4):  # eight parts (copies of one: the same rows, which readers keep once): compaction merges them
        storage.put_bytes(f"metadata/part-00000000T00000000000{i}Z-filler.parquet", storage.get_bytes(part))
    assert compact_output_parts(storage)["metadata"]
    assert not [k for k in storage.list("metadata/") if staged[0].key.rsplit("/", 1)[-1][:-4] in k]  # renamed
    settle_staged_shards(storage)  # the next driver: finishes the four, deletes nothing committed
    for shard in staged:  # and a commit retried after all that changes nothing
        assert commit_shard(storage, shard.key) is True
    assert len(_tars(storage)) == 8
    assert _assert_exactly_once(storage, tmp_path) == ids


def test_the_writer_tells_which_shards_it_staged_and_which_it_could_not(tmp_path):
    storage = open_storage(str(tmp_path / "out"))
    failing = [False]

    class Refusing(type(storage)):
        def put_bytes(self, key, data, content_type=None):
            if failing[0]:
                raise PermissionError("the store refused it")
            super().put_bytes(key, data, content_type)

    refusing = Refusing(storage.root)
    writer = ShardWriter(refusing, name="w1", max_items=2)
    for i in range(3):
        writer.add(_row(f"item-{i}"), _image(f"item-{i}"), "png", "p")
    (first,) = writer.shards_staged
    assert writer.drain() == [ClosedShard(first, 2, True)] and writer.drain() == []
    failing[0] = True
    with pytest.raises(PermissionError):
        writer.close()
    (refused,) = writer.drain()
    assert (refused.items, refused.staged, refused.error) == (1, False, "PermissionError: the store refused it")
    assert commit_shard(storage, first) is True
    assert read_item_ids(storage) == ["item-0", "item-1"]


def test_temporary_tars_of_dead_workers_are_removed(tmp_path):
    from snapref_ray.storage.shards import remove_dead_workers_temporaries

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = tmp_path / f"snapref-shard-{dead.stdout.strip()}-abc.tar"
    mine = tmp_path / f"snapref-shard-{os.getpid()}-def.tar"
    left.write_bytes(b"x" * 10)
    mine.write_bytes(b"y")
    assert remove_dead_workers_temporaries(str(tmp_path)) == [left]
    assert mine.exists() and not left.exists()


# -- a judged job's filtered commit (judge.keep_rejected_images: false; jobs/judged_commit.py) -----------------------


def _stage(storage, ids: list[str]) -> str:
    writer = ShardWriter(storage, name="w1", max_items=len(ids))
    for i in ids:
        writer.add(_row(i), _image(i), "png", f"prompt of {i}")
    (staged,) = writer.drain()
    return staged.key


def _tar_members(storage, key: str, tmp_path: Path) -> dict[str, bytes]:
    local = tmp_path / f"read-{uuid.uuid4().hex}.tar"
    local.write_bytes(storage.get_bytes(key))
    return _members(local)


def _commit_filtered(storage, key: str, keep: list[str]) -> bool:
    """What the driver does for a judged shard with rejected renders: the tar filtered, then the rows rewritten (a
    rejected render's row names no image), then the one conditional create."""
    filter_staged_shard(storage, key, keep)
    rows = read_staged_rows(storage, key).to_pylist()
    for row in rows:
        row["accepted"] = row["item_id"] in keep
        if not row["accepted"]:
            row.update(shard_key=None, shard_member=None, image_uri=None)
    replace_staged_rows(storage, key, pa.Table.from_pylist(rows, schema=SHARD_METADATA_SCHEMA))
    return commit_shard(storage, key)


def test_a_filtered_shard_holds_the_kept_items_only_and_its_index_points_at_them(storage, tmp_path):
    ids = [f"item-{i}" for i in range(6)]
    keep = ["item-0", "item-3", "item-4"]
    key = _stage(storage, ids)
    assert _commit_filtered(storage, key, keep) is True
    names = sorted(_tar_members(storage, key, tmp_path))
    assert names == sorted(f"{i}.{ext}" for i in keep for ext in ("json", "png", "txt"))
    members = _tar_members(storage, key, tmp_path)
    assert all(members[f"{i}.png"] == _image(i) and members[f"{i}.txt"] == f"prompt of {i}".encode() for i in keep)
    # The index's byte ranges are those of the filtered tar (what read_results reads: a ranged GET per image).
    index = pq.read_table(io.BytesIO(storage.get_bytes(key.removesuffix(".tar") + ".parquet"))).to_pylist()
    assert [r["item_id"] for r in index] == keep
    assert all(storage.get_range(key, r["image_offset"], r["image_size"]) == _image(r["item_id"]) for r in index)
    # Every render keeps its row; the rejected ones name no image, and the reader gives them none.
    from snapref_ray.data.results import read_item_images

    table = read_metadata_table(storage)
    assert sorted(table.column("item_id").to_pylist()) == ids
    images = dict(zip(table.column("item_id").to_pylist(), read_item_images(storage, table), strict=True))
    assert images == {i: (_image(i) if i in keep else None) for i in ids}
    assert storage.list("staging/") == []


def test_filtering_again_changes_nothing_and_a_shard_of_rejects_only_commits_an_empty_tar(tmp_path):
    storage = open_storage(str(tmp_path / "out"))
    key = _stage(storage, ["a", "b", "c"])
    first = filter_staged_shard(storage, key, ["b"])
    before = storage.get_bytes("staging/" + key.rsplit("/", 1)[-1])
    again = filter_staged_shard(storage, key, ["b"])  # a retried task: the same tar, byte for byte
    assert (first.items, first.members_kept, first.members_dropped) == (1, 3, 6)
    assert (again.items, again.members_dropped) == (1, 0)
    assert storage.get_bytes("staging/" + key.rsplit("/", 1)[-1]) == before
    assert _commit_filtered(storage, key, ["b"]) is True
    other = _stage(storage, ["x", "y"])
    assert _commit_filtered(storage, other, []) is True
    assert _tar_members(storage, other, tmp_path) == {} and read_item_ids(storage) == ["a", "b", "c", "x", "y"]
    # A reader over the output's shards reads the one kept image (an empty tar is a valid shard of none).
    webdataset = pytest.importorskip("webdataset")
    urls = sorted(str(tmp_path / "out" / k) for k in _tars(storage))
    assert len(urls) == 2
    assert [s["__key__"] for s in webdataset.WebDataset(urls, shardshuffle=False)] == ["b"]


class _Killed(BaseException):
    """The driver's process dying at a chosen write (a BaseException: nothing catches it on the way up)."""


def _dying_at(storage, key_part: str):
    """`storage`, but the first put whose key contains `key_part` kills the process that makes it."""

    class Dying(type(storage)):
        def put_bytes(self, key, data, content_type=None):
            if key_part in key:
                raise _Killed(key)
            super().put_bytes(key, data, content_type)

        def put_file(self, key, path):
            if key_part in key:
                raise _Killed(key)
            super().put_file(key, path)

        def put_if_absent(self, key, data):
            if key_part in key:
                raise _Killed(key)
            return super().put_if_absent(key, data)

        def copy(self, src, dst):
            if key_part in dst:
                raise _Killed(dst)
            super().copy(src, dst)

    dying = object.__new__(Dying)
    dying.__dict__.update(storage.__dict__)
    return dying


@pytest.mark.parametrize("killed_at", [".tar", ".parquet", ".rows.parquet", "shards/"])
def test_a_driver_killed_mid_filter_loses_no_kept_image_and_doubles_none(storage, tmp_path, killed_at):
    """Killed as the filtered tar is put, as its index is put, as the rows are rewritten, or as the decision is
    made: no decision, so the next driver voids the shard (nothing of it visible) and its renders are made again,
    once. Killed after the decision: the next driver finishes the filtered shard."""
    ids = ["a", "b", "c", "d"]
    key = _stage(storage, ids)
    stem = key.rsplit("/", 1)[-1].removesuffix(".tar")
    dying = _dying_at(storage, "shards/" if killed_at == "shards/" else f"staging/{stem}{killed_at}")
    with pytest.raises(_Killed):
        _commit_filtered(dying, key, ["a", "c"])
    assert read_item_ids(storage) == [] and _tars(storage) == []  # a reader sees nothing of it
    settled = settle_staged_shards(storage, by="the next driver")
    assert settled.voided == [key] and verdict(storage, key) == VOID and storage.list("staging/") == []
    again = _stage(storage, ids)  # its items render again
    assert _commit_filtered(storage, again, ["a", "c"]) is True
    assert sorted(read_item_ids(storage)) == ids
    tars = _tars(storage)
    assert tars == [again] and sorted(n for n in _tar_members(storage, again, tmp_path) if n.endswith(".png")) == [
        "a.png",
        "c.png",
    ]


def test_a_driver_killed_after_deciding_a_filtered_shard_is_finished_filtered(tmp_path):
    storage = open_storage(str(tmp_path / "out"))
    key = _stage(storage, ["a", "b", "c"])
    with pytest.raises(_Killed):  # decided committed, then killed as the tar was being moved into place
        _commit_filtered(_dying_at(storage, key), key, ["b"])
    assert verdict(storage, key) == COMMITTED and read_item_ids(storage) == []
    settle_staged_shards(storage, by="the next driver")
    assert sorted(n for n in _tar_members(storage, key, tmp_path) if n.endswith(".png")) == ["b.png"]
    assert read_item_ids(storage) == ["a", "b", "c"]
