"""Explicit ids keep their content: what a resume (or an `--append`) checks committed ids against.

An item's id is a hash of what makes its image (reference, prompt, seed, settings: its *content id*), unless its
manifest row gave an explicit `id`; then the id says nothing of the content, and a row edited under the same id would
count as done and never be rendered again. So every metadata row records its content id beside its item id
(METADATA_SCHEMA `content_id`), and before rendering the driver compares, for each explicit id the manifest gives
and the output holds, the content id the manifest now gives with the committed one (`SpilledItems.compare_contents`,
vectorised). One that differs is refused in one line naming the manifest rows, unless the job asks to render them
again (`output.rerender_changed`): then the new row is the one readers keep (storage/metadata.py `winning_rows`).

With `--append`, ids another job committed are refused the same way: certainly where the rows name their job (a
`job` column holding the job fingerprint), otherwise where the content differs (an appended job whose row has the
same content under the same id asks for the same image, and finds it done).

What is held is the committed explicit ids with their content ids, as sorted fixed-width bytes (no Python object per
id), and the ids other jobs committed where rows name their job; implicit ids cost nothing (their id is their
content).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .backends import Storage
from .ledger import CommittedIds, _fingerprints, _pack, committed_item_ids, read_job
from .metadata import iter_part_columns

JOB_COLUMN = "job"  # a row's job fingerprint, where rows record it (read when present, never required)
RENDER_INDEX_COLUMN = "render_index"  # a judged job's: which render of its item a row is (read when present)
EXAMPLES = 5  # manifest rows a refusal names
EXAMPLES_KEPT = 1_000  # (row, id) pairs kept to choose them from: the lowest rows of the first found


class ItemContentError(ValueError):
    """Committed ids that this manifest gives with other content, or that another job committed (a usage error:
    exit status 2)."""


@dataclass
class CommittedContents:
    """The output's committed explicit ids with the content id of each one's latest row, and the ids other jobs
    committed (where rows name their job)."""

    explicit: CommittedIds  # committed ids whose content id differs from the id (explicit ids), sorted
    contents: np.ndarray  # S<width>, aligned with `explicit`: the content id of the id's last committed row
    foreign: CommittedIds  # ids whose rows name another job (empty where no row names its job)
    rows_name_their_job: bool  # some committed row has a `job` value
    other_jobs: bool  # job.json lists a job other than this one (an appended output)
    # A judged job's committed re-renders (render_index > 0, any job's): ids the manifest never produces
    rerenders: CommittedIds = field(default_factory=lambda: CommittedIds(np.array([], dtype="S1")))


@dataclass
class CommittedState:
    """What an output holds, as a job about to render on it needs it: its claim (``job.json``), the committed ids
    and the content of the explicit ones. One value, read in one call (`read_committed_state`), so that the jobs
    side decides on it without going back to the store."""

    uri: str  # the output's, as the store names it (messages)
    claimed: bool  # job.json is there
    jobs: frozenset[str]  # the fingerprints job.json records: the claiming job's and the appended ones'
    ids: CommittedIds  # every committed item id (storage/ledger.py `committed_item_ids`)
    contents: CommittedContents

    def owner(self, fingerprint: str, *, append: bool) -> str:
        """Whose output this is for the job `fingerprint`: "new" (nothing there), "this job" (a run resumes it),
        "appended" (another job's, and `append` adds to it) or "another job" (refused without `append`)."""
        if not self.claimed and not len(self.ids):
            return "new"
        if fingerprint in self.jobs:
            return "this job"
        return "appended" if append else "another job"


def read_committed_state(storage: Storage, fingerprint: str) -> CommittedState:
    """The output's claim, committed ids and committed contents for the job `fingerprint` (see CommittedState)."""
    job = read_job(storage)
    jobs = _recorded_jobs(job)
    return CommittedState(
        uri=storage.uri,
        claimed=job is not None,
        jobs=jobs,
        ids=committed_item_ids(storage),
        contents=_read_contents(storage, fingerprint, jobs),
    )


def read_committed_contents(storage: Storage, fingerprint: str) -> CommittedContents:
    """What the output's metadata parts say of the content of committed explicit ids, reading only the item_id,
    content_id and (if any part has one) job columns, a few parts at a time."""
    return _read_contents(storage, fingerprint, _recorded_jobs(read_job(storage)))


def _recorded_jobs(job: dict | None) -> frozenset[str]:
    """The fingerprints a job.json records (none without one)."""
    return frozenset(_fingerprints(job or {}) - {None})


def _read_contents(storage: Storage, fingerprint: str, jobs: frozenset[str]) -> CommittedContents:
    """`read_committed_contents`, with the fingerprints the output's job.json records (`jobs`) read already."""
    ids: list[np.ndarray] = []
    contents: list[np.ndarray] = []
    foreign: list[pa.Array] = []
    named = False
    rerenders: list[pa.Array] = []
    for table in iter_part_columns(storage, ["item_id", "content_id", JOB_COLUMN, RENDER_INDEX_COLUMN], parallel=2):
        item_id = pa.concat_arrays(table.column("item_id").chunks) if table.num_rows else pa.array([], pa.string())
        content = table.column("content_id").combine_chunks().cast(pa.string())
        job = table.column(JOB_COLUMN).combine_chunks().cast(pa.string())
        # A judged job's re-render (`<item_id>-r<k>`, render_index > 0) is no manifest item: it is left out of the
        # checks (its id is not the manifest's, its content is its own seed's), and counted apart.
        rerender = pc.fill_null(
            pc.greater(table.column(RENDER_INDEX_COLUMN).combine_chunks().cast(pa.int32()), 0), False
        )
        if pc.any(rerender).as_py():
            rerenders.append(item_id.filter(rerender))
            first = pc.invert(rerender)
            item_id, content, job = item_id.filter(first), content.filter(first), job.filter(first)
        explicit = pc.fill_null(pc.not_equal(content, item_id), False)
        if pc.any(explicit).as_py():
            ids.append(_pack(item_id.filter(explicit)))
            contents.append(_pack(content.filter(explicit)))
        if job.null_count < len(job):
            named = True
            foreign.append(item_id.filter(pc.fill_null(pc.not_equal(job, fingerprint), False)))
    explicit_ids, latest = _latest_content(ids, contents)
    return CommittedContents(
        explicit=explicit_ids,
        contents=latest,
        foreign=CommittedIds.from_arrow_parts(foreign),
        rows_name_their_job=named,
        other_jobs=bool(jobs - {fingerprint}),
        rerenders=CommittedIds.from_arrow_parts(rerenders),
    )


def _latest_content(ids: list[np.ndarray], contents: list[np.ndarray]) -> tuple[CommittedIds, np.ndarray]:
    """The unique ids (sorted) and, for each, the content of its last row (the parts come in commit order)."""
    if not ids:
        return CommittedIds(np.array([], dtype="S1")), np.array([], dtype="S1")
    # One array at a time, each list dropped as it is joined: the peak is about twice the packed ids and contents.
    width = max(a.dtype.itemsize for a in ids)
    all_ids = np.concatenate([a.astype(f"S{width}", copy=False) for a in ids])
    ids.clear()
    order = np.argsort(all_ids, kind="stable")  # commit order kept among an id's rows
    all_ids = all_ids[order]
    content_width = max(a.dtype.itemsize for a in contents)
    all_contents = np.concatenate([a.astype(f"S{content_width}", copy=False) for a in contents])
    contents.clear()
    all_contents = all_contents[order]
    del order
    last = np.ones(len(all_ids), dtype=bool)
    last[:-1] = all_ids[:-1] != all_ids[1:]
    if last.all():  # each id committed once (the common case): no copies
        return CommittedIds(all_ids), all_contents
    return CommittedIds(all_ids[last]), all_contents[last]


@dataclass
class Found:
    """Items of the manifest in one of the check's classes: how many, the manifest rows they come from, and some of
    them as (manifest row, item id) for the message."""

    items: int = 0
    rows: np.ndarray = field(default_factory=lambda: np.array([], dtype=np.int64))  # sorted unique
    examples: list[tuple[int, str]] = field(default_factory=list)  # up to EXAMPLES_KEPT, in the plan's order

    def add(self, rows: np.ndarray, ids: pa.Array) -> None:
        """Add these items (their manifest rows and ids)."""
        self.items += len(rows)
        self.rows = np.union1d(self.rows, rows)
        room = EXAMPLES_KEPT - len(self.examples)
        if room > 0:
            self.examples += list(zip(rows[:room].tolist(), ids.slice(0, room).to_pylist()))

    def named(self) -> str:
        """`3 row(s) (4 item(s)): row 2 (id 'b-0'), row 9 (id 'x-0') and 1 more row(s)`: the lowest rows first."""
        first: dict[int, str] = {}
        for row, item_id in sorted(self.examples):
            first.setdefault(row, item_id)
        shown = list(first.items())[:EXAMPLES]
        more = len(self.rows) - len(shown)
        text = ", ".join(f"row {row} (id {item_id!r})" for row, item_id in shown)
        tail = f" and {more} more row(s)" if more > 0 else ""
        return f"{len(self.rows)} row(s) ({self.items} item(s)): {text}{tail}"


@dataclass
class ContentCheck:
    """The manifest's items against the committed contents (`SpilledItems.compare_contents`): explicit ids committed
    with other content, ids another job committed, and the changed ids (what a re-render renders again)."""

    changed: Found = field(default_factory=Found)
    foreign: Found = field(default_factory=Found)
    changed_ids: CommittedIds = field(default_factory=lambda: CommittedIds(np.array([], dtype="S1")))


def compare_run(
    contents: CommittedContents, item_ids: pa.Array, content_ids: pa.Array
) -> tuple[np.ndarray, np.ndarray]:
    """For one run of a plan (its item ids, and content ids: null where the id is the content): which items are
    committed with other content, and which another job committed, as bool arrays (vectorised)."""
    changed = np.zeros(len(item_ids), dtype=bool)
    explicit = pc.is_valid(content_ids)
    if len(contents.explicit) and pc.any(explicit).as_py():
        positions = np.flatnonzero(explicit.to_numpy(zero_copy_only=False))
        at = contents.explicit.index_of(item_ids.filter(explicit))
        found = at >= 0
        now = _pack(content_ids.filter(explicit))
        differs = np.zeros(len(at), dtype=bool)
        differs[found] = contents.contents[at[found]] != now[found]
        changed[positions[differs]] = True
    foreign = contents.foreign.contains(item_ids) if len(contents.foreign) else np.zeros(len(item_ids), dtype=bool)
    return changed, np.asarray(foreign, dtype=bool)


def refusal(
    check: ContentCheck, contents: CommittedContents, *, manifest: str, output: str, rerender: bool
) -> str | None:
    """The one line that refuses the job, or None when it may go on (nothing collides, or the changed ids are to be
    rendered again)."""
    if check.foreign.items:
        return (
            f"manifest {manifest}: {check.foreign.named()} give ids that another job on output {output} committed; "
            f"the ids of one output's jobs must not overlap: give these rows other ids (or no id column), or choose "
            f"another output"
        )
    if not check.changed.items or rerender:
        return None
    whose = (
        "by another job appended to it, or from an earlier version of this manifest"
        if contents.other_jobs
        else "from an earlier version of this manifest"
    )
    return (
        f"manifest {manifest}: {check.changed.named()} give explicit ids that output {output} holds with other "
        f"content ({whose}); an id keeps the image it was committed with: give the edited rows new ids, or add "
        f"--rerender-changed (output.rerender_changed: true) to render them again (the new images replace the old)"
    )
