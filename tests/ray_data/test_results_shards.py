"""Images of a `webdataset` job read back one by one: each item's image is its member's byte range of a tar
shard (located through the shard's index), read with a seek locally and a ranged GET on S3, never the whole
shard. (`read_results` over such a job runs in tests/ray_data/test_pipeline.py, on the Ray its module holds.)"""

from __future__ import annotations

import io
import uuid
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from snapref_ray.data.results import read_item_images
from snapref_ray.storage.backends import LocalStorage, StorageError, open_storage
from snapref_ray.storage.metadata import METADATA_SCHEMA, read_metadata_table
from snapref_ray.storage.shards import ShardWriter, commit_shard

N_ITEMS = 11


def pixels(i: int) -> np.ndarray:
    """Item i's image: a gradient with the item's own offset, so every pixel is checked."""
    y, x = np.mgrid[0:24, 0:32]
    return np.stack([(x * 7 + i * 13) % 256, (y * 11 + i * 29) % 256, (x + y + i * 3) % 256], -1).astype(np.uint8)


def png(i: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels(i)).save(buf, format="PNG")
    return buf.getvalue()


def write_shards(storage) -> None:
    """Two workers' shards of at most 4 items each, with a WebP among the PNGs."""
    writers = [ShardWriter(storage, name=f"worker-{w}", max_items=4) for w in range(2)]
    for i in range(N_ITEMS):
        row = dict.fromkeys(METADATA_SCHEMA.names) | {"item_id": f"item-{i:03d}", "prompt": f"prompt {i}"}
        if i == 5:
            buf = io.BytesIO()
            Image.fromarray(pixels(i)).save(buf, format="WEBP", lossless=True)
            writers[i % 2].add(row, buf.getvalue(), "webp", row["prompt"])
        else:
            writers[i % 2].add(row, png(i), "png", row["prompt"])
    for writer in writers:  # each worker stages its open shard; the driver commits what they staged
        writer.close()
        for shard in writer.drain():
            commit_shard(storage, shard.key)


class CountingStorage(LocalStorage):
    def __init__(self, root):
        super().__init__(root)
        self.whole: Counter[str] = Counter()

    def get_bytes(self, key: str) -> bytes:
        self.whole[key] += 1
        return super().get_bytes(key)


def decoded(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


@pytest.fixture(params=["local", "s3"])
def storage(request, tmp_path):
    if request.param == "local":
        return CountingStorage(tmp_path / "out")
    server = request.getfixturevalue("s3_server")
    return open_storage(f"s3://{server.bucket}/wds-results-{uuid.uuid4().hex[:8]}", server.s3_options())


def test_each_image_is_read_from_its_shard_member(storage):
    write_shards(storage)
    table = read_metadata_table(storage)
    assert table.num_rows == N_ITEMS and table.column("image_key").null_count == N_ITEMS

    images = read_item_images(storage, table)

    for item_id, data in zip(table.column("item_id").to_pylist(), images, strict=True):
        np.testing.assert_array_equal(decoded(data), pixels(int(item_id.removeprefix("item-"))), err_msg=item_id)
    if isinstance(storage, CountingStorage):  # byte ranges only: no shard was read whole
        assert not [k for k in storage.whole if k.endswith(".tar")]


def test_an_item_missing_from_its_shard_index_is_named(tmp_path):
    storage = open_storage(str(tmp_path / "out"))
    write_shards(storage)
    table = read_metadata_table(storage)
    row = table.slice(0, 1)
    wrong = row.set_column(row.column_names.index("item_id"), "item_id", pa.array(["item-999"]))
    with pytest.raises(StorageError, match=r"item 'item-999': the index of shard .* has no member"):
        read_item_images(storage, wrong)
