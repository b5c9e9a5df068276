"""The output layout, and the Parquet tables that describe it.

Under the output root::

    images/{item_id}.{png|webp|jpg}     the renders (see image_files)
    thumbs/{item_id}.jpg                256 px previews
    references/{reference_hash}.jpg     each reference, <= 512 px, for the gallery
    metadata/part-*.parquet             one row per image (METADATA_SCHEMA)
    errors/part-*.parquet               one row per failure (ERRORS_SCHEMA)
    summary.json                        counts, throughput, config hash (written at the end)
    job.json                            the job fingerprint (ledger)

A metadata row is the commit of its item: the caller adds it only after the image (and thumbnail)
are stored, so every listed image exists. A part is written in one atomic PUT under a unique name, so
a crash loses at most the rows not yet flushed (those items are rendered again on resume, to the same
keys). Readers de-duplicate by item_id, keeping the first committed row of the item's latest content
(`winning_rows`: a retried item keeps its first row, an explicit id re-rendered with new content its new one).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .backends import Storage, bounded_by
from .id_claims import ClaimedIds
from .row_check import RowCheck

log = logging.getLogger(__name__)

METADATA_PREFIX = "metadata"
ERRORS_PREFIX = "errors"
SUMMARY_KEY = "summary.json"
ERROR_STAGES = ("validate", "encode", "sample", "write")
# Rows per row group of a compacted part: a page of the report decodes one row group, not the whole part, and
# compaction holds one row group's rows decoded while it writes (the rest of its run stays compressed).
COMPACT_ROW_GROUP_ROWS = 8_192


def image_key(item_id: str, ext: str = "png") -> str:
    """Where an item's image goes (deterministic: a retried item rewrites the same key)."""
    return f"images/{item_id}.{ext}"


def thumb_key(item_id: str) -> str:
    """Where an item's thumbnail goes."""
    return f"thumbs/{item_id}.jpg"


def reference_image_key(reference_hash: str) -> str:
    """Where the gallery copy of a reference goes."""
    return f"references/{reference_hash}.jpg"


