"""`read_results(OUT)`: a job's output (finished or partial) as a Ray Dataset of metadata joined with images.

The metadata is read on the driver through the same reader the job's resume and report use
(`read_metadata_table`: every committed part, one row per item_id, the first commit winning), so
the Dataset holds every committed item exactly once, also for a job that was interrupted or
resumed. The image bytes are then fetched by Ray tasks, in parallel and close to where the rows
are processed, unless the job embedded them in its Parquet (`output.embed_images`).

An item of a `webdataset` job has no file of its own: its row names the shard (``shard_key``) and
the member (``shard_member``), and the shard's Parquet index (storage/shards.py) gives the member's
byte offset and size in the tar. Its image is read as that byte range alone (`Storage.get_range`: a
ranged GET on S3, a seek locally), never the whole shard; each index is read once per batch.
"""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from snapref_ray.job_spec import S3Spec
from snapref_ray.storage.backends import S3Options, Storage, StorageError, open_storage
from snapref_ray.storage.metadata import IMAGE_COLUMN, read_metadata_table

if TYPE_CHECKING:
    import ray.data

_FETCH_THREADS = 16  # image GETs are I/O bound: S3 latency, not CPU


def read_results(
    output: str, *, s3: S3Options | dict | None = None, images: bool = True, rows_per_block: int = 256
) -> ray.data.Dataset:
    """The committed items of the job output `output` (a folder or s3://bucket/prefix) as a Dataset.

    One row per item with every metadata column (`storage/metadata.py` METADATA_SCHEMA); with
    `images`, plus ``image``: the stored file's bytes (PNG/WebP/JPEG as the job wrote them).
    An item of a ``webdataset`` job gets its image from its shard (a byte range, `read_item_images`).
    `s3` is an `S3Options` or a mapping of `output.s3` fields (credentials from the AWS
    environment). Raises `StorageError` when the folder holds no job output (no metadata/ parts).
    """
    import ray.data

    options = s3 if isinstance(s3, S3Options) or s3 is None else S3Spec.model_validate(s3).options()
    storage = open_storage(output, options)
    if not storage.list("metadata/"):
        from snapref_ray.storage.backends import StorageError

        raise StorageError(
            f"{storage.uri_for('metadata')}/ holds no metadata parts: not a snapref-ray job output "
            "(or no item has been committed yet)"
        )
    table = read_metadata_table(storage)
    embedded = IMAGE_COLUMN in table.column_names
    if embedded:
        # The job stored struct<bytes, path> for Hugging Face; here `image` is the bytes, as SnapRefRenderer's.
        table = table.set_column(
            table.column_names.index(IMAGE_COLUMN),
            IMAGE_COLUMN,
            pa.compute.struct_field(table.column(IMAGE_COLUMN), "bytes"),
        )
        if not images:
            table = table.drop_columns([IMAGE_COLUMN])
    blocks = [table.slice(i, rows_per_block) for i in range(0, table.num_rows, rows_per_block)] or [table]
    ds = ray.data.from_arrow(blocks)
    if not images or (embedded and table.column(IMAGE_COLUMN).null_count == 0):
        return ds
    return ds.map_batches(
        _attach_images,
        batch_format="pyarrow",
        fn_kwargs={"output": output, "s3": options},
        udf_modifying_row_count=False,
    )


def _attach_images(batch: pa.Table, *, output: str, s3: S3Options | None) -> pa.Table:
    """Fill ``image`` with each row's stored image (rows that already carry embedded bytes keep them)."""
    images = read_item_images(open_storage(output, s3), batch)
    column = pa.array(images, pa.binary())
    if IMAGE_COLUMN in batch.column_names:
        return batch.set_column(batch.column_names.index(IMAGE_COLUMN), IMAGE_COLUMN, column)
    return batch.append_column(IMAGE_COLUMN, column)


def read_item_images(storage: Storage, rows: pa.Table) -> list[bytes | None]:
    """The image bytes of each metadata row of `rows`, in order, from wherever the job stored them; None for a
    judged job's rejected render whose image the job did not keep (its row names no image).

    An embedded ``image`` (bytes) is used as it is; a row with ``image_key`` reads that file; a row of a
    sharded job reads its member's byte range of ``shard_key``, located through the shard's index.
    StorageError names the item when its image is nowhere to be found.
    """
    n = rows.num_rows

    def column(name: str) -> list:
        return rows.column(name).to_pylist() if name in rows.column_names else [None] * n

    ids, keys, shards, members = column("item_id"), column("image_key"), column("shard_key"), column("shard_member")
    have, accepted = column(IMAGE_COLUMN), column("accepted")
    indexes = _ShardIndexes(storage)
    for shard in {s for s, k, h in zip(shards, keys, have, strict=True) if s and not k and h is None}:
        indexes.load(shard)  # once per shard, before the parallel reads

    def fetch(i: int) -> bytes:
        if have[i] is not None:
            return have[i]
        if keys[i]:
            return storage.get_bytes(keys[i])
        if shards[i]:
            offset, size = indexes.member(shards[i], str(ids[i]), members[i])
            return storage.get_range(shards[i], offset, size)
        if accepted[i] is False:
            return None  # a judged job's rejected render whose image was not kept (judge.keep_rejected_images)
        raise StorageError(
            f"item {ids[i]!r} in {storage.uri}: its metadata row has neither image_key nor shard_key, so its image "
            "cannot be found"
        )

    with ThreadPoolExecutor(max_workers=min(_FETCH_THREADS, max(1, n))) as pool:
        return list(pool.map(fetch, range(n)))


class _ShardIndexes:
    """item_id -> (byte offset, size) of its image member, per shard, from the shards' Parquet indexes."""

    _COLUMNS = ["item_id", "image_member", "image_offset", "image_size"]

    def __init__(self, storage: Storage):
        self.storage = storage
        self._members: dict[str, dict[str, tuple[str, int, int]]] = {}

    def load(self, shard_key: str) -> None:
        index_key = shard_key.removesuffix(".tar") + ".parquet"  # storage/shards.py: beside the tar
        table = pq.read_table(io.BytesIO(self.storage.get_bytes(index_key)), columns=self._COLUMNS)
        self._members[shard_key] = {
            r["item_id"]: (r["image_member"], r["image_offset"], r["image_size"]) for r in table.to_pylist()
        }

    def member(self, shard_key: str, item_id: str, member: str | None) -> tuple[int, int]:
        entry = self._members[shard_key].get(item_id)
        if entry is None or (member and entry[0] != member):
            raise StorageError(
                f"item {item_id!r}: the index of shard {self.storage.uri_for(shard_key)} has no member "
                f"{member or item_id!r}"
            )
        return entry[1], entry[2]
