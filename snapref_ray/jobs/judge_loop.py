"""A judged job's driver side: the verdicts that need the job's state, the kept sets, quotas and the next round.

The workers score every render (render_service/judges/); what only the driver can decide is decided here, in the
order renders are committed (docs/judging.md, "In a batch job"):

- near_duplicate: the render's pHash against the images already kept for its reference (`kept`: 8 bytes a kept
  image, per reference). Decided at commit, never at return: two renders of one reference that come back in one
  batch are checked one after the other, and a render whose webdataset shard is voided never enters a kept set;
- the quota: once `kept_per_reference` images of a reference are kept, a render that still comes in is rejected
  ("quota") and the reference's queued items are skipped (the scheduler's `skip_reference` seam);
- the loop: a rejected item renders again (render_service/work_items.py `rerender_of`: a new seed from the item's
  recorded sequence) until one render is kept or `max_renders_per_item` were made. While the schedule runs, a
  rejected render's next render joins it as soon as the verdict is committed (`next_render`, handed to the
  scheduler's `add`): its reference's RefKV is still open while the re-renders run, and the rounds are one run.
  What cannot join the running schedule (the re-renders an earlier run left, whose item's first seed this driver
  never saw) is spilled to a local file (`RerenderQueue`) and rendered in a run of its own after it.

`resume` rebuilds all of it from the committed rows (render_of, render_index, accepted, phash, reference_hash, and
the render times for the cost figures), vectorised: what a killed driver had decided and committed is where the
next one starts.
"""

from __future__ import annotations

import logging
from array import array
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from snapref_ray.job_spec import JudgeSection
from snapref_ray.render_service.judges.near_duplicate import nearest_distance, parse_phash
from snapref_ray.render_service.work_items import WorkItem, rerender_of
from snapref_ray.storage.backends import Storage
from snapref_ray.storage.metadata import first_row_per_id, read_table_columns

log = logging.getLogger(__name__)

QUOTA = "quota"  # the `rejected_by` entry of a render that came in after its reference's quota was met

# The committed rows' columns a resume reads (and nothing else).
RESUME_COLUMNS = [
    "item_id",
    "render_of",
    "render_index",
    "accepted",
    "phash",
    "reference_hash",
    "sample_s",
    "decode_s",
    "forward_batch",
]


@dataclass(frozen=True)
class Decision:
    """The driver's verdict on one committed render (the row's final `accepted`, `score_near_duplicate`,
    `rejected_by`)."""

    row_id: str
    render_of: str
    render_index: int
    reference_hash: str
    phash: int | None
    accepted: bool
    score_near_duplicate: int | None
    rejected_by: tuple[str, ...]
    gpu_seconds: float


@dataclass
class JudgeFigures:
    """What judging did, over every run on the output (summary.json `judge`, the report's header)."""

    renders: int = 0
    kept: int = 0
    rejected: int = 0
    rejected_by: Counter[str] = field(default_factory=Counter)  # per check (a render may fail several)
    items_without_kept_image: int = 0  # items whose every allowed render was rejected (this run)
    # Items not rendered (again) because their reference's quota was met: the job's, as the output holds them
    # (jobs/quota_skips.py, skipped.parquet), counted once however many runs skipped them.
    items_skipped_by_quota: int = 0
    gpu_seconds: float = 0.0  # (sample_s + decode_s) / forward_batch, summed over renders
    items_first_rendered: int = 0  # items whose first render (render_index 0) this run committed (not in as_dict)
    references_at_quota: int = 0

    def as_dict(self, max_renders_per_item: int, kept_per_reference: int | None) -> dict:
        kept = self.kept
        return {
            "renders": self.renders,
            "kept": kept,
            "rejected": self.rejected,
            "rejected_by": dict(sorted(self.rejected_by.items())),
            "items_without_kept_image": self.items_without_kept_image,
            "items_skipped_by_quota": self.items_skipped_by_quota,
            "references_at_quota": self.references_at_quota,
            "max_renders_per_item": max_renders_per_item,
            "kept_per_reference": kept_per_reference,
            "renders_per_kept_image": round(self.renders / kept, 4) if kept else None,
            "gpu_seconds": round(self.gpu_seconds, 3),
            "gpu_seconds_per_kept_image": round(self.gpu_seconds / kept, 4) if kept else None,
        }