METADATA_SCHEMA = pa.schema(
    [
        ("item_id", pa.string()),
        # The id the item has without an explicit id (a hash of reference, prompt, seed, settings): equal to item_id
        # unless the manifest row gave one; a resume compares it (storage/item_contents.py). Null in older parts.
        ("content_id", pa.string()),
        ("manifest_row", pa.int64()),
        ("reference_uris", pa.list_(pa.string())),
        ("reference_hash", pa.string()),
        ("reference_image_key", pa.string()),
        ("prompt", pa.string()),
        ("negative_prompt", pa.string()),
        ("seed", pa.int64()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("steps", pa.int32()),
        ("cfg", pa.float32()),
        ("sampler", pa.string()),
        ("scheduler", pa.string()),
        ("mode", pa.string()),
        ("ref_weight", pa.float32()),
        ("ref_guidance", pa.float32()),
        ("ref_in_uncond", pa.bool_()),
        ("correction", pa.string()),
        ("ref_start", pa.float32()),
        ("ref_end", pa.float32()),
        ("ref_caption", pa.string()),
        ("settings_json", pa.string()),
        ("image_key", pa.string()),
        ("image_uri", pa.string()),
        ("thumb_key", pa.string()),
        ("image_format", pa.string()),
        ("adapter", pa.string()),
        ("model", pa.string()),
        ("worker_id", pa.string()),
        ("node_id", pa.string()),
        ("encode_s", pa.float32()),
        ("sample_s", pa.float32()),
        ("decode_s", pa.float32()),
        ("upload_s", pa.float32()),
        ("forward_batch", pa.int32()),  # images in the forward that rendered this one (the batch the worker chose)
        # DiT forwards the step cache let this image skip; null when the step cache was off.
        ("skipped_forwards", pa.int32()),
        ("attempt", pa.int32()),
        ("started_at", pa.float64()),
        ("finished_at", pa.float64()),
        # The fingerprint of the job that rendered the row (job.json): an output appended to holds several jobs,
        # whose manifest_row values overlap. Null in Ray Data's rows and in parts written before the column existed.
        ("job", pa.string()),
        # A judged job's columns (docs/judging.md), null when the job does not judge. Each render is a row:
        # `render_of` is the item it renders (its manifest item id), `render_index` 0 for the item's first render.
        ("render_of", pa.string()),
        ("render_index", pa.int32()),
        # The judges' scores (render_service/judges/scores.py JUDGEMENT_COLUMNS), null for a check not asked for.
        ("score_sanity_nonfinite", pa.float64()),
        ("score_sanity_std", pa.float64()),
        ("score_sanity_luminance", pa.float64()),
        ("score_sanity_clipped", pa.float64()),
        ("score_near_duplicate", pa.int32()),  # Hamming bits to the nearest image kept for the reference before it
        ("score_identity_gap", pa.float64()),
        ("score_embedding", pa.float64()),
        ("phash", pa.string()),  # 16 hex digits
        ("accepted", pa.bool_()),  # kept: at most one accepted row per render_of
        ("rejected_by", pa.string()),  # the checks it failed, comma-separated ("quota": its reference was full)
    ]
)

# The judged job's columns of METADATA_SCHEMA (null in a job that does not judge; Ray Data adds its own).
JUDGE_METADATA_COLUMNS = tuple(METADATA_SCHEMA.names[METADATA_SCHEMA.names.index("render_of") :])

# The metadata columns that are RenderSettings fields, in schema order.
SETTINGS_IN_METADATA = tuple(
    name
    for name in METADATA_SCHEMA.names
    if name
    in {
        "negative_prompt",
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
    }
)

ERRORS_SCHEMA = pa.schema(
    [
        pa.field("item_id", pa.string(), nullable=True),  # null where the row was too broken to get an id
        pa.field("manifest_row", pa.int64(), nullable=True),
        ("error", pa.string()),
        ("stage", pa.string()),  # one of ERROR_STAGES
        ("attempt", pa.int32()),
        ("at", pa.float64()),
    ]
)

IMAGE_COLUMN = "image"
IMAGE_TYPE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])

# Hugging Face `datasets` dtype names of the plain Arrow types used here; list columns are left out
# of the features entry (datasets infers them from Arrow, and their feature spelling differs by version).
_HF_DTYPES = {
    pa.string(): "string",
    pa.int64(): "int64",
    pa.int32(): "int32",
    pa.float32(): "float32",
    pa.float64(): "float64",
    pa.bool_(): "bool",
    pa.binary(): "binary",
}


def with_image_column(schema: pa.Schema) -> pa.Schema:
    """`schema` plus the ``image`` struct<bytes, path> column and the ``huggingface`` features entry
    that makes ``datasets.load_dataset("parquet", ...)`` decode it to PIL images."""
    schema = schema.append(pa.field(IMAGE_COLUMN, IMAGE_TYPE))
    features = {f.name: {"dtype": _HF_DTYPES[f.type], "_type": "Value"} for f in schema if f.type in _HF_DTYPES}
    features[IMAGE_COLUMN] = {"_type": "Image"}
    meta = dict(schema.metadata or {})
    meta[b"huggingface"] = json.dumps({"info": {"features": features}}).encode()
    return schema.with_metadata(meta)


def part_key(prefix: str, suffix: str | None = None, *, at: datetime | None = None) -> str:
    """A new part's key under `prefix`: ``part-<UTC time>-<suffix or uuid>.parquet``.

    UTC time first: names sort in commit order (what "keep the first committed row" relies on); the
    suffix (a uuid unless the caller's name is unique, like a shard's) keeps concurrent writers apart.
    `at` (default now) names the moment of the commit when it was decided before the part is written: two
    writers finishing the same commit then write the same key.
    """
    stamp = (at or datetime.now(UTC)).astimezone(UTC).strftime("%Y%m%dT%H%M%S%fZ")
    return f"{prefix}/part-{stamp}-{suffix or uuid.uuid4().hex}.parquet"


