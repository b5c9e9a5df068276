"""Parquet metadata parts: written atomically, read back equal by pyarrow, pandas and HF datasets."""

from __future__ import annotations

import io
import json
import threading
import time
import uuid

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from snapref_ray.requests import RenderSettings
from snapref_ray.storage.backends import LocalStorage, StorageError, open_storage
from snapref_ray.storage.metadata import (
    ERRORS_SCHEMA,
    JUDGE_METADATA_COLUMNS,
    METADATA_SCHEMA,
    ErrorWriter,
    MetadataWriter,
    image_key,
    read_errors_table,
    read_item_ids,
    read_metadata_table,
    read_summary,
    reference_image_key,
    thumb_key,
    write_summary,
)


def make_row(i: int, **overrides) -> dict:
    """A complete metadata row; float values are exact in float32 so that read-back compares equal."""
    s = RenderSettings(width=512, height=768, steps=28, cfg=4.5, ref_weight=1.25, ref_end=0.75, ref_caption="solo")
    item_id = f"item-{i:04d}"
    row = {
        "item_id": item_id,
        "content_id": f"{i:020x}",
        "manifest_row": i,
        "reference_uris": [f"refs/char{i % 3}.png", "refs/extra.png"],
        "reference_hash": f"{i % 3:064x}",
        "reference_image_key": reference_image_key(f"{i % 3:064x}"),
        "prompt": f"1girl, scene {i}",
        "negative_prompt": "lowres",
        "seed": 2**40 + i,
        "width": s.width,
        "height": s.height,
        "steps": s.steps,
        "cfg": s.cfg,
        "sampler": s.sampler,
        "scheduler": s.scheduler,
        "mode": s.mode,
        "ref_weight": s.ref_weight,
        "ref_guidance": s.ref_guidance,
        "ref_in_uncond": s.ref_in_uncond,
        "correction": s.correction,
        "ref_start": s.ref_start,
        "ref_end": s.ref_end,
        "ref_caption": s.ref_caption,
        "settings_json": s.model_dump_json(),
        "image_key": image_key(item_id),
        "image_uri": f"/out/{image_key(item_id)}",
        "thumb_key": thumb_key(item_id),
        "image_format": "png",
        "adapter": "snapref.safetensors",
        "model": "anima-tiny",
        "worker_id": f"w{i % 2}",
        "node_id": "node-a",
        "encode_s": 0.5,
        "sample_s": 2.25,
        "decode_s": 0.125,
        "upload_s": 0.0625,
        "forward_batch": 4,
        "skipped_forwards": None,
        "attempt": 1,
        "started_at": 1_800_000_000.5 + i,
        "finished_at": 1_800_000_003.25 + i,
        "job": "f" * 64,
        **dict.fromkeys(JUDGE_METADATA_COLUMNS),  # a job that does not judge: null
    }
    row.update(overrides)
    return row


@pytest.fixture(params=["local", "s3"])
def storage(request, tmp_path):
    if request.param == "local":
        return open_storage(str(tmp_path / "out"))
    server = request.getfixturevalue("s3_server")
    return open_storage(f"s3://{server.bucket}/meta-{uuid.uuid4().hex[:8]}", server.s3_options())


def _pyarrow_fs(storage, request):
    """A pyarrow filesystem + base path that reads the output directly (as a data team would)."""
    if isinstance(storage, LocalStorage):
        return pa.fs.LocalFileSystem(), storage.uri
    server = request.getfixturevalue("s3_server")
    fs = pa.fs.S3FileSystem(
        endpoint_override=server.endpoint_url,
        scheme="http",
        access_key=server.access_key,
        secret_key=server.secret_key,
        region="us-east-1",
    )
    return fs, f"{storage.bucket}/{storage.prefix}"


