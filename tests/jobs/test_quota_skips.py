"""Items skipped by the quota (jobs/quota_skips.py), from committed rows written as a judged job writes them and a
plan's items a run file at a time; expected sets worked out by hand from the documented rule (docs/judging.md)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from snapref_ray.jobs.quota_skips import SKIPPED_SCHEMA, find_quota_skips, read_skipped, write_skipped
from snapref_ray.storage.backends import open_storage

A, B = "a" * 64, "b" * 64  # two references; quota 2, 3 renders an item at most


def _render(item: str, k: int, ref: str, accepted: bool, rejected_by: str | None = None) -> dict:
    return {
        "item_id": item if k == 0 else f"{item}-r{k}",
        "render_of": item,
        "render_index": k,
        "accepted": accepted,
        "rejected_by": rejected_by,
        "reference_hash": ref,
    }


ROWS = [
    _render("a0", 0, A, True),
    _render("a1", 0, A, False, "near_duplicate"),
    _render("a1", 1, A, True),  # A has its 2 kept images
    _render("a2", 0, A, False, "quota"),  # in flight when A filled: rendered, stopped by the quota
    _render("a3", 0, A, False, "near_duplicate"),
    _render("a3", 1, A, False, "sanity"),
    _render("a3", 2, A, False, "near_duplicate"),  # every allowed render rejected by a check: not skipped
    _render("a4", 0, A, False, "near_duplicate"),  # renders left, its next one skipped
    _render("b0", 0, B, True),  # B has 1 of its 2: its items are not skipped
    _render("a0", 0, A, True),  # a retried commit of a0: read once
]
# The plan: two run files (an at-quota reference's kept items in the first, more of its items in the second).
RUNS = [
    pa.table(
        {"item_id": ["a0", "a1", "a2", "b0"], "manifest_row": [0, 1, 2, 6], "group": pa.array([0, 0, 0, 1], pa.int32())}
    ),
    pa.table(
        {"item_id": ["a3", "a4", "a5", "b1"], "manifest_row": [3, 4, 5, 7], "group": pa.array([0, 0, 0, 1], pa.int32())}
    ),
]


def _output(tmp_path, rows: list[dict]):
    storage = open_storage(str(tmp_path / "out"))
    buf = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    storage.put_bytes("metadata/part-00000000T000000000000Z-x.parquet", buf.getvalue().to_pybytes())
    return storage


def test_skipped_items_are_those_the_quota_stopped_with_their_manifest_rows(tmp_path):
    storage = _output(tmp_path, ROWS)
    skips = find_quota_skips(storage, lambda: iter(RUNS), kept_per_reference=2, max_renders_per_item=3)
    got = sorted(skips.table.to_pylist(), key=lambda r: r["item_id"])
    assert [(r["item_id"], r["manifest_row"], r["renders"], r["reason"]) for r in got] == [
        ("a2", 2, 1, "quota"),
        ("a4", 4, 1, "quota"),
        ("a5", 5, 0, "quota"),
    ]
    assert {r["reference_hash"] for r in got} == {A}
    assert got[0]["detail"] == f"reference {A[:12]} has its 2 kept images"
    assert skips.not_rendered == 1  # a5: no render at all
    write_skipped(storage, skips)
    assert read_skipped(storage).to_pylist() == skips.table.to_pylist()
    # The same output read again (a resume): the same items, counted once.
    again = find_quota_skips(storage, lambda: iter(RUNS), kept_per_reference=2, max_renders_per_item=3)
    assert again.table.equals(skips.table)


def test_no_quota_or_no_reference_full_skips_nothing(tmp_path):
    storage = _output(tmp_path, ROWS)
    none = find_quota_skips(storage, lambda: iter(RUNS), kept_per_reference=None, max_renders_per_item=3)
    assert none.table.num_rows == 0
    high = find_quota_skips(storage, lambda: iter(RUNS), kept_per_reference=3, max_renders_per_item=3)
    assert high.table.num_rows == 0
    assert read_skipped(storage).schema == SKIPPED_SCHEMA and read_skipped(storage).num_rows == 0
