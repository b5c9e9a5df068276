"""A job's spilled items: the manifest validated in chunks, its items spilled to local disk, read back by reference.

The driver of a 10 M-row job cannot hold a `WorkItem` per image (about 8 KB each with its settings object). So:

1. The manifest is read `chunk_rows` rows at a time (storage/manifest.py `iter_manifest_chunks`) and each chunk is
   validated by the one `ManifestValidator` (manifest_check.py), which keeps across chunks only what must be global:
   each reference file's check, the item ids claimed (16 bytes each, for duplicates), the references in order of
   first use and the distinct settings.
2. A chunk's valid items are written as one *run*: an Arrow IPC file on local disk, sorted by reference (stably, so
   manifest order holds inside a reference), in columns: the id, the manifest row, the reference's index, the
   prompt, the seed, the settings' index, the image index. Settings and reference inputs are stored once, by index.
   A chunk's row errors go to an errors file beside the runs; the first `ERRORS_KEPT` stay in memory for messages.
3. `skip_committed` reads the runs' id columns once against the output's committed ids (storage/ledger.py
   `CommittedIds`, vectorised) and keeps a bit per item; the figures the pool needs before it starts (items and
   references to render, image sizes, the forward sizes to warm) are computed from the columns, without objects.
4. `reference_groups` merges the runs by reference index (a k-way merge: each run is read a record batch at a
   time), so each reference's items come out together, whatever order the manifest was written in (prompt-major
   included), and references come out in order of first use, as `build_work_items` orders them. Only the
   references the schedule has open are `WorkItem`s; an item leaves memory once its batch is done.

What the driver holds is then about 16 bytes per valid item (the claimed ids), a bit per item, and per reference
file its check; everything else is on disk (about 60-100 bytes per item) until the job ends (`close`).
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from snapref_ray.jobs.manifest_check import JobValidationError, ManifestSettings, ManifestValidator, RowError
from snapref_ray.jobs.plan_folder import PlanFolder
from snapref_ray.render_service.references import ReferenceInput
from snapref_ray.render_service.work_items import WorkItem, rerender_of
from snapref_ray.requests import RenderSettings
from snapref_ray.storage.item_contents import (
    CommittedContents,
    CommittedState,
    ContentCheck,
    ItemContentError,
    compare_run,
    refusal,
)
from snapref_ray.storage.ledger import CommittedIds
from snapref_ray.storage.manifest import iter_manifest_chunks

log = logging.getLogger(__name__)

CHUNK_ROWS = 50_000  # manifest rows validated (and spilled) at a time
RUN_BATCH_ROWS = 1_024  # rows per record batch of a run: the merge holds one per run (200 runs at 10 M rows)
FIRST_REFERENCES_KEPT = 2  # the identity gap's contrast references (cluster/worker.py `judge_contrasts`)
ERRORS_KEPT = 1_000  # row errors kept in memory for messages; all of them are in the errors file

_RUN_SCHEMA = pa.schema(
    [
        ("item_id", pa.string()),
        ("manifest_row", pa.int64()),
        ("group", pa.int32()),  # the reference's index in order of first use
        ("input", pa.int32()),  # the reference as the row named it (its paths), by index
        ("prompt", pa.string()),
        ("seed", pa.int64()),  # seeds are < 2**63
        ("settings", pa.int32()),
        ("image_index", pa.int32()),
        ("content_id", pa.string()),  # where item_id is an explicit id, the content id; else null (item_id is it)
    ]
)
_ERROR_SCHEMA = pa.schema(
    [
        ("manifest_row", pa.int64()),
        ("item_id", pa.string()),
        ("field", pa.string()),
        ("error", pa.string()),
    ]
)


@dataclass
class _Run:
    path: Path
    rows: int
    todo: np.ndarray | None = None  # packed bits: 1 = not committed yet (skip_committed)
    rerender: np.ndarray | None = None  # a judged job's round: per item, the render to make (-1: none)


class SpilledItems:
    """A job's validated items on local disk, with the figures the driver needs; see the module docstring."""

    def __init__(self, folder: Path, validator: ManifestValidator, manifest: str) -> None:
        self.folder, self.validator, self.manifest = folder, validator, manifest
        self._temporary: PlanFolder | None = None  # the folder, when `build` made it (locked while the job runs)
        self.runs: list[_Run] = []
        self.rows = 0  # manifest rows read
        self.items = 0  # valid items
        self.error_count = 0
        self.invalid_rows = 0  # rows with at least one error (a row's errors all come in its chunk)
        self.errors_head: list[RowError] = []
        self._inputs: dict[ReferenceInput, int] = {}
        self._input_list: list[ReferenceInput] = []
        self._hashes: list[str] = []  # reference hash by group index
        self._first_inputs: list[ReferenceInput] = []  # the first FIRST_REFERENCES_KEPT references' inputs
        self._errors_writer: pa.ipc.RecordBatchFileWriter | None = None
        self.manifest_sha256: str | None = None  # of the manifest's bytes, as they were read (storage/manifest.py)
        # Filled by skip_committed:
        self.committed = 0
        self.committed_found = 0  # the plan's items the output holds (committed, and those rendered again)
        self.rerendered = 0  # of them, explicit ids committed with other content, rendered again
        self.committed_not_in_manifest: int | None = None  # set by plan_against_output
        self.to_render = 0
        self.references_to_render = 0
        self.sizes: list[tuple[int, int]] = []  # (width, height) of the items to render
        self.largest: RenderSettings | None = None  # the settings of the largest image to render
        self._group_counts: tuple[np.ndarray, np.ndarray] = (np.array([], np.int64), np.array([], np.int64))

    @property
    def errors(self) -> list[RowError]:
        """The first `ERRORS_KEPT` row errors (`all_errors` reads every one back)."""
        return self.errors_head

    # -- building ------------------------------------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        settings: ManifestSettings,
        *,
        adapter_kind: str | None = None,
        chunk_rows: int = CHUNK_ROWS,
        progress: bool = False,
        folder: str | Path | None = None,
    ) -> SpilledItems:
        """Validate the manifest chunk by chunk and spill its items; raises `JobValidationError` in a strict job with
        any invalid row (after reading them all, so that every one is named). `folder`: where the runs go (default:
        a new temporary folder (jobs/plan_folder.py), removed by `close`)."""
        temporary = PlanFolder() if folder is None else None  # removes the folders of killed drivers first
        where = temporary.path if temporary is not None else Path(folder)
        where.mkdir(parents=True, exist_ok=True)
        plan = cls(where, ManifestValidator(settings, adapter_kind=adapter_kind), settings.manifest)
        plan._temporary = temporary
        bar = _validation_bar() if progress else None
        digest = hashlib.sha256()  # of the bytes as they are read: what this run's manifest held
        try:
            for rows in iter_manifest_chunks(settings.manifest, settings.s3, chunk_rows=chunk_rows, digest=digest):
                plan._add_chunk(rows)
                if bar is not None:
                    bar.set_postfix(invalid=plan.invalid_rows, refresh=False)  # shown by the update's refresh
                    bar.update(len(rows))
                elif plan.rows % 1_000_000 < len(rows):
                    log.info("validated %d rows (%d invalid)", plan.rows, plan.invalid_rows)
        except BaseException:
            plan.close()
            raise
        finally:
            if bar is not None:
                bar.close()
            if plan._errors_writer is not None:
                plan._errors_writer.close()
                plan._errors_writer = None
        plan.manifest_sha256 = digest.hexdigest()
        plan.validator.done()  # the claimed ids and reference checks are not needed any more (160 MB at 10 M)
        if settings.strict and plan.error_count:
            plan.close()
            raise JobValidationError(settings.manifest, plan.errors_head, count=plan.error_count)
        return plan

    def _add_chunk(self, rows: list[dict]) -> None:
        chunk = self.validator.validate(rows)
        self.rows += chunk.rows
        self.items += len(chunk.items)
        self._add_errors(chunk.errors)
        if chunk.items:
            self._write_run(chunk.items)

    def _add_errors(self, errors: list[RowError]) -> None:
        if not errors:
            return
        self.error_count += len(errors)
        self.invalid_rows += len({e.manifest_row for e in errors})
        self.errors_head.extend(errors[: max(0, ERRORS_KEPT - len(self.errors_head))])
        if self._errors_writer is None:
            self._errors_writer = pa.ipc.new_file(str(self.folder / "errors.arrow"), _ERROR_SCHEMA)
        self._errors_writer.write_table(
            pa.table(
                {
                    "manifest_row": [e.manifest_row for e in errors],
                    "item_id": [e.item_id for e in errors],
                    "field": [e.field for e in errors],
                    "error": [e.error for e in errors],
                },
                schema=_ERROR_SCHEMA,
            )
        )

    def _write_run(self, items: list[WorkItem]) -> None:
        groups = np.fromiter(
            (self._group(i.reference_hash, i.reference) for i in items), dtype=np.int32, count=len(items)
        )
        table = pa.table(
            {
                "item_id": [i.item_id for i in items],
                "manifest_row": [i.manifest_row for i in items],
                "group": groups,
                "input": [self._input(i.reference) for i in items],
                "prompt": [i.prompt for i in items],
                "seed": [i.seed for i in items],
                "settings": [self.validator.settings_index(i.settings) for i in items],
                "image_index": [i.image_index for i in items],
                "content_id": [i.content_id for i in items],
            },
            schema=_RUN_SCHEMA,
        ).take(pa.array(np.argsort(groups, kind="stable")))
        path = self.folder / f"run-{len(self.runs):06d}.arrow"
        with pa.ipc.new_file(str(path), _RUN_SCHEMA) as writer:
            writer.write_table(table, max_chunksize=RUN_BATCH_ROWS)
        self.runs.append(_Run(path, len(items)))

    def _group(self, reference_hash: str, reference: ReferenceInput) -> int:
        group = self.validator.reference_group(reference_hash)
        if group == len(self._hashes):
            self._hashes.append(reference_hash)
            if len(self._first_inputs) < FIRST_REFERENCES_KEPT:
                self._first_inputs.append(reference)
        return group

    def first_references(self) -> list[tuple[str, ReferenceInput]]:
        """The job's first references in order of first use (hash, input): a judged job's contrast references."""
        return list(zip(self._hashes, self._first_inputs))

    def _input(self, reference: ReferenceInput) -> int:
        index = self._inputs.get(reference)
        if index is None:
            index = self._inputs[reference] = len(self._input_list)
            self._input_list.append(reference)
        return index

    # -- what is committed already -------------------------------------------------------------------------------
    def compare_contents(self, contents: CommittedContents) -> ContentCheck:
        """The plan's items against what the output committed (storage/item_contents.py): explicit ids committed with
        other content, ids another job committed. Reads each run's id columns once; vectorised."""
        check = ContentCheck()
        changed_ids: list[pa.Array] = []
        if not len(contents.explicit) and not len(contents.foreign):
            return check
        for run in self.runs:
            table = _read_run(run.path, ["item_id", "content_id", "manifest_row"])
            ids = pa.concat_arrays(table.column("item_id").chunks)
            changed, foreign = compare_run(contents, ids, pa.concat_arrays(table.column("content_id").chunks))
            rows = table.column("manifest_row").to_numpy()
            for found, mask in ((check.changed, changed), (check.foreign, foreign)):
                if mask.any():
                    found.add(rows[mask], ids.filter(pa.array(mask)))
            if changed.any():
                changed_ids.append(ids.filter(pa.array(changed)))
        check.changed_ids = CommittedIds.from_arrow_parts(changed_ids)
        return check

    def skip_committed(self, committed, *, rerender=None) -> None:
        """Mark the items whose ids `committed` holds (a `CommittedIds`, or anything with `contains(ids)`) as done,
        but those `rerender` holds (the same kind: explicit ids committed with other content, to be rendered again),
        and compute the figures of what is left to render."""
        settings_used = np.zeros(len(self.validator.settings), dtype=bool)
        groups_used = np.zeros(len(self._hashes), dtype=bool)
        batch_key_of = _batch_key_indices(self.validator.settings)
        counts = (np.array([], np.int64), np.array([], np.int64))
        self.committed = self.to_render = self.committed_found = self.rerendered = 0
        for run in self.runs:
            table = _read_run(run.path, ["item_id", "group", "settings"])
            ids = table.column("item_id")
            done = np.asarray(committed.contains(ids), dtype=bool) if len(committed) else np.zeros(run.rows, bool)
            self.committed_found += int(done.sum())
            if rerender is not None and len(rerender):
                again = done & np.asarray(rerender.contains(ids), dtype=bool)
                self.rerendered += int(again.sum())
                done &= ~again
            todo = ~done
            run.todo = np.packbits(todo)
            self.committed += int(done.sum())
            self.to_render += int(todo.sum())
            group = table.column("group").to_numpy()[todo]
            setting = table.column("settings").to_numpy()[todo]
            settings_used[setting] = True
            groups_used[group] = True
            keys = (group.astype(np.int64) << 32) | batch_key_of[setting]
            counts = _add_counts(counts, *np.unique(keys, return_counts=True))
        self.references_to_render = int(groups_used.sum())
        used = [s for s, on in zip(self.validator.settings, settings_used) if on]
        self.sizes = sorted({(s.width, s.height) for s in used})
        self.largest = max(used, key=lambda s: s.width * s.height) if used else None
        self._group_counts = counts

    def planned_batch_sizes(self, max_batch: int) -> tuple[int, ...]:
        """The forward sizes the schedule will send: per reference and batch key, full batches of max_batch and one
        tail (cluster/placement.py takes a reference's items in that order)."""
        n = self._group_counts[1]
        sizes = set(np.minimum(n, max_batch).tolist()) | set((n % max_batch).tolist())
        return tuple(sorted(sizes - {0})) or (1,)

    # -- reading back --------------------------------------------------------------------------------------------
    def reference_groups(self) -> Iterator[list[WorkItem]]:
        """The items to render, one reference's at a time (in manifest order inside it), references in order of
        first use. Call `skip_committed` first."""
        # Ties on the group go by run index (heapq.merge's order), so manifest order holds inside a reference.
        return self._merged()

    def rerender_work(self, queued: pa.Table) -> tuple[Iterator[list[WorkItem]], int]:
        """A judged job's next round: the re-renders `queued` asks for (columns `render_of`, a plan item's id, and
        `render_index`, which of its renders to make; render_service/work_items.py `rerender_of`), as
        `reference_groups` yields them, and how many there are. Each run's ids are matched at once (vectorised);
        what is held meanwhile is a byte per item of the plan."""
        if queued.num_rows == 0:
            return iter(()), 0
        wanted = queued.column("render_of").combine_chunks()
        indices = queued.column("render_index").combine_chunks()
        count = 0
        for run in self.runs:
            ids = _read_run(run.path, ["item_id"]).column("item_id")
            at = pc.index_in(ids, value_set=wanted)  # per item: its row in `queued`, null when not queued
            found = at.is_valid().to_numpy(zero_copy_only=False)
            run.rerender = np.full(run.rows, -1, dtype=np.int8)
            run.rerender[found] = indices.take(at.filter(found)).to_numpy(zero_copy_only=False)
            count += int(found.sum())
        return self._merged(rerender=True), count

    def _merged(self, *, rerender: bool = False) -> Iterator[list[WorkItem]]:
        merged = heapq.merge(
            *(self._segments(i, run, rerender=rerender) for i, run in enumerate(self.runs)), key=lambda s: s[0]
        )
        group, items = None, []
        for segment_group, _, segment in merged:
            if segment_group != group and items:
                yield items
                items = []
            group = segment_group
            items.extend(segment)
        if items:
            yield items

    def _segments(
        self, run_index: int, run: _Run, *, rerender: bool = False
    ) -> Iterator[tuple[int, int, list[WorkItem]]]:
        """(group, run index, that group's items of one record batch), in group order: what the merge sorts on.
        `rerender`: the run's items a round re-renders (`rerender_work`), as those renders."""
        if run.todo is None:
            raise RuntimeError("SpilledItems.skip_committed must run before the items are read")
        todo = run.rerender >= 0 if rerender else np.unpackbits(run.todo, count=run.rows).astype(bool)
        settings, inputs, hashes = self.validator.settings, self._input_list, self._hashes
        offset = 0
        with pa.OSFile(str(run.path)) as source:  # read, not mapped: a mapped run's pages would count as ours
            reader = pa.ipc.open_file(source)
            for b in range(reader.num_record_batches):
                batch = reader.get_batch(b)
                keep = todo[offset : offset + batch.num_rows]
                offset += batch.num_rows
                if not keep.any():
                    continue
                if not keep.all():
                    batch = batch.filter(pa.array(keep))
                columns = [batch.column(name).to_pylist() for name in _RUN_SCHEMA.names]
                ids, rows, group, inp, prompt, seed, setting, image_index, content = columns
                render = run.rerender[offset - len(keep) : offset][keep].tolist() if rerender else None
                starts = [0, *(np.flatnonzero(np.diff(np.asarray(group))) + 1).tolist(), len(group)]
                for start, end in zip(starts, starts[1:]):
                    yield (
                        group[start],
                        run_index,
                        [
                            _item_render(
                                WorkItem(
                                    ids[k],
                                    rows[k],
                                    inputs[inp[k]],
                                    hashes[group[k]],
                                    prompt[k],
                                    seed[k],
                                    settings[setting[k]],
                                    image_index[k],
                                    content[k],
                                ),
                                render[k] if render is not None else 0,
                            )
                            for k in range(start, end)
                        ],
                    )

    def all_errors(self) -> Iterator[RowError]:
        """Every row error, in manifest order (read back from the errors file)."""
        path = self.folder / "errors.arrow"
        if not self.error_count or not path.exists():
            return
        with pa.OSFile(str(path)) as source:
            reader = pa.ipc.open_file(source)
            for b in range(reader.num_record_batches):
                for r in reader.get_batch(b).to_pylist():
                    yield RowError(r["manifest_row"], r["item_id"], r["field"], r["error"])

    def close(self) -> None:
        """Remove the spilled runs."""
        if self._errors_writer is not None:
            self._errors_writer.close()
            self._errors_writer = None
        if self._temporary is not None:
            self._temporary.remove()  # the folder and its lock
        else:
            shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> SpilledItems:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _item_render(item: WorkItem, render_index: int) -> WorkItem:
    return rerender_of(item, render_index) if render_index else item