def test_schema_columns_exactly():
    assert METADATA_SCHEMA.names == [
        "item_id",
        "content_id",
        "manifest_row",
        "reference_uris",
        "reference_hash",
        "reference_image_key",
        "prompt",
        "negative_prompt",
        "seed",
        "width",
        "height",
        "steps",
        "cfg",
        "sampler",
        "scheduler",
        "mode",
        "ref_weight",
        "ref_guidance",
        "ref_in_uncond",
        "correction",
        "ref_start",
        "ref_end",
        "ref_caption",
        "settings_json",
        "image_key",
        "image_uri",
        "thumb_key",
        "image_format",
        "adapter",
        "model",
        "worker_id",
        "node_id",
        "encode_s",
        "sample_s",
        "decode_s",
        "upload_s",
        "forward_batch",
        "skipped_forwards",
        "attempt",
        "started_at",
        "finished_at",
        "job",
        "render_of",
        "render_index",
        "score_sanity_nonfinite",
        "score_sanity_std",
        "score_sanity_luminance",
        "score_sanity_clipped",
        "score_near_duplicate",
        "score_identity_gap",
        "score_embedding",
        "phash",
        "accepted",
        "rejected_by",
    ]
    # The judged job's columns are the judges' own (one score column per score, the hash, the verdict).
    from snapref_ray.render_service.judges.scores import JUDGEMENT_COLUMNS

    assert set(JUDGEMENT_COLUMNS) <= set(JUDGE_METADATA_COLUMNS)
    assert METADATA_SCHEMA.field("reference_uris").type == pa.list_(pa.string())
    assert METADATA_SCHEMA.field("width").type == pa.int32() and METADATA_SCHEMA.field("cfg").type == pa.float32()
    assert ERRORS_SCHEMA.names == ["item_id", "manifest_row", "error", "stage", "attempt", "at"]


def test_layout_keys():
    assert image_key("r1-s0") == "images/r1-s0.png"
    assert image_key("r1-s0", "webp") == "images/r1-s0.webp"
    assert thumb_key("r1-s0") == "thumbs/r1-s0.jpg"
    assert reference_image_key("ab12") == "references/ab12.jpg"


def test_parts_read_back_equal_with_pyarrow_and_pandas(storage, request):
    rows = [make_row(i) for i in range(7)]
    with MetadataWriter(storage, flush_rows=3, flush_seconds=0) as writer:
        for row in rows:
            assert writer.add(row) is True
    parts = storage.list("metadata/")
    assert len(parts) == 3 and all(p.startswith("metadata/part-") and p.endswith(".parquet") for p in parts)
    assert writer.parts_written == parts and writer.rows_written == 7

    table = read_metadata_table(storage)
    assert table.schema.equals(METADATA_SCHEMA)
    assert table.to_pylist() == rows

    fs, base = _pyarrow_fs(storage, request)
    direct = pq.read_table(f"{base}/metadata", filesystem=fs)
    assert sorted(direct.to_pylist(), key=lambda r: r["item_id"]) == rows
    df = pd.read_parquet(f"{base}/metadata", filesystem=fs).sort_values("item_id").reset_index(drop=True)
    assert df["item_id"].tolist() == [r["item_id"] for r in rows]
    assert df["seed"].tolist() == [2**40 + i for i in range(7)]
    assert str(df["width"].dtype) == "int32" and str(df["cfg"].dtype) == "float32"
    assert df["reference_uris"][3].tolist() == ["refs/char0.png", "refs/extra.png"]
    assert json.loads(df["settings_json"][0])["ref_end"] == 0.75


def test_read_empty_output(storage):
    table = read_metadata_table(storage)
    assert table.num_rows == 0 and table.schema.equals(METADATA_SCHEMA)
    errors = read_errors_table(storage)
    assert errors.num_rows == 0 and errors.schema.equals(ERRORS_SCHEMA)
    assert read_summary(storage) is None


def test_duplicates_keep_the_first_committed_row(tmp_path):
    storage = LocalStorage(tmp_path)
    with MetadataWriter(storage, flush_seconds=0) as first:
        first.add(make_row(1, prompt="first"))
        first.add(make_row(2))
        assert first.add(make_row(1, prompt="same writer again")) is False
    with MetadataWriter(storage, flush_seconds=0) as second:  # e.g. a second driver that raced the first
        second.add(make_row(1, prompt="second writer"))
        second.add(make_row(3))
    table = read_metadata_table(storage)
    assert table.column("item_id").to_pylist() == ["item-0001", "item-0002", "item-0003"]
    assert table.column("prompt").to_pylist()[0] == "first"
    # The raw parts still hold both copies: readers, not writers, make the table exactly-once.
    assert pq.read_table(tmp_path / "metadata").num_rows == 4