class RerenderQueue:
    """The next round's re-renders, (render_of, render_index), spilled to an Arrow file a batch at a time."""

    SCHEMA = pa.schema([("render_of", pa.string()), ("render_index", pa.int32())])
    BATCH = 4_096

    def __init__(self, folder: Path) -> None:
        self.path = folder / "rerender.arrow"
        self._writer: pa.ipc.RecordBatchStreamWriter | None = None
        self._ids: list[str] = []
        self._indices: list[int] = []
        self.count = 0

    def add(self, render_of: str, render_index: int) -> None:
        self._ids.append(render_of)
        self._indices.append(render_index)
        self.count += 1
        if len(self._ids) >= self.BATCH:
            self._flush()

    def _flush(self) -> None:
        if not self._ids:
            return
        if self._writer is None:
            self._writer = pa.ipc.new_stream(str(self.path), self.SCHEMA)
        self._writer.write_table(pa.table([self._ids, self._indices], schema=self.SCHEMA))
        self._ids, self._indices = [], []

    def take(self) -> pa.Table:
        """Everything queued since the last `take` (the next round), and an empty queue."""
        self._flush()
        if self._writer is None:
            return self.SCHEMA.empty_table()
        self._writer.close()
        self._writer = None
        with pa.OSFile(str(self.path)) as source:
            table = pa.ipc.open_stream(source).read_all()
        self.path.unlink(missing_ok=True)
        self.count = 0
        return table


class JudgeLoop:
    """The driver's judging state for one run; see the module docstring."""

    def __init__(self, section: JudgeSection, folder: Path) -> None:
        self.section = section
        self.max_distance = section.near_duplicate.max_distance if section.near_duplicate is not None else None
        self.kept: dict[str, array] = {}  # reference hash -> pHashes of its kept images ('Q': 8 bytes each)
        self.kept_count: Counter[str] = Counter()  # reference hash -> images kept (with or without a pHash)
        self.figures = JudgeFigures()
        self.queue = RerenderQueue(folder)
        # Renders whose verdict asked for a next render, until that render's item passes `next_render`:
        # row id -> (the plan item's id, the next render's index).
        self._wanted: dict[str, tuple[str, int]] = {}
        # The first seed of the plan items whose re-render is in the running schedule, by that re-render's id: a
        # render k's seed is a hash of it (render_service/work_items.py `render_seed`), not its successor's base.
        self._first_seed: dict[str, int] = {}

    # -- resume -----------------------------------------------------------------------------------------------
    def resume(self, storage: Storage) -> None:
        """The kept sets, quotas, figures and pending re-renders of what earlier runs committed."""
        table = read_table_columns(storage, RESUME_COLUMNS)
        table = table.filter(pc.is_valid(table.column("render_of"))) if table.num_rows else table
        if not table.num_rows:
            return
        table = first_row_per_id(table)
        accepted = pc.fill_null(table.column("accepted").cast(pa.bool_()), False)
        kept = table.filter(accepted).select(["reference_hash", "phash"])
        for ref, ph in zip(kept.column("reference_hash").to_pylist(), kept.column("phash").to_pylist()):
            self.kept_count[ref] += 1
            if ph is not None:
                self.kept.setdefault(ref, array("Q")).append(parse_phash(ph))
        f = self.figures
        f.renders, f.kept = table.num_rows, kept.num_rows
        f.rejected = f.renders - f.kept
        f.gpu_seconds = float(pc.sum(_gpu_seconds(table)).as_py() or 0.0)
        # Per item: its last render and whether one was kept; an item with none kept and renders left goes on.
        per_item = (
            table.append_column("kept", accepted)
            .group_by("render_of", use_threads=False)
            .aggregate([("render_index", "max"), ("kept", "any"), ("reference_hash", "first")])
        )
        last = per_item.column("render_index_max").to_numpy(zero_copy_only=False)
        open_ = ~per_item.column("kept_any").to_numpy(zero_copy_only=False) & (
            last + 1 < self.section.max_renders_per_item
        )
        items = per_item.column("render_of")
        refs = per_item.column("reference_hash_first")
        for i in np.flatnonzero(open_).tolist():
            if not self.at_quota(refs[i].as_py()):
                self.queue.add(items[i].as_py(), int(last[i]) + 1)
        log.info(
            "judged output: %d renders committed, %d kept over %d reference(s); %d item(s) to render again",
            f.renders,
            f.kept,
            len(self.kept_count),
            self.queue.count,
        )

    # -- verdicts ---------------------------------------------------------------------------------------------
    def at_quota(self, reference_hash: str) -> bool:
        """Whether the reference has its `kept_per_reference` images (its queued items are skipped)."""
        quota = self.section.kept_per_reference
        return quota is not None and self.kept_count[reference_hash] >= quota

    def decide(self, rows: Iterable[dict]) -> list[Decision]:
        """The verdicts on `rows` (committed in this order), without changing the kept sets: `apply` them once
        their commit is certain (a webdataset shard may still be voided)."""
        extra: dict[str, list[int]] = {}  # kept by an earlier row of `rows`
        extra_count: Counter[str] = Counter()
        decisions = []
        quota = self.section.kept_per_reference
        for row in rows:
            ref = row["reference_hash"]
            failed = [c for c in (row.get("rejected_by") or "").split(",") if c and c not in ("near_duplicate", QUOTA)]
            value = parse_phash(row["phash"]) if row.get("phash") else None
            distance = None
            if self.max_distance is not None and value is not None:
                distance = min(
                    nearest_distance(value, self.kept.get(ref, ())), nearest_distance(value, extra.get(ref, ()))
                )
                if distance <= self.max_distance:
                    failed.append("near_duplicate")
            if not failed and quota is not None and self.kept_count[ref] + extra_count[ref] >= quota:
                failed.append(QUOTA)
            accepted = not failed
            if accepted:
                extra_count[ref] += 1
                if value is not None:
                    extra.setdefault(ref, []).append(value)
            decisions.append(
                Decision(
                    row["item_id"],
                    row.get("render_of") or row["item_id"],
                    int(row.get("render_index") or 0),
                    ref,
                    value,
                    accepted,
                    distance,
                    tuple(failed),
                    _row_gpu_seconds(row),
                )
            )
        return decisions

    def apply(self, decisions: Iterable[Decision]) -> None:
        """Count committed verdicts: kept sets and quotas grow, rejects are queued for the next round (or counted
        as done with: no renders left, or the reference's quota met)."""
        f = self.figures
        for d in decisions:
            f.renders += 1
            f.items_first_rendered += d.render_index == 0
            f.gpu_seconds += d.gpu_seconds
            if d.accepted:
                f.kept += 1
                self.kept_count[d.reference_hash] += 1
                if d.phash is not None:
                    self.kept.setdefault(d.reference_hash, array("Q")).append(d.phash)
                continue
            f.rejected += 1
            f.rejected_by.update(d.rejected_by)
            if self.at_quota(d.reference_hash):
                continue  # skipped by the quota: counted from the output at the end (finish_figures)
            if d.render_index + 1 >= self.section.max_renders_per_item:
                f.items_without_kept_image += 1
            else:
                self._wanted[d.row_id] = (d.render_of, d.render_index + 1)

    def next_render(self, item: WorkItem) -> WorkItem | None:
        """The next render of `item`, a render whose verdict was just committed, when that verdict asked for one
        (None otherwise, or when it went to the `queue` instead: an earlier run's re-render, whose item's first
        seed is not known here)."""
        wanted = self._wanted.pop(item.item_id, None)
        first_seed = item.seed if item.render_index == 0 else self._first_seed.pop(item.item_id, None)
        if wanted is None:
            return None
        render_of, render_index = wanted
        if first_seed is None:
            self.queue.add(render_of, render_index)
            return None
        first = replace(item, item_id=render_of, seed=first_seed, render_of=None, render_index=0)
        render = rerender_of(first, render_index)
        self._first_seed[render.item_id] = first_seed
        return render

    def spill_wanted(self) -> None:
        """The run ended: next renders whose item never came past `next_render` go to the `queue`."""
        for render_of, render_index in self._wanted.values():
            self.queue.add(render_of, render_index)
        self._wanted.clear()
        self._first_seed.clear()

    def finish_figures(self, skipped_by_quota: int | None) -> dict:
        """summary.json's `judge` block; `skipped_by_quota`: the job's items skipped by the quota (skipped.parquet;
        None: not counted, an interrupted run: what this run's schedule skipped stays)."""
        self.figures.references_at_quota = sum(1 for ref in self.kept_count if self.at_quota(ref))
        if skipped_by_quota is not None:
            self.figures.items_skipped_by_quota = skipped_by_quota
        return self.figures.as_dict(self.section.max_renders_per_item, self.section.kept_per_reference)