_part_key = part_key


class _PartWriter:
    """Buffer rows; write them as a Parquet part every `flush_rows` rows, every `flush_seconds`, and on close.

    Thread-safe: a background uploader calls add() while a timer flushes. A failed write keeps its
    rows buffered (and re-raises), so the next flush retries them. `guard`, when given, is called before
    each part is written and raises to refuse the commit (lease.OutputLease.check: a driver that lost the
    output to another one must not commit to it).
    """

    def __init__(
        self,
        storage: Storage,
        *,
        prefix: str,
        schema: pa.Schema,
        flush_rows: int,
        flush_seconds: float,
        guard: Callable[[], None] | None = None,
    ):
        if flush_rows < 1:
            raise ValueError(f"flush_rows must be >= 1, got {flush_rows}")
        self.storage = storage
        self.prefix = prefix.strip("/")
        self.schema = schema
        self.flush_rows = flush_rows
        self.flush_seconds = flush_seconds
        self.guard = guard
        self.parts_written: list[str] = []
        self.rows_written = 0
        self._names = frozenset(schema.names)
        self._required = self._names - frozenset(JUDGE_METADATA_COLUMNS)  # what every row names
        self._row_check = RowCheck(schema)  # what add() checks each row's values with (storage/row_check.py)
        self._rows: list[dict] = []  # the rows added, each checked against the schema
        self._lock = threading.Lock()  # guards _rows
        self._flush_lock = threading.Lock()  # one part upload at a time, so parts keep row order
        self._closed = False
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_row(self, row: dict) -> None:
        # A judged job's columns may be left out (null): a row of a job that does not judge need not name them.
        missing, unknown = self._required - row.keys(), row.keys() - self._names
        if missing or unknown:
            raise ValueError(
                f"{self.prefix} row {row.get('item_id')!r}: missing columns {sorted(missing)}, unknown "
                f"columns {sorted(unknown)}"
            )

    def _append(self, row: dict) -> bool:
        """Buffer `row`; True when the buffer is full and should be flushed."""
        # Checked here, one row at a time, so that a bad value fails in add() with its item id (and not, later, the
        # whole part inside a flush); the part is converted again, all rows at once, when it is written.
        try:
            self._row_check.check(row)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as e:
            raise ValueError(f"{self.prefix} row {row.get('item_id')!r} does not fit the schema: {e}") from e
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{type(self).__name__} for {self.storage.uri_for(self.prefix)} is closed")
            self._rows.append(row)
            full = len(self._rows) >= self.flush_rows
            if self._timer is None and self.flush_seconds > 0:
                self._timer = threading.Thread(target=self._tick, name=f"{self.prefix}-flush", daemon=True)
                self._timer.start()
        return full

    def _tick(self) -> None:
        while not self._stop.wait(self.flush_seconds):
            try:
                self.flush()
            except Exception as e:  # the rows stay buffered; the owner's next flush (or close) raises it for good
                log.warning("periodic flush of %s failed (%s); will retry", self.storage.uri_for(self.prefix), e)

    def flush(self) -> None:
        """Write the buffered rows as one part now (nothing if the buffer is empty)."""
        with self._flush_lock:
            with self._lock:
                rows, self._rows = self._rows, []
            if not rows:
                return
            buf = io.BytesIO()
            pq.write_table(pa.Table.from_pylist(rows, schema=self.schema), buf, compression="zstd")
            key = _part_key(self.prefix)
            try:
                # The guard (the output's lease) says how long this commit may take to land.
                left = self.guard() if self.guard is not None else None
                with bounded_by(left) if isinstance(left, (int, float)) else contextlib.nullcontext():
                    self.storage.put_bytes(key, buf.getvalue(), content_type="application/vnd.apache.parquet")
            except Exception:
                with self._lock:
                    self._rows[:0] = rows
                raise
            self.parts_written.append(key)
            self.rows_written += len(rows)

    @property
    def pending(self) -> int:
        """Rows added but not yet in a written part."""
        with self._lock:
            return len(self._rows)

    def close(self) -> None:
        """Flush what is buffered and stop the timer. Idempotent."""
        with self._lock:
            self._closed = True
        self._stop.set()
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.join()
        self.flush()