def test_a_row_is_taken_once_per_writer_however_long_ago_it_was_added(tmp_path):
    """Past the last 4,096 ids a writer keeps them 16 bytes each (storage/id_claims.py), not as a set of str."""
    with MetadataWriter(LocalStorage(tmp_path), flush_rows=10_000, flush_seconds=0) as writer:
        assert all(writer.add(make_row(n)) for n in range(9_000))
        assert len(writer._recent) < 4_096 and len(writer._taken) >= 4_096
        assert writer.add(make_row(7, prompt="again, long after")) is False
        assert writer.add(make_row(8_999, prompt="again, just after")) is False
        assert writer.add(make_row(9_000)) is True
    assert read_metadata_table(LocalStorage(tmp_path)).num_rows == 9_001


def test_rows_must_match_the_schema(tmp_path):
    writer = MetadataWriter(LocalStorage(tmp_path), flush_seconds=0)
    row = make_row(1)
    del row["seed"]
    with pytest.raises(
        ValueError, match=r"metadata row 'item-0001': missing columns \['seed'\], unknown columns \['colour'\]"
    ):
        writer.add({**row, "colour": "red"})
    with pytest.raises(ValueError, match=r"metadata row 'item-0002' does not fit the schema: .*"):
        writer.add(make_row(2, width="wide"))
    assert writer.add(make_row(2)) is True  # the rejected attempt did not mark the id as taken
    writer.close()
    assert read_metadata_table(LocalStorage(tmp_path)).column("item_id").to_pylist() == ["item-0002"]


def test_every_value_is_checked_whichever_columns_a_row_leaves_null(tmp_path):
    """add() checks only a row's non-null values (a None fits any column): a bad value is still refused with its
    item id, in a column earlier rows left null and after rows with the same columns set."""
    writer = MetadataWriter(LocalStorage(tmp_path), flush_seconds=0)
    assert writer.add(make_row(1))  # the judge's columns left out
    assert writer.add(make_row(2, render_of="item-0002", render_index=0, accepted=True, phash="00ff00ff00ff00ff"))
    with pytest.raises(ValueError, match=r"metadata row 'item-0003' does not fit the schema"):
        writer.add(make_row(3, render_of="item-0003", render_index="first", accepted=True, phash="00ff00ff00ff00ff"))
    with pytest.raises(ValueError, match=r"metadata row 'item-0004' does not fit the schema"):
        writer.add(make_row(4, score_near_duplicate="far"))
    with pytest.raises(ValueError, match=r"metadata row 'item-0005' does not fit the schema"):
        writer.add(make_row(5, seed="lucky"))  # the same columns as item-0001's row
    with pytest.raises(ValueError, match=r"metadata row 'item-0006' does not fit the schema"):
        writer.add(make_row(6, negative_prompt=None, width=2**40))  # another set of null columns, an int32 overflow
    writer.close()
    table = read_metadata_table(LocalStorage(tmp_path))
    assert table.column("item_id").to_pylist() == ["item-0001", "item-0002"]
    assert table.column("render_index").to_pylist() == [None, 0]


def test_periodic_flush_commits_without_close(tmp_path):
    storage = LocalStorage(tmp_path)
    writer = MetadataWriter(storage, flush_rows=1000, flush_seconds=0.2)
    writer.add(make_row(1))
    deadline = time.monotonic() + 30
    while not storage.list("metadata/") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert read_metadata_table(storage).column("item_id").to_pylist() == ["item-0001"]
    assert writer.pending == 0
    writer.close()
    assert len(storage.list("metadata/")) == 1


def test_close_is_idempotent_and_rejects_later_rows(tmp_path):
    writer = MetadataWriter(LocalStorage(tmp_path), flush_seconds=0)
    writer.add(make_row(1))
    writer.close()
    writer.close()
    with pytest.raises(RuntimeError, match="MetadataWriter for .* is closed"):
        writer.add(make_row(2))


