"""WebDataset output (``output.format: webdataset``): each worker writes its images into tar shards.

A job of millions of images as one file per image is millions of objects that S3 lists at ~1,000 keys
per request and training loaders read one GET at a time. As shards, the output is a few objects per
thousand images, in the layout the `webdataset` library and Hugging Face `datasets` read::

    shards/<shard>.tar        members <item_id>.png (or .webp/.jpg), <item_id>.json (the metadata
                              record), <item_id>.txt (the prompt); closed at max_bytes or max_items
    shards/<shard>.parquet    the shard's index: item_id, member names, byte offset and size in the tar
    metadata/part-*.parquet   the shard's rows, with `shard_key` and `shard_member`

Workers publish, the driver commits (the shape of Ray Data's Datasink). A worker closes its shard at
`max_bytes` or `max_items`, or when the driver releases it, and *stages* it: the tar, its index and its
metadata rows go under ``staging/``, where no reader looks (`ShardWriter`). It tells the driver which shards it
staged with its answers (`ClosedShard`), and only the driver, holding the output's lease, commits one
(`commit_shard`): it decides the shard's fate with one conditional create of its index, ``shards/<shard>.parquet``
(the staged index, with the verdict in its Parquet metadata), then moves the tar into ``shards/`` and the rows into
``metadata/`` — rows last, so that no metadata row ever names an image that is not in ``shards/``.

The decision is the only thing a late writer can race for, and the store lets one of them win: a driver that
settles what an earlier one left (`settle_staged_shards`, with the lease, before it reads what is committed)
creates the same key — an index of no rows, verdict "void" — for every staged shard it finds undecided, and deletes
its staged files; a
shard decided "committed" whose move was cut short is moved the rest of the way. A paused driver that wakes
up and tries to commit a shard that was voided loses the conditional create and commits nothing; a shard it
had decided is finished by whoever comes next. So ``shards/*.tar`` holds committed shards only, each
committed item is in exactly one of them, and ``metadata/`` names no image that is missing — whatever is
killed or paused when. The indexes (the decisions) are never compacted or deleted; a voided shard leaves its empty
index, and no tar.

A judged job that keeps no rejected image (`judge.keep_rejected_images: false`) has a staged shard holding a rejected
render rewritten before its decision (`filter_staged_shard`, run by a Ray task, never by the driver): the tar and
index under ``staging/`` are replaced by ones without it, so the one conditional create still decides the shard, and
whatever is killed before it leaves a shard nobody decided, voided like any other.
"""

from __future__ import annotations

import contextlib
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
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .backends import LocalStorage, Storage, StorageError
from .metadata import METADATA_PREFIX, METADATA_SCHEMA, part_key, read_table_columns

log = logging.getLogger(__name__)

SHARDS_PREFIX = "shards"
STAGING_PREFIX = "staging"  # what workers staged, waiting for the driver's commit; never read by readers
COMMITTED, VOID = "committed", "void"
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
    """A shard a writer closed: staged (its tar, index and rows under ``staging/``, for the driver to commit), or
    dropped because staging it failed (its items must render again)."""

    key: str  # where it goes once committed: ``shards/<stem>.tar``
    items: int  # rows it held: a driver waits for that many rows of it before it forgets the key
    staged: bool
    error: str = ""  # why staging failed


_TEMP_PREFIX = "snapref-shard-"