class MetadataWriter(_PartWriter):
    """Commits metadata rows (METADATA_SCHEMA) to ``metadata/part-*.parquet``.

    Call `add` only after the row's image (and thumbnail) are stored: a row in a written part is what
    marks the item done, for resume and for readers. A row whose item_id this writer already took is
    ignored (returns False), so a retried item is committed once per run; across runs, resume skips
    committed ids (ledger.committed_item_ids).

    With ``embed_images=True`` each row also carries the image bytes in an ``image`` column
    (struct<bytes, path>, Hugging Face features metadata), so ``datasets.load_dataset("parquet", ...)``
    yields PIL images; parts then hold flush_rows images in memory, so lower flush_rows for large images.
    """

    def __init__(
        self,
        storage: Storage,
        *,
        prefix: str = METADATA_PREFIX,
        schema: pa.Schema = METADATA_SCHEMA,
        flush_rows: int = 256,
        flush_seconds: float = 30.0,
        embed_images: bool = False,
        guard: Callable[[], None] | None = None,
    ):
        self.embed_images = embed_images
        super().__init__(
            storage,
            prefix=prefix,
            schema=with_image_column(schema) if embed_images else schema,
            flush_rows=flush_rows,
            flush_seconds=flush_seconds,
            guard=guard,
        )
        # The ids this writer took: the last few as a set, the rest 16 bytes each (a run of millions of rows).
        self._recent: set[str] = set()
        self._taken = ClaimedIds()

    def _took(self, item_id: str) -> bool:
        return item_id in self._recent or self._taken.owner(item_id) is not None

    def add(self, row: dict, image_bytes: bytes | None = None) -> bool:
        """Queue one committed image's row; False if this writer already has a row for its item_id."""
        row = dict(row)
        if self.embed_images:
            if image_bytes is None:
                raise ValueError(
                    f"metadata row {row.get('item_id')!r}: embed_images is on but no image bytes were given"
                )
            row[IMAGE_COLUMN] = {"bytes": image_bytes, "path": str(row.get("image_key", "")).rsplit("/", 1)[-1]}
        self._check_row(row)
        with self._lock:
            if self._took(row["item_id"]):
                return False
            self._recent.add(row["item_id"])
        try:
            full = self._append(row)
        except Exception:
            with self._lock:
                self._recent.discard(row["item_id"])
            raise
        with self._lock:
            if len(self._recent) >= 4_096:
                recent = list(self._recent)
                self._taken.claim(recent, [0] * len(recent))
                self._recent.clear()
        if full:
            self.flush()  # a failure here leaves the row buffered (accepted); it raises to say storage is failing
        return True


class ErrorWriter(_PartWriter):
    """Records failures (ERRORS_SCHEMA) in ``errors/part-*.parquet``; same buffering as MetadataWriter."""

    def __init__(
        self,
        storage: Storage,
        *,
        prefix: str = ERRORS_PREFIX,
        schema: pa.Schema = ERRORS_SCHEMA,
        flush_rows: int = 256,
        flush_seconds: float = 30.0,
        guard: Callable[[], object] | None = None,
    ):
        super().__init__(
            storage, prefix=prefix, schema=schema, flush_rows=flush_rows, flush_seconds=flush_seconds, guard=guard
        )

    def add(self, row: dict) -> None:
        """Queue one error row (all ERRORS_SCHEMA columns)."""
        if row.get("stage") not in ERROR_STAGES:
            raise ValueError(
                f"error row {row.get('item_id')!r}: stage must be one of {ERROR_STAGES}, got {row.get('stage')!r}"
            )
        self._check_row(row)
        if self._append(dict(row)):
            self.flush()

    def record(
        self,
        error: str | BaseException,
        stage: str,
        *,
        item_id: str | None = None,
        manifest_row: int | None = None,
        attempt: int = 1,
    ) -> None:
        """Shorthand for add(): an exception is recorded as ``TypeName: message``."""
        if isinstance(error, BaseException):
            error = f"{type(error).__name__}: {error}"
        self.add(
            {
                "item_id": item_id,
                "manifest_row": manifest_row,
                "error": error,
                "stage": stage,
                "attempt": attempt,
                "at": time.time(),
            }
        )


