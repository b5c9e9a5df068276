"""A judged job's items skipped by the quota: which, and why, in ``skipped.parquet`` (docs/judging.md, "Quotas").

With `judge.kept_per_reference`, once a reference has that many kept images its other items are not rendered (or
not rendered again): nothing failed, so they are not in errors/. They are a state of the output, not an event of a
run: an item is *skipped by the quota* when its reference holds its quota of kept images, none of the item's own
renders is kept, and its loop did not end otherwise — it has no render at all, or renders left, or its last render
was rejected only because the reference was full (`rejected_by` "quota"). An item whose every allowed render failed a
check is not skipped: it is one of `items_without_kept_image`.

Each run recomputes the set from the job's plan and the committed rows and replaces ``skipped.parquet`` whole, so a
resume keeps an item skipped and counts it once. Vectorised: the committed rows are read as a resume reads them, the
plan's items a run file at a time.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from snapref_ray.storage.backends import Storage, StorageError
from snapref_ray.storage.metadata import first_row_per_id, read_table_columns

SKIPPED_KEY = "skipped.parquet"
QUOTA_REASON = "quota"

SKIPPED_SCHEMA = pa.schema(
    [
        ("item_id", pa.string()),  # the manifest item (its render 0's item_id; `render_of` of its rows)
        ("manifest_row", pa.int64()),
        ("reference_hash", pa.string()),
        ("renders", pa.int32()),  # its renders in the output (0: never rendered), none of them kept
        ("reason", pa.string()),  # "quota"
        ("detail", pa.string()),  # e.g. "reference 1a2b3c4d5e6f has its 20 kept images"
    ]
)

_RENDER_COLUMNS = ["item_id", "render_of", "render_index", "accepted", "rejected_by", "reference_hash"]


@dataclass(frozen=True)
class QuotaSkips:
    """What `find_quota_skips` found: the skipped items (`SKIPPED_SCHEMA`)."""

    table: pa.Table

    @property
    def not_rendered(self) -> int:
        """Skipped items with no render at all: not in the output, and not failed."""
        return int(pc.sum(pc.equal(self.table.column("renders"), 0)).as_py() or 0)


def find_quota_skips(
    storage: Storage,
    plan_items: Callable[[], Iterable[pa.Table]],
    *,
    kept_per_reference: int | None,
    max_renders_per_item: int,
) -> QuotaSkips:
    """The job's items skipped by the quota (see the module docstring; none without a quota). `plan_items()` yields
    the plan's items, a run file at a time, with columns `item_id`, `manifest_row` and `group` (its reference's
    index in the plan): `plan_item_tables`. It is read twice: the at-quota references' groups, then their items."""
    per_item = _renders_per_item(storage)
    full = _references_at_quota(per_item, kept_per_reference) if kept_per_reference else pa.array([], pa.string())
    # An at-quota reference's group is the group of one of its kept items: a plan item, if the reference is this
    # job's (another job's reference in an appended output has no item here).
    kept = per_item.filter(pc.and_(per_item.column("kept"), pc.is_in(per_item.column("reference_hash"), full)))
    group_hash: dict[int, str] = {}
    for items in plan_items() if kept.num_rows else ():
        at = pc.index_in(items.column("item_id"), value_set=kept.column("render_of"))
        found = at.is_valid()
        refs = kept.column("reference_hash").take(at.filter(found)).to_pylist()
        group_hash.update(zip(items.column("group").filter(found).to_pylist(), refs))
    tables = []
    if group_hash:
        for items in plan_items():
            wanted = pa.array(list(group_hash), items.column("group").type)
            candidates = items.filter(pc.is_in(items.column("group"), value_set=wanted))
            if candidates.num_rows:
                tables.append(_skipped(candidates, group_hash, per_item, kept_per_reference, max_renders_per_item))
    table = pa.concat_tables(tables) if tables else SKIPPED_SCHEMA.empty_table()
    return QuotaSkips(table)


def plan_item_tables(run_paths: Iterable[Path]) -> Iterator[pa.Table]:
    """The plan's items (jobs/spilled_items.py's run files: `SpilledItems.runs`), one run file at a time."""
    for path in run_paths:
        # Mapped: only the three columns' pages are read (a run file also holds every item's prompt).
        with pa.memory_map(str(path)) as source:
            yield pa.ipc.open_file(source).read_all().select(["item_id", "manifest_row", "group"])


def write_skipped(storage: Storage, skips: QuotaSkips) -> None:
    """Replace ``skipped.parquet`` with the skipped items (the lease holder, before summary.json)."""
    buf = io.BytesIO()
    pq.write_table(skips.table, buf, compression="zstd")
    storage.put_bytes(SKIPPED_KEY, buf.getvalue(), "application/vnd.apache.parquet")