def remove_dead_workers_temporaries(directory: str | None = None) -> list[Path]:
    """Delete the temporary tars that workers killed on this machine left in the temp folder (up to a shard's size
    each); a file is a dead worker's when the pid in its name is gone. Called as a worker starts."""
    removed = []
    for path in Path(directory or tempfile.gettempdir()).glob(f"{_TEMP_PREFIX}*-*.tar"):
        pid = path.name.removeprefix(_TEMP_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _OpenShard:
    def __init__(self, storage: Storage, key: str):
        self.key = key
        if isinstance(storage, LocalStorage):
            self.path = storage.temp_path_for(staging_key(key))  # beside the target: publishing is one rename
        else:
            fd, name = tempfile.mkstemp(prefix=f"{_TEMP_PREFIX}{os.getpid()}-", suffix=".tar")
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
    """One worker's open shard: `add` items (thread-safe), `close` stages it; closed at a size or count too.

    `name` keeps shards of different workers apart (a worker id); every shard also gets a random suffix,
    so a restarted worker never reuses a name. Staging is all a worker does: the driver commits
    (`commit_shard`), and no check of the lease is needed here.
    """

    def __init__(
        self,
        storage: Storage,
        *,
        name: str,
        max_bytes: int = DEFAULT_SHARD_BYTES,
        max_items: int = DEFAULT_SHARD_ITEMS,
    ):
        if max_bytes < 1 or max_items < 1:
            raise ValueError(f"shard limits must be >= 1, got max_bytes={max_bytes}, max_items={max_items}")
        self.storage = storage
        self.name = name
        self.max_bytes = max_bytes
        self.max_items = max_items
        self.shards_staged: list[str] = []
        self._closed: list[ClosedShard] = []  # since the last `drain`
        self._open: _OpenShard | None = None
        self._seq = 0
        self._lock = threading.Lock()  # guards _open: members of one item go in together
        self._stage_lock = threading.Lock()  # shards are staged one at a time, in order

    def add(self, row: dict, image: bytes, image_ext: str, prompt: str) -> dict:
        """Put an item's image, record and prompt into the open shard; the row, with its shard columns.

        The item is committed only when the driver commits its shard, once it is staged (`close`, or the shard
        filling up)."""
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
            self._stage(full)
        return row

    def close(self) -> str | None:
        """Stage the open shard now (nothing if none is open); its key."""
        with self._lock:
            shard, self._open = self._open, None
        if shard is None:
            return None
        self._stage(shard)
        return shard.key

    @property
    def pending(self) -> int:
        """Items added to the open shard, not yet committed."""
        with self._lock:
            return len(self._open.rows) if self._open else 0

    def drain(self) -> list[ClosedShard]:
        """The shards closed (staged, or dropped by a failed staging) since the last call."""
        with self._stage_lock:
            closed, self._closed = self._closed, []
        return closed

    def _stage(self, shard: _OpenShard) -> None:
        """The tar first, the rows last: a staged rows file means the whole shard is staged."""
        with self._stage_lock:
            try:
                shard.tar.close()
                self.storage.put_file(staging_key(shard.key), shard.path)
                index = pa.Table.from_pylist(shard.index, schema=SHARD_INDEX_SCHEMA)
                self.storage.put_bytes(
                    staging_key(_index_key(shard.key)), _parquet(index), "application/vnd.apache.parquet"
                )
                rows = pa.Table.from_pylist(shard.rows, schema=SHARD_METADATA_SCHEMA)
                self.storage.put_bytes(
                    staging_key(_rows_key(shard.key)), _parquet(rows), "application/vnd.apache.parquet"
                )
            except BaseException as e:
                shard.path.unlink(missing_ok=True)
                self._closed.append(ClosedShard(shard.key, len(shard.rows), False, f"{type(e).__name__}: {e}"[:300]))
                raise
            self.shards_staged.append(shard.key)
            self._closed.append(ClosedShard(shard.key, len(shard.rows), True))
            log.info("staged shard %s (%d items)", self.storage.uri_for(staging_key(shard.key)), len(shard.rows))

    def abandon(self) -> None:
        """Drop the open shard without staging it (what a worker's death does; its items render again)."""
        with self._lock:
            shard, self._open = self._open, None
        if shard is not None:
            shard.discard()
            with self._stage_lock:
                self._closed.append(ClosedShard(shard.key, len(shard.rows), False, "abandoned"))


def _stem(shard_key: str) -> str:
    return shard_key.rsplit("/", 1)[-1].removesuffix(".tar")


def _index_key(shard_key: str) -> str:
    return shard_key.removesuffix(".tar") + ".parquet"


def _rows_key(shard_key: str) -> str:
    return shard_key.removesuffix(".tar") + ".rows.parquet"


def read_staged_rows(storage: Storage, shard_key: str) -> pa.Table:
    """The metadata rows a worker staged with its shard (`SHARD_METADATA_SCHEMA`)."""
    return pq.read_table(io.BytesIO(storage.get_bytes(staging_key(_rows_key(shard_key)))))


def replace_staged_rows(storage: Storage, shard_key: str, rows: pa.Table) -> None:
    """Rewrite a staged shard's rows before its commit is decided (a judged job's driver puts its verdicts in
    them: jobs/judge_loop.py); the tar keeps the worker's own `.json` records."""
    storage.put_bytes(
        staging_key(_rows_key(shard_key)),
        _parquet(rows.cast(SHARD_METADATA_SCHEMA)),
        "application/vnd.apache.parquet",
    )


def filter_staged_shard(storage: Storage, shard_key: str, keep: Collection[str]) -> FilteredShard:
    """Rewrite a staged shard so that its tar and index hold the items `keep` only (each one's image, ``.json`` and
    ``.txt`` members, in their order), before its commit is decided: a judged job whose rejected images are not kept
    (jobs/judged_commit.py) has this done by a Ray task, so the driver never reads a tar (up to `max_bytes`).

    The tar is replaced first, its index second, each by one atomic put under ``staging/``; the rows are the
    driver's to rewrite. A process killed in between leaves a staged shard nobody decided, which the next
    `settle_staged_shards` voids (its items render again): nothing half-filtered is ever committed. Running it again
    on its own output changes nothing (a kept item's members are all still there), so a retried task is safe."""
    staged_index = pq.read_table(io.BytesIO(storage.get_bytes(staging_key(_index_key(shard_key)))))
    by_id = {row["item_id"]: row for row in staged_index.to_pylist() if row["item_id"] in keep}
    out = _OpenShard(storage, shard_key)
    index: list[dict] = []
    members = dropped = 0
    try:
        with _readable_copy(storage, staging_key(shard_key)) as path, tarfile.open(path, "r|") as tar:
            for member in tar:  # a stream: one member in memory at a time, whatever the shard's size
                entry = by_id.get(member.name.split(".", 1)[0])
                if entry is None:
                    dropped += 1
                    continue
                data = tar.extractfile(member).read()
                offset = out.add(member.name, data, member.mtime)
                members += 1
                if member.name == entry["image_member"]:
                    index.append({**entry, "image_offset": offset, "image_size": len(data)})
        out.tar.close()
        storage.put_file(staging_key(shard_key), out.path)
    except BaseException:
        out.discard()
        raise
    storage.put_bytes(
        staging_key(_index_key(shard_key)),
        _parquet(pa.Table.from_pylist(index, schema=SHARD_INDEX_SCHEMA)),
        "application/vnd.apache.parquet",
    )
    log.info("filtered staged shard %s: %d member(s) kept, %d dropped", shard_key, members, dropped)
    return FilteredShard(items=len(index), members_kept=members, members_dropped=dropped)


@dataclass(frozen=True)
class FilteredShard:
    """What `filter_staged_shard` left in a staged shard."""

    items: int  # items whose image it holds (its index's rows)
    members_kept: int
    members_dropped: int


@contextlib.contextmanager
def _readable_copy(storage: Storage, key: str) -> Iterator[Path]:
    """A local file holding the object `key`: the file itself on a local folder, else a temporary download."""
    if isinstance(storage, LocalStorage):
        yield storage.root / key
        return
    fd, name = tempfile.mkstemp(prefix=f"{_TEMP_PREFIX}{os.getpid()}-read-", suffix=".tar")
    os.close(fd)
    try:
        download = getattr(storage, "download_file", None)
        if download is not None:
            download(key, name)  # streamed to disk (S3): nothing the size of a shard in memory
        else:
            Path(name).write_bytes(storage.get_bytes(key))
        yield Path(name)
    finally:
        Path(name).unlink(missing_ok=True)


def staging_key(key: str) -> str:
    """Where a worker stages the object that becomes `key` (``shards/x.tar`` -> ``staging/x.tar``)."""
    return f"{STAGING_PREFIX}/{key.rsplit('/', 1)[-1]}"


def _parquet(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


_DECIDE_TRIES = 20
_VERDICT_KEY = b"snapref_verdict"  # the index's Parquet key-value metadata: the shard's fate


def _decision(storage: Storage, shard_key: str, verdict: str, by: str) -> bytes:
    """The index that decides a shard: its staged index (committed), or an index of no rows (void)."""
    if verdict == COMMITTED:
        index = pq.read_table(io.BytesIO(storage.get_bytes(staging_key(_index_key(shard_key)))))
    else:
        index = SHARD_INDEX_SCHEMA.empty_table()
    meta = {
        _VERDICT_KEY: verdict.encode(),
        b"snapref_decided_by": by.encode(),
        b"snapref_decided_at": b"%f" % time.time(),
    }
    return _parquet(index.replace_schema_metadata(meta))


def decide(storage: Storage, shard_key: str, verdict: str, *, by: str = "") -> str:
    """The shard's fate: `verdict` if this call decides it, else the verdict already recorded. The decision is the
    shard's index, ``shards/<shard>.parquet``, made with a conditional create: the staged index for "committed", an
    index of no rows for "void". Of a committer and a sweeper racing, the store lets exactly one win; and since the
    index is an object the shard has anyway, deciding costs no object of its own."""
    key = _index_key(shard_key)
    for attempt in range(_DECIDE_TRIES):
        try:
            body = _decision(storage, shard_key, verdict, by)
        except StorageError:
            if verdict == COMMITTED and (decided := recorded_verdict(storage, shard_key)) is not None:
                return decided  # its staged index was moved already: decided before
            raise
        if storage.put_if_absent(key, body):
            return verdict
        decided = recorded_verdict(storage, shard_key)
        if decided is not None:
            return decided
        time.sleep(min(0.05 * 2**attempt, 2.0))  # AWS answers 409 while another create is in progress: look again
    raise StorageError(f"could not read or create {storage.uri_for(key)} after {_DECIDE_TRIES} tries")


def recorded_verdict(storage: Storage, shard_key: str) -> str | None:
    """The recorded fate of a shard (None: not decided yet)."""
    key = _index_key(shard_key)
    try:
        data = storage.get_bytes(key)
    except StorageError:
        return None
    try:
        meta = pq.read_schema(io.BytesIO(data)).metadata or {}
    except (pa.ArrowInvalid, OSError) as e:
        raise StorageError(f"{storage.uri_for(key)} is not a shard index: {e}") from e
    # An index without a verdict was written by a version that committed shards from the worker: committed.
    return meta.get(_VERDICT_KEY, COMMITTED.encode()).decode()


verdict = recorded_verdict


def _decided_at(storage: Storage, shard_key: str) -> datetime | None:
    """When the shard was decided (its index's metadata); None for an index written before that was recorded."""
    meta = pq.read_schema(io.BytesIO(storage.get_bytes(_index_key(shard_key)))).metadata or {}
    stamp = meta.get(b"snapref_decided_at")
    return datetime.fromtimestamp(float(stamp), UTC) if stamp else None


def commit_shard(storage: Storage, shard_key: str, *, by: str = "") -> bool:
    """Commit a staged shard (the driver, holding the output's lease): decide it, then move its tar and index into
    ``shards/`` and its rows into ``metadata/``. False (and its staged files deleted) when it had been voided by a
    driver that took the output over: its items must render again.

    Once decided committed it stays committed: a move that fails here is finished by `settle_staged_shards` (at the
    end of the run, or by the next one). A decision whose answer was lost is read back (or voided, if it never
    landed), so the caller never renders again the items of a shard that is committed."""
    try:
        decided = decide(storage, shard_key, COMMITTED, by=by)
    except StorageError as e:
        log.warning("could not decide shard %s (%s); reading back what the store holds", shard_key, e)
        decided = decide(storage, shard_key, VOID, by=by)  # our create landed: this reads COMMITTED back
    if decided != COMMITTED:
        _drop_staged(storage, shard_key)
        return False
    try:
        _move_into_place(storage, shard_key)
    except StorageError as e:
        log.warning("shard %s is committed; moving it into place failed (%s): the job's end finishes it", shard_key, e)
        return True
    log.info("committed shard %s", storage.uri_for(shard_key))
    return True


def _move_into_place(storage: Storage, shard_key: str) -> None:
    """Finish a committed shard's move, from wherever it was cut short: the tar (copied, then its staged file
    deleted), the staged index (the decision holds its copy), the rows last. A staged rows file means its rows are
    not in metadata/ yet."""
    staged = staging_key(shard_key)
    if storage.exists(staged):
        storage.copy(staged, shard_key)
        storage.delete(staged)
    elif not storage.exists(shard_key):
        raise StorageError(f"shard {storage.uri_for(shard_key)} was committed but its tar is nowhere")
    storage.delete(staging_key(_index_key(shard_key)))
    staged_rows = staging_key(_rows_key(shard_key))
    if storage.exists(staged_rows):
        # Named by the decision's time, not this call's: a paused committer and the driver settling after it may
        # both find the staged rows and copy them, and then they write one part, not the rows twice.
        at = _decided_at(storage, shard_key)
        storage.copy(staged_rows, part_key(METADATA_PREFIX, suffix=_stem(shard_key), at=at))
        storage.delete(staged_rows)


def _drop_staged(storage: Storage, shard_key: str) -> None:
    for final in (shard_key, _index_key(shard_key), _rows_key(shard_key)):
        storage.delete(staging_key(final))


def void_staged_shard(storage: Storage, shard_key: str, *, by: str = "") -> bool:
    """Decide a staged shard void and drop its staged files (its items render again): what a committer does with a
    shard it cannot commit as it should (a judged shard whose filtering failed). False when the shard had been
    decided committed already: it stays committed."""
    if decide(storage, shard_key, VOID, by=by) != VOID:
        return False
    _drop_staged(storage, shard_key)
    return True


@dataclass
class StagedSettled:
    """What `settle_staged_shards` did: shards whose commit it finished, shards it voided."""

    committed: list[str]
    voided: list[str]


def settle_staged_shards(storage: Storage, *, by: str = "") -> StagedSettled:
    """Decide every staged shard nobody decided (void: its items render again) and finish the moves of those
    decided committed. Only the lease holder calls it, when no worker of its own has a shard staged but not
    reported: before it reads what the output holds, and once its workers are gone. Staged files that land later
    (a paused driver's worker) are settled by the next call; readers never see them."""
    stems: dict[str, str] = {}
    for key in storage.list(STAGING_PREFIX + "/"):
        name = key.rsplit("/", 1)[-1]
        stem = name.removesuffix(".tar").removesuffix(".parquet").removesuffix(".rows")
        stems.setdefault(stem, f"{SHARDS_PREFIX}/{stem}.tar")
    settled = StagedSettled([], [])
    for shard_key in stems.values():
        if decide(storage, shard_key, VOID, by=by) == COMMITTED:
            _move_into_place(storage, shard_key)
            settled.committed.append(shard_key)
        else:
            log.warning("voided staged shard %s: it was never committed (its items render again)", shard_key)
            _drop_staged(storage, shard_key)
            settled.voided.append(shard_key)
    abandon = getattr(storage, "abandon_partial_writes", None)
    if abandon is not None:  # a killed worker's temporary tar (local) or multipart upload (S3)
        abandon(STAGING_PREFIX + "/")
    return settled


def committed_shards(storage: Storage) -> list[str]:
    """The shard keys the metadata table names (the committed shards), sorted."""
    table = read_table_columns(storage, ["shard_key"])
    if "shard_key" not in table.column_names:
        return []
    return sorted({k for k in table.column("shard_key").to_pylist() if k})


__all__ = [
    "COMMITTED",
    "STAGING_PREFIX",
    "VOID",
    "ClosedShard",
    "DEFAULT_SHARD_BYTES",
    "DEFAULT_SHARD_ITEMS",
    "FilteredShard",
    "SHARDS_PREFIX",
    "SHARD_INDEX_SCHEMA",
    "SHARD_METADATA_SCHEMA",
    "ShardWriter",
    "commit_shard",
    "committed_shards",
    "decide",
    "filter_staged_shard",
    "recorded_verdict",
    "remove_dead_workers_temporaries",
    "settle_staged_shards",
    "read_staged_rows",
    "replace_staged_rows",
    "staging_key",
    "verdict",
    "void_staged_shard",
    "shard_member_key",
    "wants_thumbnail",
]