# ----------------------------------------------------------------------------------------------
# Reading


def _read_parts(storage: Storage, prefix: str, columns: list[str] | None = None) -> list[pa.Table]:
    keys = [k for k in storage.list(prefix + "/") if k.endswith(".parquet")]

    def read(key: str) -> pa.Table:
        return pq.read_table(io.BytesIO(storage.get_bytes(key)), columns=columns)

    # Parts are small and many on S3: fetch them in parallel, keep them in name (= commit) order.
    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(read, keys))


def iter_part_columns(
    storage: Storage, columns: list[str], prefix: str = METADATA_PREFIX, *, parallel: int = 8
) -> Iterator[pa.Table]:
    """`columns` of each part under `prefix`, part by part in commit order; a column a part lacks is null.

    At most `parallel` parts are fetched (in parallel) and held at a time, so a caller that reduces each
    part as it comes (the committed set) never holds the whole column twice."""
    keys = [k for k in storage.list(prefix + "/") if k.endswith(".parquet")]

    def read(key: str) -> pa.Table:
        f = pq.ParquetFile(io.BytesIO(storage.get_bytes(key)))
        present = [c for c in columns if c in f.schema_arrow.names]
        table = f.read(columns=present)
        for c in columns:
            if c not in present:
                table = table.append_column(c, pa.nulls(table.num_rows, pa.string()))
        return table.select(columns)

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        for start in range(0, len(keys), parallel):
            yield from pool.map(read, keys[start : start + parallel])


def read_table_columns(storage: Storage, columns: list[str], prefix: str = METADATA_PREFIX) -> pa.Table:
    """`columns` of every part under `prefix`, duplicates included; a column a part lacks (an older part,
    a part of the other output format) is null in its rows."""
    tables = [t for t in iter_part_columns(storage, columns, prefix) if t.num_rows]
    if not tables:
        return pa.table({c: pa.array([], pa.string()) for c in columns})
    return pa.concat_tables(tables, promote_options="permissive")


def _concat(tables: Iterable[pa.Table], empty: pa.Schema) -> pa.Table:
    tables = [t for t in tables if t.num_rows]
    if not tables:
        return empty.empty_table()
    # Parts with and without the image column (an appended job) line up, the missing one as nulls.
    return pa.concat_tables(tables, promote_options="default")


def winning_rows(
    item_ids: pa.Array | pa.ChunkedArray, content_ids: pa.Array | pa.ChunkedArray | None = None
) -> np.ndarray | None:
    """Positions (in commit order) of the row each item is read from; None when every item_id is unique.

    The rule every reader follows: an item's row is the first committed row *of its latest content*, the content id
    of its last committed row. A retried item committed twice (the same content) keeps its first row, as before
    content ids existed; an explicit id re-rendered with new content (`output.rerender_changed`) is read from its
    new row. Rows without a content id (older parts) count as one content of their own."""
    n = len(item_ids)
    if not n or pc.count_distinct(item_ids, mode="all").as_py() == n:
        return None
    positions = pa.array(np.arange(n, dtype=np.int64))
    table = pa.table({"item_id": item_ids, "_pos": positions})
    if content_ids is not None and content_ids.null_count < len(content_ids):
        content = pc.fill_null(content_ids, "")
        last = table.group_by("item_id", use_threads=False).aggregate([("_pos", "max")])
        latest = pa.table({"item_id": last.column("item_id"), "_latest": content.take(last.column("_pos_max"))})
        table = table.append_column("_content", content).join(latest, "item_id", use_threads=False)
        table = table.filter(pc.equal(table.column("_content"), table.column("_latest")))
    first = table.group_by("item_id", use_threads=False).aggregate([("_pos", "min")]).column("_pos_min")
    return np.sort(first.to_numpy())