def plan_against_output(
    plan: SpilledItems, committed: CommittedState, *, rerender_changed: bool = False
) -> ContentCheck:
    """What is left to render of `plan` on an output that holds `committed` (read under the lease, for this job's
    fingerprint: storage/item_contents.py `read_committed_state`): explicit ids the output holds with other content,
    or that another job committed, are refused with one line naming the manifest rows (`ItemContentError`), unless
    `rerender_changed` asks to render the changed ones again; then the committed items are skipped, and the
    committed items the manifest no longer produces counted (`plan.committed_not_in_manifest`: None where the output
    holds other jobs' items and its rows do not say whose). Memory: the committed explicit ids with their content
    ids, as fixed-width bytes."""
    contents, ids = committed.contents, committed.ids
    check = plan.compare_contents(contents)
    line = refusal(check, contents, manifest=plan.manifest, output=committed.uri, rerender=rerender_changed)
    if line is not None:
        raise ItemContentError(line)
    plan.skip_committed(ids, rerender=check.changed_ids if check.changed.items else None)
    if plan.rerendered:
        log.warning(
            "rendering again %d item(s) of %d manifest row(s) whose explicit ids %s holds with other content "
            "(rerender_changed)",
            plan.rerendered,
            len(check.changed.rows),
            committed.uri,
        )
    # A judged job's re-renders (`<item_id>-r<k>`) are committed ids no manifest row produces: not counted.
    if contents.rows_name_their_job:
        own = len(ids) - len(contents.foreign) - len(contents.rerenders)
        plan.committed_not_in_manifest = max(0, own - (plan.committed_found - check.foreign.items))
    elif not contents.other_jobs:
        plan.committed_not_in_manifest = max(0, len(ids) - len(contents.rerenders) - plan.committed_found)
    if plan.committed_not_in_manifest:
        log.warning(
            "%d committed item(s) of %s are no longer produced by manifest %s (rows removed, or their ids or "
            "content changed); they stay in the output",
            plan.committed_not_in_manifest,
            committed.uri,
            plan.manifest,
        )
    return check


def _read_run(path: Path, columns: list[str]) -> pa.Table:
    with pa.OSFile(str(path)) as source:
        return pa.ipc.open_file(source).read_all().select(columns)


def _batch_key_indices(settings: list[RenderSettings]) -> np.ndarray:
    """For each distinct settings object, the index of its batch key (settings that may share a forward)."""
    keys: dict[tuple, int] = {}
    return np.array([keys.setdefault(s.batch_key(), len(keys)) for s in settings] or [0], dtype=np.int64)


def _add_counts(
    total: tuple[np.ndarray, np.ndarray], keys: np.ndarray, counts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Two (sorted unique keys, counts) merged into one."""
    all_keys = np.concatenate([total[0], keys])
    unique, inverse = np.unique(all_keys, return_inverse=True)
    return unique, np.bincount(inverse, weights=np.concatenate([total[1], counts]), minlength=len(unique)).astype(
        np.int64
    )


def _validation_bar():
    from tqdm import tqdm

    return tqdm(desc="validating", unit="row", smoothing=0.1)
