"""A job's committed rows as the report reads them: a few narrow columns of every row, the rest a page at a time.

A million-item job must not become a million Python objects, nor a table of every column, to write
its gallery. So the report reads the metadata parts twice:

1. `JobRows.scan` reads only `KEY_COLUMNS` (ids, order, timings), one part at a time, and keeps them
   as Arrow and NumPy columns (tens of bytes per item): the first committed row of each item_id's latest
   content wins, as in every reader of the output (storage/metadata.py `winning_rows`); the gallery order
   (references by their first manifest row, then rows) is one Arrow sort; charts, counts and the header use
   these columns.
2. `JobRows.page` returns the `DISPLAY_COLUMNS` of the items at some positions of that order, read per
   row group of the parts that hold them through a cache of at most ``cache_rows`` rows. A job's items
   are committed roughly in gallery order (the driver hands out items by reference, in manifest order),
   so each row group is decoded about once; a job in any other order still comes out right, only slower.

An item is drawn only where a preview exists: ``thumb_key`` (or ``image_key``, which a thumbnail-less
row falls back to). A `webdataset` job writes thumbnails for a sample only (storage/shards.py
`wants_thumbnail`), so its gallery draws that sample while counts and charts cover every item.
"""

from __future__ import annotations

import io
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from snapref_ray.report.items import DISPLAY_COLUMNS
from snapref_ray.storage.backends import Storage
from snapref_ray.storage.metadata import METADATA_PREFIX, METADATA_SCHEMA, winning_rows

__all__ = ["DISPLAY_COLUMNS", "KEY_COLUMNS", "JobRows"]

#: What the first pass reads of every row: identity, order, whether a preview exists, and the charts' timings.
KEY_COLUMNS = (
    "item_id",
    "content_id",  # which of an item's rows wins (storage/metadata.py `winning_rows`)
    "manifest_row",
    "reference_hash",
    "image_key",
    "thumb_key",
    "worker_id",
    "started_at",
    "finished_at",
    "sample_s",
)
_DEFAULT_CACHE_ROWS = 50_000
_TIMINGS = ("started_at", "finished_at", "sample_s")
# Parts fetched at once in the first pass, and ahead of the page being drawn in the second (each is one GET;
# few enough that the bytes in flight stay small).
_PARALLEL_READS = 8
_PREFETCH_PARTS = 4


@dataclass(frozen=True)
class _Unit:
    """One row group of one part: what is decoded at once for a page."""

    source: int
    row_group: int


class _TableSource:
    """A table already in memory (write_gallery called with one): one unit, no I/O."""

    def __init__(self, table: pa.Table):
        self.table = table

    def row_groups(self) -> list[int]:
        return [self.table.num_rows]

    def read_keys(self) -> pa.Table:
        return _select(self.table, KEY_COLUMNS)

    def read_unit(self, row_group: int, columns: Sequence[str]) -> pa.Table:
        return _select(self.table, columns)

    def prefetch(self, pool: ThreadPoolExecutor) -> None:
        pass

    def close(self) -> None:
        pass


class _PartSource:
    """One metadata part in storage, read by columns and row groups."""

    def __init__(self, storage: Storage, key: str):
        self.storage, self.key = storage, key
        self._sizes: list[int] | None = None
        self._open: pq.ParquetFile | None = None  # kept while its row groups are read one after another
        self._pending: Future[bytes] | None = None  # its bytes, being fetched ahead of their page

    def _file(self) -> pq.ParquetFile:
        if self._open is None:
            data = self._pending.result() if self._pending is not None else self.storage.get_bytes(self.key)
            self._pending = None
            self._open = pq.ParquetFile(io.BytesIO(data))
        return self._open

    def prefetch(self, pool: ThreadPoolExecutor) -> None:
        """Start fetching the part's bytes (a GET on S3 costs its latency: overlap it with drawing pages)."""
        if self._open is None and self._pending is None:
            self._pending = pool.submit(self.storage.get_bytes, self.key)

    def close(self) -> None:
        self._open = None

    def row_groups(self) -> list[int]:
        assert self._sizes is not None, "read_keys first"
        return self._sizes

    def read_keys(self) -> pa.Table:
        f = self._file()
        self._sizes = [f.metadata.row_group(i).num_rows for i in range(f.num_row_groups)]
        keys = _read(f, KEY_COLUMNS, None)
        self.close()
        return keys

    def read_unit(self, row_group: int, columns: Sequence[str]) -> pa.Table:
        return _read(self._file(), columns, row_group)


def _read(f: pq.ParquetFile, columns: Sequence[str], row_group: int | None) -> pa.Table:
    names = set(f.schema_arrow.names)
    present = [c for c in columns if c in names]
    table = f.read(columns=present) if row_group is None else f.read_row_group(row_group, columns=present)
    return _select(table, columns)


