"""`read_results(OUT)`: a job's output (finished or partial) as a Ray Dataset of metadata joined with images.

The metadata is read on the driver through the same reader the job's resume and report use
(`read_metadata_table`: every committed part, one row per item_id, the first commit winning), so
the Dataset holds every committed item exactly once, also for a job that was interrupted or
resumed. The image bytes are then fetched by Ray tasks, in parallel and close to where the rows
are processed, unless the job embedded them in its Parquet (`output.embed_images`).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import pyarrow as pa

from snapref_ray.job_spec import S3Spec
from snapref_ray.storage.backends import S3Options, open_storage
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
    """Fill ``image`` with each row's stored file (rows that already carry embedded bytes keep them)."""
    storage = open_storage(output, s3)
    keys = batch.column("image_key").to_pylist()
    have = batch.column(IMAGE_COLUMN).to_pylist() if IMAGE_COLUMN in batch.column_names else [None] * len(keys)
    with ThreadPoolExecutor(max_workers=min(_FETCH_THREADS, max(1, len(keys)))) as pool:
        data = list(pool.map(lambda kb: kb[1] if kb[1] is not None else storage.get_bytes(kb[0]), zip(keys, have)))
    column = pa.array(data, pa.binary())
    if IMAGE_COLUMN in batch.column_names:
        return batch.set_column(batch.column_names.index(IMAGE_COLUMN), IMAGE_COLUMN, column)
    return batch.append_column(IMAGE_COLUMN, column)