def first_row_per_id(table: pa.Table) -> pa.Table:
    """One row per item_id, the one every reader keeps (`winning_rows`: the first of its latest content, or the
    first committed when `table` has no content_id column), in commit order."""
    content = table.column("content_id") if "content_id" in table.column_names else None
    keep = winning_rows(table.column("item_id"), content)
    return table if keep is None else table.take(pa.array(keep))


def read_item_ids(storage: Storage, prefix: str = METADATA_PREFIX) -> list[str]:
    """item_id of every committed row, in commit order, duplicates included (reads only that column)."""
    ids: list[str] = []
    for t in _read_parts(storage, prefix, columns=["item_id"]):
        ids.extend(t.column("item_id").to_pylist())
    return ids


def read_metadata_table(storage: Storage) -> pa.Table:
    """Every committed metadata row, de-duplicated by item_id (`winning_rows`: the first committed row of the
    item's latest content wins).

    An empty METADATA_SCHEMA table if nothing is committed.
    """
    return first_row_per_id(_concat(_read_parts(storage, METADATA_PREFIX), METADATA_SCHEMA))


def read_errors_table(
    storage: Storage, exclude_ids: Iterable[str] | pa.Array | pa.ChunkedArray | None = None
) -> pa.Table:
    """The error rows, without those whose item is in `exclude_ids`.

    By default `exclude_ids` is the set of committed item ids: an item that failed once and then
    succeeded is not an error of the job. Pass an empty set to see every recorded failure. An Arrow
    array of ids is matched in Arrow (no Python string per committed item: the report of a million items).
    """
    table = _concat(_read_parts(storage, ERRORS_PREFIX), ERRORS_SCHEMA)
    if exclude_ids is None:
        if not table.num_rows:
            return table
        exclude_ids = read_table_columns(storage, ["item_id"]).column("item_id")
    return without_items(table, exclude_ids)


def without_items(errors: pa.Table, item_ids: Iterable[str] | pa.Array | pa.ChunkedArray) -> pa.Table:
    """`errors` without the rows of the items in `item_ids` (rows with no item id are kept)."""
    if not isinstance(item_ids, (pa.Array, pa.ChunkedArray)):
        item_ids = pa.array(list(item_ids), pa.string())
    if not len(item_ids) or not errors.num_rows:
        return errors
    value_set = pa.chunked_array([item_ids] if isinstance(item_ids, pa.Array) else item_ids.chunks, item_ids.type)
    drop = pc.is_in(errors.column("item_id").cast(pa.string()), value_set=value_set.combine_chunks().cast(pa.string()))
    return errors.filter(pc.invert(pc.fill_null(drop, False)))