class FlakyStorage(LocalStorage):
    """Fails the first `failures` part writes, as an unreachable store would."""

    def __init__(self, root, failures: int):
        super().__init__(root)
        self.failures = failures

    def put_bytes(self, key, data, content_type=None):
        if self.failures:
            self.failures -= 1
            raise StorageError(f"PUT {self.uri_for(key)} failed: store unreachable")
        super().put_bytes(key, data, content_type)


def test_failed_flush_keeps_rows_for_the_next_one(tmp_path):
    storage = FlakyStorage(tmp_path, failures=1)
    writer = MetadataWriter(storage, flush_rows=2, flush_seconds=0)
    writer.add(make_row(1))
    with pytest.raises(StorageError, match="store unreachable"):
        writer.add(make_row(2))  # the part write fails; both rows stay buffered
    assert writer.pending == 2 and storage.list("metadata/") == []
    writer.add(make_row(3))
    writer.close()
    assert read_metadata_table(storage).column("item_id").to_pylist() == ["item-0001", "item-0002", "item-0003"]


def test_thread_safe_adds(tmp_path):
    storage = LocalStorage(tmp_path)
    writer = MetadataWriter(storage, flush_rows=16, flush_seconds=0.05)

    def add_range(start: int) -> None:
        for i in range(start, start + 50):
            writer.add(make_row(i))

    threads = [threading.Thread(target=add_range, args=(k * 50,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    writer.close()
    ids = pq.read_table(tmp_path / "metadata").column("item_id").to_pylist()
    assert sorted(ids) == [f"item-{i:04d}" for i in range(200)]  # every row once, none lost or doubled


def _png(color) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (24, 16), color).save(buf, "PNG")
    return buf.getvalue()


def test_embedded_images_load_as_pil_with_hf_datasets(tmp_path, monkeypatch):
    import datasets  # the `test` extra installs it

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    storage = LocalStorage(tmp_path / "out")
    colors = [(255, 0, 0), (0, 255, 0), (0, 0, 255)]
    with MetadataWriter(storage, flush_rows=2, flush_seconds=0, embed_images=True) as writer:
        for i, c in enumerate(colors):
            writer.add(make_row(i), image_bytes=_png(c))
        with pytest.raises(ValueError, match="metadata row 'item-0009': embed_images is on but no image bytes"):
            writer.add(make_row(9))

    part = pq.read_table(tmp_path / "out" / storage.list("metadata/")[0])
    assert part.schema.field("image").type == pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    hf = json.loads(part.schema.metadata[b"huggingface"])
    assert hf["info"]["features"]["image"] == {"_type": "Image"}
    assert hf["info"]["features"]["seed"] == {"dtype": "int64", "_type": "Value"}
    assert part.column("image").to_pylist()[0]["path"] == "item-0000.png"

    ds = datasets.load_dataset(
        "parquet",
        data_files=str(tmp_path / "out" / "metadata" / "*.parquet"),
        split="train",
        cache_dir=str(tmp_path / "hf-cache"),
    )
    assert ds.num_rows == 3
    assert isinstance(ds.features["image"], datasets.Image)
    by_id = {r["item_id"]: r for r in ds}
    for i, c in enumerate(colors):
        img = by_id[f"item-{i:04d}"]["image"]
        assert isinstance(img, Image.Image) and img.size == (24, 16)
        assert img.convert("RGB").getpixel((3, 3)) == c
    assert by_id["item-0001"]["reference_uris"] == ["refs/char1.png", "refs/extra.png"]

    # Our own reader keeps the column too.
    assert read_metadata_table(storage).column("image").to_pylist()[2]["bytes"] == _png(colors[2])


def test_errors_table_drops_items_that_later_succeeded(storage):
    with ErrorWriter(storage, flush_seconds=0) as errors:
        errors.record(RuntimeError("CUDA out of memory"), "sample", item_id="item-0001", attempt=1)
        errors.record("reference file refs/missing.png does not exist", "validate", manifest_row=17)
        errors.record(
            ValueError("sampler 'dpm' is not one of euler, er_sde"), "validate", item_id="item-0005", manifest_row=5
        )
        with pytest.raises(
            ValueError, match=r"stage must be one of \('validate', 'encode', 'sample', 'write'\), got 'upload'"
        ):
            errors.record("x", "upload", item_id="item-0006")
    with MetadataWriter(storage, flush_seconds=0) as meta:
        meta.add(make_row(1))  # the OOM item succeeded on its second attempt

    table = read_errors_table(storage)
    assert table.schema.equals(ERRORS_SCHEMA)
    assert table.select(["item_id", "manifest_row", "error", "stage", "attempt"]).to_pylist() == [
        {
            "item_id": None,
            "manifest_row": 17,
            "error": "reference file refs/missing.png does not exist",
            "stage": "validate",
            "attempt": 1,
        },
        {
            "item_id": "item-0005",
            "manifest_row": 5,
            "error": "ValueError: sampler 'dpm' is not one of euler, er_sde",
            "stage": "validate",
            "attempt": 1,
        },
    ]
    assert read_errors_table(storage, exclude_ids=set()).num_rows == 3
    assert read_errors_table(storage, exclude_ids={"item-0005"}).column("item_id").to_pylist() == ["item-0001", None]


def test_summary_round_trip(storage):
    summary = {"images": 7, "errors": 2, "images_per_hour": 1234.5, "encodes_per_reference": {"ab": 1}}
    write_summary(storage, summary)
    assert read_summary(storage) == summary
    assert storage.get_bytes("summary.json").startswith(b"{\n")


def test_compaction_merges_small_parts_keeping_rows_and_the_first_commit(tmp_path):
    from snapref_ray.storage.metadata import compact_parts

    storage = open_storage(str(tmp_path / "out"))
    writer = MetadataWriter(storage, flush_rows=3, flush_seconds=0)
    for i in range(30):
        writer.add(make_row(i, worker_id="first" if i == 4 else "w"))
    writer.close()
    big = MetadataWriter(storage, flush_rows=40, flush_seconds=0)  # a part large enough to stay as it is
    for i in range(30, 70):
        big.add(make_row(i))
    big.close()
    late = MetadataWriter(storage, flush_rows=3, flush_seconds=0)  # a second writer commits item 4 again
    for i in [4, *range(70, 80)]:
        late.add(make_row(i, worker_id="second" if i == 4 else "w"))
    late.close()
    before = read_metadata_table(storage)
    parts_before = storage.list("metadata/")
    assert len(parts_before) == 10 + 1 + 4

    written = compact_parts(storage, target_rows=80, min_parts=8)

    parts = storage.list("metadata/")
    # The 10 small parts before the big one become 1, the 4 after it 1: order kept around the big part.
    assert len(written) == 2 and len(parts) == 3
    assert parts[1] in parts_before  # the big part
    after = read_metadata_table(storage)
    assert after.num_rows == before.num_rows == 80
    assert after.to_pylist() == before.to_pylist()
    assert {r["item_id"]: r["worker_id"] for r in after.to_pylist()}["item-0004"] == "first"
    # Rows of different parts are not merged: the later commit of item 4 is still there, behind the first.
    assert sorted(read_item_ids(storage)) == sorted([f"item-{i:04d}" for i in range(80)] + ["item-0004"])
    assert compact_parts(storage, target_rows=80, min_parts=8) == []  # nothing small left to merge


def test_compaction_writes_each_run_before_it_reads_the_parts_after_it(tmp_path):
    """What compaction holds is one run of parts, not the output: a run's merged part is written (and its parts
    deleted) before parts past the next batch of fetches are read."""
    from snapref_ray.storage.metadata import compact_parts

    class Recording(LocalStorage):
        events: list[tuple[str, str]] = []

        def get_bytes(self, key):
            self.events.append(("read", key))
            return super().get_bytes(key)

        def put_bytes(self, key, data, **kwargs):
            self.events.append(("write", key))
            return super().put_bytes(key, data, **kwargs)

    storage = Recording(tmp_path / "out")
    writer = MetadataWriter(storage, flush_rows=10, flush_seconds=0)
    for i in range(400):  # 40 parts of 10 rows
        writer.add(make_row(i))
    writer.close()
    before = read_metadata_table(storage)
    Recording.events = []
    written = compact_parts(storage, target_rows=50, min_parts=8)  # runs of 5 parts
    assert len(written) == 8 and len(storage.list("metadata/")) == 8
    reads = [k for e, k in Recording.events if e == "read"]
    first_write = Recording.events.index(next(e for e in Recording.events if e[0] == "write"))
    assert len(reads) == 40 and sum(e == "read" for e, _ in Recording.events[:first_write]) <= 8 + 5
    assert read_metadata_table(storage).to_pylist() == before.to_pylist()


def test_error_parts_are_compacted_keeping_every_failure_of_an_item(tmp_path):
    from snapref_ray.storage.metadata import ERRORS_PREFIX, compact_output_parts

    storage = open_storage(str(tmp_path / "out"))
    # A long job: an error part per flush, an item failing on several attempts, rows without an id.
    recorded = []
    for flush in range(12):
        with ErrorWriter(storage, flush_rows=100, flush_seconds=0) as errors:
            for attempt in (1, 2):
                row = {
                    "item_id": f"item-{flush % 5:04d}" if flush % 3 else None,
                    "manifest_row": flush,
                    "error": f"ValueError: flush {flush} attempt {attempt}",
                    "stage": "sample",
                    "attempt": attempt,
                    "at": 1000.0 + flush * 10 + attempt,
                }
                errors.add(row)
                recorded.append(row)
    assert len(storage.list(f"{ERRORS_PREFIX}/")) == 12

    written = compact_output_parts(storage)

    assert written["metadata"] == [] and len(written[ERRORS_PREFIX]) == 1
    assert storage.list(f"{ERRORS_PREFIX}/") == written[ERRORS_PREFIX]
    # Every failure is still there, in commit order (the oracle: the rows as they were added).
    assert read_errors_table(storage, exclude_ids=set()).to_pylist() == recorded


@pytest.mark.parametrize("target_rows", [50_000, 40])  # the merged part small (merged again) or large (kept)
@pytest.mark.parametrize("deleted_before_crash", [0, 5])
def test_an_interrupted_errors_compaction_leaves_no_doubled_rows_after_the_next(
    tmp_path, target_rows, deleted_before_crash
):
    """A driver killed between writing a merged errors part and deleting the parts it merged leaves their rows twice;
    the next compaction must not keep them twice for good (error rows are not de-duplicated by id)."""
    from snapref_ray.storage.metadata import ERRORS_PREFIX, compact_parts

    class Crashing(LocalStorage):
        deletes_left: int | None = None

        def delete(self, key):
            if self.deletes_left is not None:
                if self.deletes_left == 0:
                    raise StorageError(f"killed before deleting {key}")
                self.deletes_left -= 1
            return super().delete(key)

    storage = Crashing(tmp_path / "out")
    recorded = []
    for flush in range(12):
        with ErrorWriter(storage, flush_rows=100, flush_seconds=0) as errors:
            for attempt in (1, 2):  # the same item failing twice: two rows that differ only in attempt and time
                row = {
                    "item_id": f"item-{flush % 5:04d}",
                    "manifest_row": flush,
                    "error": "RuntimeError: CUDA out of memory",
                    "stage": "sample",
                    "attempt": attempt,
                    "at": 1000.0 + flush * 10 + attempt,
                }
                errors.add(row)
                recorded.append(row)
    storage.deletes_left = deleted_before_crash
    with pytest.raises(StorageError, match="killed before deleting"):
        compact_parts(storage, ERRORS_PREFIX, target_rows=target_rows)
    doubled = read_errors_table(storage, exclude_ids=set()).to_pylist()
    assert len(doubled) == 2 * len(recorded) - 2 * deleted_before_crash  # the crash's doubles, as readers see them
    storage.deletes_left = None

    compact_parts(storage, ERRORS_PREFIX, target_rows=target_rows)

    assert read_errors_table(storage, exclude_ids=set()).to_pylist() == recorded
    assert len(storage.list(f"{ERRORS_PREFIX}/")) == 1


def test_a_replaced_part_that_sorts_before_its_merged_part_is_not_merged_again(tmp_path):
    """A merged part takes the time stamp of the first part it replaced, and that part's name may sort before it
    (`part-<stamp>-0a1b...` < `part-<stamp>-compact-...`): read in name order, that part joins the run before the
    merged part, and must leave it, not be merged again, since the merged part holds its rows."""
    from snapref_ray.storage.metadata import ERRORS_PREFIX, ERRORS_SCHEMA, compact_parts

    storage = open_storage(str(tmp_path / "out"))

    def rows(n: int, at: float) -> list[dict]:
        return [
            {"item_id": f"i{at}-{k}", "manifest_row": k, "error": "e", "stage": "sample", "attempt": 1, "at": at + k}
            for k in range(n)
        ]

    def put(name: str, table_rows: list[dict], replaces: list[str] | None = None) -> str:
        table = pa.Table.from_pylist(table_rows, schema=ERRORS_SCHEMA)
        if replaces is not None:
            table = table.replace_schema_metadata({b"snapref.replaces": json.dumps(replaces).encode()})
        buf = io.BytesIO()
        pq.write_table(table, buf)
        key = f"{ERRORS_PREFIX}/{name}.parquet"
        storage.put_bytes(key, buf.getvalue())
        return key

    first = put("part-20260101T000000000000Z-00aa", rows(3, 0.0))  # before the merged part that replaced it
    replaced = [first] + [put(f"part-20260101T00000{k}000000Z-{k}bbb", rows(3, 10.0 * k)) for k in range(1, 8)]
    # The interrupted compaction's merged part: all 24 rows, large (not merged again at target_rows=40).
    merged = put(
        "part-20260101T000000000000Z-compact-ffff",
        [r for k in range(8) for r in rows(3, 10.0 * k)],
        replaces=replaced,
    )
    put("part-20251231T000000000000Z-9ccc", rows(2, -10.0))  # an earlier small part, before them all
    expected = sorted(map(str, rows(2, -10.0) + [r for k in range(8) for r in rows(3, 10.0 * k)]))

    compact_parts(storage, ERRORS_PREFIX, target_rows=40, min_parts=2)

    assert sorted(map(str, read_errors_table(storage, exclude_ids=set()).to_pylist())) == expected
    assert merged in storage.list(f"{ERRORS_PREFIX}/") and not set(replaced) & set(storage.list(f"{ERRORS_PREFIX}/"))


def test_an_errors_compaction_drops_exact_copies_and_keeps_every_failure(tmp_path):
    """Parts whose rows another part holds too (left by a compaction interrupted before this version, whose merged
    part does not name what it replaced): merging them keeps one of each row, and every distinct failure."""
    from snapref_ray.storage.metadata import ERRORS_PREFIX, compact_parts

    storage = open_storage(str(tmp_path / "out"))
    rows = [
        {"item_id": "a", "manifest_row": 1, "error": "e", "stage": "sample", "attempt": 1, "at": 1.0},
        {"item_id": "a", "manifest_row": 1, "error": "e", "stage": "sample", "attempt": 2, "at": 2.0},
        {"item_id": None, "manifest_row": 7, "error": "bad row", "stage": "validate", "attempt": 1, "at": 3.0},
        {"item_id": "b", "manifest_row": 2, "error": "e", "stage": "sample", "attempt": 1, "at": 3.0},
    ]
    for _ in range(3):  # the same part three times over
        with ErrorWriter(storage, flush_rows=100, flush_seconds=0) as errors:
            for row in rows:
                errors.add(row)
    assert compact_parts(storage, ERRORS_PREFIX, min_parts=2)
    assert read_errors_table(storage, exclude_ids=set()).to_pylist() == rows


def test_compacted_part_is_written_in_row_groups(tmp_path):
    from snapref_ray.storage.metadata import compact_parts

    storage = open_storage(str(tmp_path / "out"))
    with MetadataWriter(storage, flush_rows=5, flush_seconds=0) as writer:
        for i in range(50):
            writer.add(make_row(i))
    before = read_metadata_table(storage).to_pylist()
    (key,) = compact_parts(storage, target_rows=1000, min_parts=2, row_group_rows=16)
    f = pq.ParquetFile(storage.uri_for(key))
    assert [f.metadata.row_group(g).num_rows for g in range(f.num_row_groups)] == [16, 16, 16, 2]
    assert read_metadata_table(storage).to_pylist() == before
