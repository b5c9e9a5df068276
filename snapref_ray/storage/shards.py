"""WebDataset output (``output.format: webdataset``): each worker writes its images into tar shards.

A job of millions of images as one file per image is millions of objects that S3 lists at ~1,000 keys
per request and training loaders read one GET at a time. As shards, the output is a few objects per
thousand images, in the layout the `webdataset` library and Hugging Face `datasets` read::

    shards/<shard>.tar        members <item_id>.png (or .webp/.jpg), <item_id>.json (the metadata
                              record), <item_id>.txt (the prompt); closed at max_bytes or max_items
    shards/<shard>.parquet    the shard's index: item_id, member names, byte offset and size in the tar
    metadata/part-*.parquet   one part per shard, the rows with `shard_key` and `shard_member`

A worker closes its shard at `max_bytes` or `max_items`, and commits the open one when the driver releases
it (cluster/pool.py `release`: no work left for it, or the job ended). It tells the driver which shards it
closed (`ShardWriter.drain`) with each answer: the driver counts an item done only once its shard is committed,
and renders the items of a shard that never will be (its worker died with it open) again in the same run
(cluster/shard_ledger.py).

Exactly once, as for single files: a shard is written to a temporary file and published whole (a rename
on a local folder, a multipart upload on S3), then its index, then its metadata part, which is the commit
(resume skips the ids in metadata/). A worker that dies with a shard open leaves nothing visible: the
temporary file is never published and its items are not in metadata/, so the next run renders them
again. A tar published without its metadata part (a death between the two writes) is an orphan;
`remove_orphan_shards`, called by the next driver while it holds the output's lease, deletes it before
anything is rendered again, so a reader never sees an item twice.
"""

from __future__ import annotations

import io
import json
import logging
import os
import tarfile
import tempfile
import threading
import time
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .backends import LocalStorage, Storage
from .metadata import METADATA_PREFIX, METADATA_SCHEMA, part_key, read_table_columns

log = logging.getLogger(__name__)

SHARDS_PREFIX = "shards"
DEFAULT_SHARD_BYTES = 1_000_000_000
DEFAULT_SHARD_ITEMS = 10_000

# The metadata rows of a sharded job: every METADATA_SCHEMA column (image_key and thumb_key null where
# there is no single file) plus where the image lives.
SHARD_METADATA_SCHEMA = METADATA_SCHEMA.append(pa.field("shard_key", pa.string())).append(
    pa.field("shard_member", pa.string())
)

SHARD_INDEX_SCHEMA = pa.schema(
    [
        ("item_id", pa.string()),
        ("shard_key", pa.string()),
        ("image_member", pa.string()),
        ("json_member", pa.string()),
        ("txt_member", pa.string()),
        ("image_offset", pa.int64()),  # byte offset of the image's data in the tar: a ranged GET reads one image
        ("image_size", pa.int64()),
    ]
)


def shard_member_key(item_id: str) -> str:
    """The WebDataset sample key of an item: its id, which must hold no '.' (readers split the key from the
    extension at the first dot) and no '/'."""
    if not item_id or "." in item_id or "/" in item_id:
        raise ValueError(
            f"item id {item_id!r} cannot be a WebDataset sample key: readers split the key from the extension "
            f"at the first '.', and '/' makes a folder; use manifest ids without '.' or '/' with output.format "
            f"webdataset"
        )
    return item_id


def wants_thumbnail(item_id: str, every: int) -> bool:
    """Whether an item is in the gallery's sample: about one in `every`, the same items whichever worker
    renders them (a hash of the id, not a counter)."""
    return every > 0 and zlib.crc32(item_id.encode()) % every == 0


@dataclass(frozen=True)
class ClosedShard:
    """A shard a writer closed: committed (published with its metadata part), or dropped because its publish
    failed (its items must render again)."""

    key: str
    items: int  # rows it held: a driver waits for that many rows of it before it forgets the key
    committed: bool
    error: str = ""  # why a publish failed