def compact_parts(
    storage: Storage,
    prefix: str = METADATA_PREFIX,
    *,
    target_rows: int = 50_000,
    min_parts: int = 8,
    row_group_rows: int = COMPACT_ROW_GROUP_ROWS,
) -> list[str]:
    """Merge runs of small parts under `prefix` into parts of up to `target_rows` rows; the new keys.

    A long job writes a part every `flush_rows` rows or `metadata_flush_seconds` (thousands of parts at a
    million items), and every resume and report lists and reads them all. Only the holder of the output's
    lease may call this (the driver, before rendering and at the end). Each merged part takes the time stamp of
    the first part it replaces, so part names keep commit order and "the first committed row wins" still holds;
    duplicate rows of an item inside a run are dropped. A merged part is written before the parts it
    replaces are deleted, and names them: a crash in between leaves the same rows twice (readers of metadata
    de-duplicate), and the next compaction deletes the parts it names that are still there before merging.
    Parts holding image bytes (embed_images) are left alone: they are large already, and so are parts of at least
    half of `target_rows`. A merged part is written in row groups of `row_group_rows`, so a reader that pages
    through it (the report, report/rows.py) decodes a row group at a time, not the whole part. Error parts
    (``errors/``) keep every row but exact copies: an item's several failures are its history, not duplicates,
    while a row equal in every column to another is what an interrupted compaction left twice.

    The parts are read in order, a few at a time, and each run is written as soon as it is complete: what is held
    is one run (at most `target_rows` rows) and the parts being fetched, whatever the output's size.
    """
    keys = [k for k in storage.list(prefix.strip("/") + "/") if k.endswith(".parquet")]
    if len(keys) < min_parts:
        return []
    written: list[str] = []
    replaced = 0
    run: list[_Part] = []
    run_rows = 0
    listed = set(keys)
    superseded: set[str] = set()  # parts an earlier merged part holds already (its compaction was interrupted)

    def close_run() -> None:
        nonlocal run, run_rows, replaced
        if len(run) >= 2:
            written.append(_write_merged(storage, prefix, run, row_group_rows))
            replaced += len(run)
        run, run_rows = [], 0

    def read(key: str) -> _Part:
        return _Part.read(storage, key)

    with ThreadPoolExecutor(max_workers=8) as pool:
        for start in range(0, len(keys), 8):
            batch = [k for k in keys[start : start + 8] if k not in superseded]
            leftovers: set[str] = set()
            for key, part in zip(batch, pool.map(read, batch)):
                if key in superseded:
                    continue
                named = (_replaced_parts(part.schema) & listed) - superseded - {key}
                # A merged part has the stamp of the first part it replaced, which may sort just before it (and so
                # be in the open run): the rest sort after it.
                if named:  # finish the interrupted compaction: their rows are in this part already
                    log.info("%s replaces %d part(s) still listed: deleting them", key, len(named))
                    superseded |= named
                    leftovers |= named
                    run = [p for p in run if p.key not in named]
                    run_rows = sum(p.rows for p in run)
                small = part.rows < target_rows // 2 and IMAGE_COLUMN not in part.schema.names
                if not small or run_rows + part.rows > target_rows:
                    close_run()
                if small:
                    run.append(part)
                    run_rows += part.rows
            for leftover in sorted(leftovers):  # once this batch's reads are done (they may have been among them)
                storage.delete(leftover)
    close_run()
    if written or superseded:
        after = len(keys) - len(superseded) - replaced + len(written)
        log.info("compacted %s: %d parts -> %d", storage.uri_for(prefix), len(keys), after)
    return written


# A merged part's Parquet key-value metadata: the keys of the parts it replaces (JSON), so that a compaction
# interrupted between writing it and deleting them is finished by the next one (compact_parts).
_REPLACES = b"snapref.replaces"


def _replaced_parts(schema: pa.Schema) -> set[str]:
    raw = (schema.metadata or {}).get(_REPLACES)
    return set(json.loads(raw)) if raw else set()