def _select(table: pa.Table, columns: Sequence[str]) -> pa.Table:
    """`columns` of `table` in that order; one it lacks (an older part) is all null, typed as in the schema."""
    arrays = []
    for c in columns:
        if c in table.column_names:
            arrays.append(table.column(c))
        else:
            kind = METADATA_SCHEMA.field(c).type if c in METADATA_SCHEMA.names else pa.string()
            arrays.append(pa.nulls(table.num_rows, kind))
    return pa.table(arrays, names=list(columns))


class JobRows:
    """Every committed item of a job once (the narrow columns), and its drawable items in gallery order."""

    def __init__(self, sources: Sequence[_TableSource | _PartSource], *, cache_rows: int = _DEFAULT_CACHE_ROWS):
        self._sources = list(sources)
        self._cache_rows = cache_rows
        self._cache: OrderedDict[_Unit, pa.Table] = OrderedDict()
        self.unit_reads = 0  # row groups decoded for pages (a re-read after eviction counts again)
        self._last_source: int | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._cached_rows = 0
        self._scan()

    @classmethod
    def from_storage(cls, storage: Storage, *, cache_rows: int = _DEFAULT_CACHE_ROWS) -> JobRows:
        """The rows of the metadata parts under ``metadata/``, in commit (name) order."""
        keys = [k for k in storage.list(METADATA_PREFIX + "/") if k.endswith(".parquet")]
        return cls([_PartSource(storage, k) for k in keys], cache_rows=cache_rows)

    @classmethod
    def from_table(cls, table: pa.Table) -> JobRows:
        """The rows of a metadata table in memory (its row order is the commit order)."""
        return cls([_TableSource(table)])

    # ------------------------------------------------------------------------------------- pass 1

    def _scan(self) -> None:
        # Per part, only what is kept: ids as Arrow strings, references and workers dictionary-encoded (a
        # part holds a few of each), numbers and timings as float64, whether a preview exists as a bool.
        ids, contents, refs, workers, numbers, drawable, units, rows = [], [], [], [], [], [], [], []
        timings: dict[str, list[np.ndarray]] = {c: [] for c in _TIMINGS}
        self._units = []
        for i, source, part in self._read_keys():
            sizes = source.row_groups()
            first_unit = len(self._units)
            self._units += [_Unit(i, g) for g in range(len(sizes))]
            if not part.num_rows:
                continue
            units.append(np.repeat(np.arange(first_unit, first_unit + len(sizes), dtype=np.int32), sizes))
            rows.append(np.concatenate([np.arange(n, dtype=np.int32) for n in sizes]))
            ids.append(part.column("item_id").combine_chunks())
            # Only an explicit id's content id can pick another row than the first: the rest are kept as nulls.
            content = part.column("content_id").combine_chunks().cast(pa.string())
            contents.append(pc.if_else(pc.equal(content, ids[-1]), pa.scalar(None, pa.string()), content))
            refs.append(pc.dictionary_encode(part.column("reference_hash").fill_null("")).combine_chunks())
            workers.append(pc.dictionary_encode(part.column("worker_id")).combine_chunks())
            numbers.append(_floats(part.column("manifest_row")))
            drawable.append(
                pc.or_(pc.is_valid(part.column("thumb_key")), pc.is_valid(part.column("image_key"))).to_numpy()
            )
            for c in _TIMINGS:
                timings[c].append(_floats(part.column(c)))

        item_ids = pa.chunked_array(ids, pa.string())
        # positions of each id's row (the first commit of its latest content), None when all are unique
        first = winning_rows(item_ids, pa.chunked_array(contents, pa.string()))
        del contents
        take = (lambda a: a) if first is None else (lambda a: a[first])
        self._unit_of, self._row_of = take(_concat(units, np.int32)), take(_concat(rows, np.int32))
        if first is not None:
            item_ids = item_ids.take(pa.array(first))
        self.n_items = len(item_ids)

        # References as ranks of their sorted hashes: one int per row instead of a 64-character string.
        ref_codes, ref_names = _codes(refs)
        sorted_names = ref_names.sort()
        rank = take(pc.index_in(ref_names, value_set=sorted_names).to_numpy(zero_copy_only=False)[ref_codes])
        self.n_references = len(np.unique(rank))
        worker_codes, worker_names = _codes(workers)
        worker_codes = take(worker_codes)
        self.n_workers = len(np.unique(worker_codes[worker_codes >= 0]))
        row = take(_concat(numbers, np.float64))
        row[~np.isfinite(row)] = np.inf  # a row without a number sorts last, as in items.gallery_items
        first_row = np.full(len(sorted_names), np.inf)
        np.minimum.at(first_row, rank, row)

        self.keys = pa.table(
            {
                "item_id": item_ids,
                "manifest_row": row,
                "worker_id": pa.DictionaryArray.from_arrays(
                    pa.array(worker_codes, mask=worker_codes < 0), worker_names.cast(pa.string())
                ),
                **{c: take(_concat(timings[c], np.float64)) for c in _TIMINGS},
            }
        )  # every committed item once, in commit order: what the charts and the header count

        shown = np.flatnonzero(take(_concat(drawable, bool)))
        sort_keys = pa.table(
            {
                "first_row": first_row[rank[shown]],
                "rank": rank[shown],
                "row": row[shown],
                "item_id": item_ids.take(pa.array(shown)),
            }
        )
        order = pc.sort_indices(sort_keys, [(c, "ascending") for c in sort_keys.column_names]).to_numpy()
        self.order = shown[order]  # positions in self.keys, in gallery order
        self.n_shown = len(self.order)
        ranks = rank[self.order]
        # Where each reference's run of items starts in the gallery order (references are contiguous).
        self._run_starts = np.flatnonzero(np.r_[True, ranks[1:] != ranks[:-1]]) if len(ranks) else np.zeros(0, int)

        # The parts in the order pages first need them, for fetching ahead.
        source_of_unit = np.array([u.source for u in self._units], np.int64)
        needed = source_of_unit[self._unit_of[self.order]] if self.n_shown else np.zeros(0, np.int64)
        self._part_sequence = needed[np.sort(np.unique(needed, return_index=True)[1])].tolist()
        self._sequence_at = {source: at for at, source in enumerate(self._part_sequence)}

    def _read_keys(self):
        """(index, source, its KEY_COLUMNS) of every source in order, fetched `_PARALLEL_READS` at a time."""

        def read(i: int):
            return i, self._sources[i], self._sources[i].read_keys()

        with ThreadPoolExecutor(max_workers=_PARALLEL_READS) as pool:
            for start in range(0, len(self._sources), _PARALLEL_READS):
                yield from pool.map(read, range(start, min(start + _PARALLEL_READS, len(self._sources))))

    def _prefetch_after(self, source: int) -> None:
        at = self._sequence_at.get(source)
        if at is None:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=_PREFETCH_PARTS)
            weakref.finalize(self, self._pool.shutdown, wait=False)
        for ahead in self._part_sequence[at + 1 : at + 1 + _PREFETCH_PARTS]:
            if _Unit(ahead, 0) not in self._cache:  # still decoded from an earlier page: nothing to fetch
                self._sources[ahead].prefetch(self._pool)

    # ------------------------------------------------------------------------------------- queries

    def timings(self, name: str) -> np.ndarray:
        """``started_at``, ``finished_at`` or ``sample_s`` of every item, in commit order (NaN where unknown)."""
        return self.keys.column(name).to_numpy()

    def reference_run(self, position: int) -> tuple[int, int]:
        """(position of the first item, item count) of the reference of the item at `position` of the order."""
        run = int(np.searchsorted(self._run_starts, position, side="right")) - 1
        start = int(self._run_starts[run])
        end = int(self._run_starts[run + 1]) if run + 1 < len(self._run_starts) else self.n_shown
        return start, end - start

    def page(self, start: int, stop: int, columns: Sequence[str] = DISPLAY_COLUMNS) -> pa.Table:
        """`columns` of the drawable items at positions ``start:stop`` of the gallery order."""
        positions = self.order[start:stop]
        if not len(positions):
            return _select(METADATA_SCHEMA.empty_table(), columns)
        units, at = np.unique(self._unit_of[positions], return_inverse=True)
        tables = [self._unit(int(unit), columns) for unit in units]
        # One take over the page's row groups side by side (a row's index: its group's offset plus its row).
        offsets = np.cumsum([0] + [t.num_rows for t in tables[:-1]])
        return pa.concat_tables(tables).take(pa.array(offsets[at] + self._row_of[positions]))

    def _unit(self, index: int, columns: Sequence[str]) -> pa.Table:
        unit = self._units[index]
        table = self._cache.get(unit)
        if table is not None and table.column_names == list(columns):
            self._cache.move_to_end(unit)
            return table
        if self._last_source not in (None, unit.source):
            self._sources[self._last_source].close()  # at most one part's bytes held at a time
        self._last_source = unit.source
        self._prefetch_after(unit.source)
        table = self._sources[unit.source].read_unit(unit.row_group, columns)
        self.unit_reads += 1
        old = self._cache.pop(unit, None)  # a unit read again with other columns replaces its entry
        self._cached_rows += table.num_rows - (old.num_rows if old is not None else 0)
        self._cache[unit] = table
        while len(self._cache) > 1 and self._cached_rows > self._cache_rows:
            self._cached_rows -= self._cache.popitem(last=False)[1].num_rows
        return table


def _floats(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A numeric column as float64, null -> NaN."""
    return column.cast(pa.float64()).to_numpy(zero_copy_only=False).astype(np.float64, copy=False)


def _concat(arrays: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)


def _codes(chunks: list[pa.DictionaryArray]) -> tuple[np.ndarray, pa.Array]:
    """The per-part dictionary arrays as one index array over one dictionary (-1 for null) and that dictionary."""
    if not chunks:
        return np.zeros(0, np.int64), pa.array([], pa.string())
    unified = pa.chunked_array(chunks).unify_dictionaries()
    codes = np.concatenate(
        [c.indices.cast(pa.int64()).fill_null(-1).to_numpy(zero_copy_only=False) for c in unified.chunks]
    )
    return codes, unified.chunks[0].dictionary