def read_skipped(storage: Storage) -> pa.Table:
    """``skipped.parquet`` as the last run wrote it (empty when the job skipped nothing or has no quota)."""
    try:
        return pq.read_table(io.BytesIO(storage.get_bytes(SKIPPED_KEY)))
    except StorageError:
        return SKIPPED_SCHEMA.empty_table()


def _renders_per_item(storage: Storage) -> pa.Table:
    """Per item with a committed render: render_of, renders, kept (any), its reference, its last render's index and
    rejected_by."""
    table = read_table_columns(storage, _RENDER_COLUMNS)
    empty = pa.table(
        {
            "render_of": pa.array([], pa.string()),
            "renders": pa.array([], pa.int64()),
            "kept": pa.array([], pa.bool_()),
            "reference_hash": pa.array([], pa.string()),
            "last_index": pa.array([], pa.int64()),
            "last_rejected_by": pa.array([], pa.string()),
        }
    )
    if not table.num_rows or "render_of" not in table.column_names:
        return empty
    table = table.filter(pc.is_valid(table.column("render_of")))
    if not table.num_rows:
        return empty
    # One row per item_id (the first committed, as every reader keeps), then each item's renders in order.
    table = first_row_per_id(table)
    table = table.sort_by([("render_of", "ascending"), ("render_index", "ascending")])
    table = table.set_column(
        table.schema.get_field_index("accepted"),
        "accepted",
        pc.fill_null(table.column("accepted").cast(pa.bool_()), False),
    )
    grouped = table.group_by("render_of", use_threads=False).aggregate(
        [
            ("item_id", "count"),
            ("accepted", "any"),
            ("reference_hash", "first"),
            ("render_index", "last"),
            ("rejected_by", "last"),
        ]
    )
    return pa.table(
        {
            "render_of": grouped.column("render_of"),
            "renders": grouped.column("item_id_count").cast(pa.int64()),
            "kept": grouped.column("accepted_any"),
            "reference_hash": grouped.column("reference_hash_first"),
            "last_index": grouped.column("render_index_last").cast(pa.int64()),
            "last_rejected_by": grouped.column("rejected_by_last").cast(pa.string()),
        }
    )


def _references_at_quota(per_item: pa.Table, quota: int) -> pa.Array:
    kept = per_item.filter(per_item.column("kept"))
    if not kept.num_rows:
        return pa.array([], pa.string())
    counts = kept.group_by("reference_hash", use_threads=False).aggregate([("render_of", "count")])
    return counts.filter(pc.greater_equal(counts.column("render_of_count"), quota)).column("reference_hash")


def _skipped(
    candidates: pa.Table, group_hash: dict[int, str], per_item: pa.Table, quota: int, max_renders: int
) -> pa.Table:
    """Of a run file's items of at-quota references, those the quota stopped (see the module docstring)."""
    at = pc.index_in(candidates.column("item_id"), value_set=per_item.column("render_of"))
    has = at.is_valid().to_numpy(zero_copy_only=False)
    n = candidates.num_rows
    renders = np.zeros(n, np.int64)
    kept = np.zeros(n, bool)
    renders_left = np.ones(n, bool)
    quota_rejected = np.zeros(n, bool)
    if has.any():
        rows = per_item.take(at.filter(at.is_valid()))
        renders[has] = rows.column("renders").to_numpy(zero_copy_only=False)
        kept[has] = rows.column("kept").to_numpy(zero_copy_only=False)
        renders_left[has] = rows.column("last_index").to_numpy(zero_copy_only=False) + 1 < max_renders
        last = pc.fill_null(rows.column("last_rejected_by"), "").to_pylist()
        quota_rejected[has] = [QUOTA_REASON in r.split(",") for r in last]
    skipped = ~kept & (renders_left | quota_rejected)
    chosen = candidates.filter(pa.array(skipped))
    refs = [group_hash[g] for g in chosen.column("group").to_pylist()]
    return pa.table(
        {
            "item_id": chosen.column("item_id").cast(pa.string()),
            "manifest_row": chosen.column("manifest_row").cast(pa.int64()),
            "reference_hash": pa.array(refs, pa.string()),
            "renders": pa.array(renders[skipped], pa.int32()),
            "reason": pa.array([QUOTA_REASON] * len(refs), pa.string()),
            "detail": pa.array([f"reference {r[:12]} has its {quota} kept images" for r in refs], pa.string()),
        },
        schema=SKIPPED_SCHEMA,
    )


__all__ = [
    "QUOTA_REASON",
    "SKIPPED_KEY",
    "SKIPPED_SCHEMA",
    "QuotaSkips",
    "find_quota_skips",
    "plan_item_tables",
    "read_skipped",
    "write_skipped",
]