@dataclass(frozen=True)
class _Part:
    """A part as compaction holds it while its run fills: its bytes as stored (compressed), its row count and schema;
    decoded only when the merged part is written, one at a time."""

    key: str
    data: bytes
    rows: int
    schema: pa.Schema

    @classmethod
    def read(cls, storage: Storage, key: str) -> _Part:
        data = storage.get_bytes(key)
        f = pq.ParquetFile(io.BytesIO(data))
        return cls(key, data, f.metadata.num_rows, f.schema_arrow)

    def table(self, columns: list[str] | None = None) -> pa.Table:
        return pq.read_table(io.BytesIO(self.data), columns=columns)


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """`table` with `schema`'s columns in its order: a column an older part lacks is null."""
    columns = [
        table.column(f.name).cast(f.type) if f.name in table.column_names else pa.nulls(table.num_rows, f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(columns, schema=schema)


def _write_merged(storage: Storage, prefix: str, run: list[_Part], row_group_rows: int) -> str:
    """One part for a run of parts (written, naming them in its metadata; then the run's parts deleted); its key.

    Which rows survive is decided on the id columns alone (`winning_rows`); the parts are then decoded one at a time
    and written a row group at a time, so what is held decoded is a row group, not the run."""
    schema = pa.unify_schemas([p.schema.remove_metadata() for p in run], promote_options="default")
    schema = schema.with_metadata(
        {**(run[0].schema.metadata or {}), _REPLACES: json.dumps([p.key for p in run]).encode()}
    )
    if prefix.strip("/") == ERRORS_PREFIX:  # narrow rows: the whole run, to drop exact copies
        tables = [_without_copies(pa.concat_tables([_conform(p.table(), schema) for p in run]))]
        keep = None
    else:
        tables = (_conform(p.table(), schema) for p in run)
        ids = pa.chunked_array([p.table(["item_id"]).column("item_id") for p in run], pa.string())
        contents = (
            pa.chunked_array(
                [
                    p.table(["content_id"]).column("content_id")
                    if "content_id" in p.schema.names
                    else pa.nulls(p.rows, pa.string())
                    for p in run
                ],
                pa.string(),
            )
            if "content_id" in schema.names
            else None
        )
        keep = winning_rows(ids, contents)
    buf = io.BytesIO()
    with pq.ParquetWriter(buf, schema, compression="zstd") as writer:
        pending: list[pa.Table] = []
        held = offset = 0
        for table in tables:
            if keep is not None:
                mine = keep[(keep >= offset) & (keep < offset + table.num_rows)] - offset
                offset += table.num_rows
                table = table.take(pa.array(mine))
            pending.append(table)
            held += table.num_rows
            while held >= row_group_rows:
                merged = pa.concat_tables(pending).combine_chunks()
                writer.write_table(merged.slice(0, row_group_rows), row_group_size=row_group_rows)
                rest = merged.slice(row_group_rows)
                pending, held = [rest], rest.num_rows
        if held:
            writer.write_table(pa.concat_tables(pending).combine_chunks(), row_group_size=row_group_rows)
    stamp = run[0].key.rsplit("/", 1)[-1].split("-")[1]  # part-<stamp>-<suffix>.parquet
    key = f"{prefix.strip('/')}/part-{stamp}-compact-{uuid.uuid4().hex}.parquet"
    storage.put_bytes(key, buf.getvalue(), content_type="application/vnd.apache.parquet")
    for part in run:
        storage.delete(part.key)
    return key


def _without_copies(errors: pa.Table) -> pa.Table:
    """`errors` without the rows that repeat an earlier row in every column, in commit order.

    An item's several failures differ in their time (`at`) and attempt, so they are all kept; a row equal to
    another in every column is a copy, left by a compaction interrupted between writing its merged part and
    deleting the parts it merged (the next compaction merges the two again)."""
    columns = errors.column_names
    if not errors.num_rows:
        return errors
    keyed = errors.append_column("_pos", pa.array(np.arange(errors.num_rows, dtype=np.int64)))
    first = keyed.group_by(columns, use_threads=False).aggregate([("_pos", "min")]).column("_pos_min").to_numpy()
    return errors if len(first) == errors.num_rows else errors.take(pa.array(np.sort(first)))


def compact_output_parts(storage: Storage) -> dict[str, list[str]]:
    """`compact_parts` of both tables a job appends to, ``metadata/`` and ``errors/`` (a long job leaves many
    small parts of each); prefix -> the merged parts written. Only the holder of the output's lease may call it."""
    return {prefix: compact_parts(storage, prefix) for prefix in (METADATA_PREFIX, ERRORS_PREFIX)}


def write_summary(storage: Storage, summary: dict) -> None:
    """Write ``summary.json`` (replacing any earlier one: a resumed job rewrites it at its end)."""
    storage.put_bytes(
        SUMMARY_KEY, json.dumps(summary, indent=2, sort_keys=True).encode(), content_type="application/json"
    )


def read_summary(storage: Storage) -> dict | None:
    """The parsed ``summary.json``, or None before a job has finished once."""
    if not storage.exists(SUMMARY_KEY):
        return None
    return json.loads(storage.get_bytes(SUMMARY_KEY))
