"""The report reads a job's metadata a page at a time (report/rows.py): over many parts, with duplicates, rows
without a number and compacted parts in row groups, its pages are those of the whole table read at once, and
each part's bytes are fetched at most twice (its narrow columns, then its page columns)."""

from __future__ import annotations

import io
import math
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq

from snapref_ray.report.gallery import write_gallery
from snapref_ray.report.rows import JobRows
from snapref_ray.storage.backends import LocalStorage, open_storage
from snapref_ray.storage.metadata import METADATA_SCHEMA, MetadataWriter, compact_parts
from tests.report.test_gallery import Dom, metadata_row

N_REFS, PER_REF = 6, 9


class CountingStorage(LocalStorage):
    """A local folder that counts the GETs of each key."""

    def __init__(self, root):
        super().__init__(root)
        self.gets: Counter[str] = Counter()

    def get_bytes(self, key: str) -> bytes:
        self.gets[key] += 1
        return super().get_bytes(key)


def write_parts(storage, *, unnumbered: bool = True) -> None:
    """Two workers committing parts of 4 rows, each taking every other reference (their parts interleave in
    commit order), then a third writer committing item 7 again (the first commit must win); with `unnumbered`,
    an item with no manifest row (it sorts last in its reference, out of commit order)."""
    rows = [metadata_row(ref * PER_REF + k, ref, PER_REF) for ref in range(N_REFS) for k in range(PER_REF)]
    if unnumbered:
        rows.append(metadata_row(999, 2, PER_REF) | {"manifest_row": None})
    writers = [MetadataWriter(storage, flush_rows=4, flush_seconds=0) for _ in range(2)]
    for row in rows:
        ref = int(row["reference_hash"][:2], 16)
        writers[ref % 2].add(row | {"worker_id": f"worker-{ref % 2}"})
    for writer in writers:
        writer.close()
    with MetadataWriter(storage, flush_rows=4, flush_seconds=0) as late:
        late.add(rows[7] | {"worker_id": "late-duplicate", "prompt": "the later commit"})


def oracle_table(storage) -> pa.Table:
    """Every part read whole with pyarrow, the first row of each id kept, sorted in gallery order: references
    by their first manifest row, then rows by number (none last), then id."""
    keys = sorted(k for k in storage.list("metadata/") if k.endswith(".parquet"))
    rows, seen = [], set()
    for key in keys:
        for row in pq.read_table(io.BytesIO(LocalStorage.get_bytes(storage, key))).to_pylist():
            if row["item_id"] not in seen:
                seen.add(row["item_id"])
                rows.append(row)

    def number(r):
        return math.inf if r["manifest_row"] is None else r["manifest_row"]

    first = {}
    for r in rows:
        first[r["reference_hash"]] = min(first.get(r["reference_hash"], math.inf), number(r))
    rows.sort(key=lambda r: (first[r["reference_hash"]], r["reference_hash"], number(r), r["item_id"]))
    return pa.Table.from_pylist(rows, schema=METADATA_SCHEMA)


def pages(storage, source, page_size: int) -> list[str]:
    keys = write_gallery(storage, source, page_size=page_size, errors=None, summary={}, plot_keys={})
    return [storage.get_bytes(k).decode() for k in keys]


def test_pages_over_many_parts_equal_the_pages_of_the_whole_table(tmp_path):
    storage = open_storage(str(tmp_path / "parts"))
    write_parts(storage)
    assert len(storage.list("metadata/")) > 10
    whole = oracle_table(storage)

    # A cache of 5 parts of 4 rows, and of one row (every page re-reads its parts): the same pages.
    paged = pages(storage, JobRows.from_storage(storage, cache_rows=20), page_size=7)
    reference = pages(open_storage(str(tmp_path / "whole")), whole, page_size=7)
    assert paged == reference
    assert pages(storage, JobRows.from_storage(storage, cache_rows=1), page_size=7) == reference

    scenes = [f for html in paged for f in Dom(html).find("figure", "scene")]
    assert [f["data-item-id"] for f in scenes] == whole.column("item_id").to_pylist()  # each once, in order
    first_commit = next(f for f in scenes if f["data-item-id"] == "item-00007")
    assert "worker worker-0" in first_commit["title"]  # not the late duplicate


def test_each_part_is_fetched_once_for_its_keys_and_once_for_its_pages(tmp_path):
    storage = CountingStorage(tmp_path / "parts")
    write_parts(storage, unnumbered=False)  # committed in gallery order, as a job commits (by reference)
    n_parts = len(storage.list("metadata/"))
    storage.gets.clear()
    pages(storage, JobRows.from_storage(storage, cache_rows=20), page_size=7)
    parts = {k: n for k, n in storage.gets.items() if k.startswith("metadata/")}
    assert len(parts) == n_parts and max(parts.values()) <= 2


def test_compacted_parts_are_paged_by_row_group(tmp_path):
    storage = open_storage(str(tmp_path / "out"))
    write_parts(storage)
    whole = oracle_table(storage)
    compact_parts(storage, target_rows=10_000, min_parts=2, row_group_rows=8)
    assert len(storage.list("metadata/")) == 1

    rows = JobRows.from_storage(storage, cache_rows=16)
    paged = pages(storage, rows, page_size=7)

    assert paged == pages(open_storage(str(tmp_path / "whole")), whole, page_size=7)
    # One part of 55 rows decoded in row groups of 8, each about once: never the whole part at once.
    assert rows.unit_reads <= 2 * math.ceil(whole.num_rows / 8)