class _OpenShard:
    def __init__(self, storage: Storage, key: str):
        self.key = key
        if isinstance(storage, LocalStorage):
            self.path = storage.temp_path_for(key)  # beside the target: publishing is one rename
        else:
            fd, name = tempfile.mkstemp(prefix="snapref-shard-", suffix=".tar")
            os.close(fd)
            self.path = Path(name)
        self.tar = tarfile.open(self.path, "w")  # GNU format: long member names are fine
        self.rows: list[dict] = []
        self.index: list[dict] = []

    def add(self, name: str, data: bytes, mtime: float) -> int:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(data), int(mtime), 0o644
        self.tar.addfile(info, io.BytesIO(data))
        # Writing never needs the member list: dropping it keeps a shard of many items at constant memory.
        self.tar.members.pop()
        # The data ends the member, padded to whole 512-byte blocks (offset_data is only set when reading).
        return self.tar.offset - -(-len(data) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE

    @property
    def nbytes(self) -> int:
        return self.tar.offset

    def discard(self) -> None:
        self.tar.close()
        self.path.unlink(missing_ok=True)


class ShardWriter:
    """One worker's open shard: `add` items (thread-safe), `commit` publishes it; closed at a size or count.

    `name` keeps shards of different workers apart (a worker id); every shard also gets a random suffix,
    so a restarted worker never reuses a name. `guard` is called before each shard is published and
    raises to refuse it (the shard is then dropped and its items render again).
    """

    def __init__(
        self,
        storage: Storage,
        *,
        name: str,
        max_bytes: int = DEFAULT_SHARD_BYTES,
        max_items: int = DEFAULT_SHARD_ITEMS,
        guard: Callable[[], None] | None = None,
    ):
        if max_bytes < 1 or max_items < 1:
            raise ValueError(f"shard limits must be >= 1, got max_bytes={max_bytes}, max_items={max_items}")
        self.storage = storage
        self.name = name
        self.max_bytes = max_bytes
        self.max_items = max_items
        self.guard = guard  # called before a shard is published; raises to refuse (lease.check_holder)
        self.shards_committed: list[str] = []
        self._closed: list[ClosedShard] = []  # since the last `drain`
        self._open: _OpenShard | None = None
        self._seq = 0
        self._lock = threading.Lock()  # guards _open: members of one item go in together
        self._commit_lock = threading.Lock()  # shards are published one at a time, in order

    def add(self, row: dict, image: bytes, image_ext: str, prompt: str) -> dict:
        """Put an item's image, record and prompt into the open shard; the row, with its shard columns.

        The item is committed only when its shard is (`commit`, or the shard filling up)."""
        key = shard_member_key(row["item_id"])
        full = None
        with self._lock:
            if self._open is None:
                self._seq += 1
                self._open = _OpenShard(
                    self.storage, f"{SHARDS_PREFIX}/{self.name}-{self._seq:06d}-{uuid.uuid4().hex[:8]}.tar"
                )
            shard = self._open
            image_member = f"{key}.{image_ext}"
            row = {
                **row,
                "shard_key": shard.key,
                "shard_member": image_member,
                "image_uri": f"{self.storage.uri_for(shard.key)}#{image_member}",
            }
            now = time.time()
            offset = shard.add(image_member, image, now)
            shard.add(f"{key}.json", json.dumps(row, sort_keys=True, default=str).encode(), now)
            shard.add(f"{key}.txt", prompt.encode(), now)
            shard.rows.append(row)
            shard.index.append(
                {
                    "item_id": row["item_id"],
                    "shard_key": shard.key,
                    "image_member": image_member,
                    "json_member": f"{key}.json",
                    "txt_member": f"{key}.txt",
                    "image_offset": offset,
                    "image_size": len(image),
                }
            )
            if len(shard.rows) >= self.max_items or shard.nbytes >= self.max_bytes:
                full, self._open = shard, None
        if full is not None:
            self._publish(full)
        return row

    def commit(self) -> str | None:
        """Publish the open shard now (nothing if none is open); its key."""
        with self._lock:
            shard, self._open = self._open, None
        if shard is None:
            return None
        self._publish(shard)
        return shard.key

    @property
    def pending(self) -> int:
        """Items added to the open shard, not yet committed."""
        with self._lock:
            return len(self._open.rows) if self._open else 0

    def drain(self) -> list[ClosedShard]:
        """The shards closed (committed, or dropped by a failed publish) since the last call."""
        with self._commit_lock:
            closed, self._closed = self._closed, []
        return closed

    def _publish(self, shard: _OpenShard) -> None:
        with self._commit_lock:
            try:
                shard.tar.close()
                if self.guard is not None:
                    self.guard()
                self.storage.put_file(shard.key, shard.path)
                index = pa.Table.from_pylist(shard.index, schema=SHARD_INDEX_SCHEMA)
                self.storage.put_bytes(_index_key(shard.key), _parquet(index), "application/vnd.apache.parquet")
                rows = pa.Table.from_pylist(shard.rows, schema=SHARD_METADATA_SCHEMA)
                # The commit: the rows name the shard; resume skips them, readers list them.
                self.storage.put_bytes(
                    part_key(METADATA_PREFIX, suffix=_stem(shard.key)), _parquet(rows), "application/vnd.apache.parquet"
                )
            except BaseException as e:
                shard.path.unlink(missing_ok=True)
                self._closed.append(ClosedShard(shard.key, len(shard.rows), False, f"{type(e).__name__}: {e}"[:300]))
                raise
            self.shards_committed.append(shard.key)
            self._closed.append(ClosedShard(shard.key, len(shard.rows), True))
            log.info("committed shard %s (%d items)", self.storage.uri_for(shard.key), len(shard.rows))

    def abandon(self) -> None:
        """Drop the open shard without publishing it (what a worker's death does; its items render again)."""
        with self._lock:
            shard, self._open = self._open, None
        if shard is not None:
            shard.discard()
            with self._commit_lock:
                self._closed.append(ClosedShard(shard.key, len(shard.rows), False, "abandoned"))


def _stem(shard_key: str) -> str:
    return shard_key.rsplit("/", 1)[-1].removesuffix(".tar")


def _index_key(shard_key: str) -> str:
    return shard_key.removesuffix(".tar") + ".parquet"


def _parquet(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def committed_shards(storage: Storage) -> list[str]:
    """The shard keys the metadata table names (the committed shards), sorted."""
    table = read_table_columns(storage, ["shard_key"])
    if "shard_key" not in table.column_names:
        return []
    return sorted({k for k in table.column("shard_key").to_pylist() if k})


def shard_is_committed(storage: Storage, shard_key: str) -> bool:
    """Whether a shard's metadata part (its commit) is in the output. Lists metadata/: call it on a loss, not per
    item."""
    suffix = f"-{_stem(shard_key)}.parquet"
    return any(k.endswith(suffix) for k in storage.list(METADATA_PREFIX + "/"))


def settle_lost_shard(storage: Storage, shard_key: str) -> bool:
    """A shard whose writer is gone before it said what became of it: whether it was committed (a death between
    the publish and the answer). If not, what of it was published (a death between the tar and the metadata part)
    is deleted now, as `remove_orphan_shards` would on the next run, so that no reader of this run's output sees it.
    Call only once the writer's process is known dead, while holding the output's lease."""
    if shard_is_committed(storage, shard_key):
        return True
    for key in (_index_key(shard_key), shard_key):
        if storage.exists(key):
            log.warning("removing %s: its shard was never committed (its items render again)", storage.uri_for(key))
            storage.delete(key)
    return False


def remove_orphan_shards(storage: Storage) -> list[str]:
    """Delete published shards (and their indexes) that no metadata row names: a worker died between
    publishing the tar and committing its rows. Call only while holding the output's lease, before
    rendering; returns the keys deleted."""
    listed = [k for k in storage.list(SHARDS_PREFIX + "/") if k.endswith(".tar")]
    if not listed:
        return []
    committed = set(committed_shards(storage))
    orphans = [k for k in listed if k not in committed]
    for key in orphans:
        log.warning("removing shard %s: its items were never committed (they render again)", storage.uri_for(key))
        storage.delete(_index_key(key))
        storage.delete(key)
    return orphans


__all__ = [
    "ClosedShard",
    "DEFAULT_SHARD_BYTES",
    "DEFAULT_SHARD_ITEMS",
    "SHARDS_PREFIX",
    "SHARD_INDEX_SCHEMA",
    "SHARD_METADATA_SCHEMA",
    "ShardWriter",
    "committed_shards",
    "remove_orphan_shards",
    "settle_lost_shard",
    "shard_is_committed",
    "shard_member_key",
    "wants_thumbnail",
]