def decided_row(row: dict, decision: Decision) -> dict:
    """`row` with the driver's verdict in its judge columns, set in place (the driver owns a returned row; a copy of
    its ~50 columns per render was a measurable part of the judged driver's cost)."""
    row["accepted"] = decision.accepted
    row["score_near_duplicate"] = decision.score_near_duplicate
    row["rejected_by"] = ",".join(decision.rejected_by) or None
    return row


def _row_gpu_seconds(row: dict) -> float:
    """A render's share of its forward's device time: the batch's sample and decode seconds over its images."""
    batch = max(1, int(row.get("forward_batch") or 1))
    return (float(row.get("sample_s") or 0.0) + float(row.get("decode_s") or 0.0)) / batch


def _gpu_seconds(table: pa.Table) -> pa.Array:
    seconds = pc.add(
        pc.fill_null(table.column("sample_s").cast(pa.float64()), 0.0),
        pc.fill_null(table.column("decode_s").cast(pa.float64()), 0.0),
    )
    batch = pc.max_element_wise(pc.fill_null(table.column("forward_batch").cast(pa.float64()), 1.0), 1.0)
    return pc.divide(seconds, batch)


__all__ = ["QUOTA", "Decision", "JudgeFigures", "JudgeLoop", "RerenderQueue", "decided_row"]
