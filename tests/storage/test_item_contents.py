"""Explicit ids keep their content: a resume refuses a row edited under a committed explicit id (or renders it again
when asked, its new row then the one readers keep), an appended job's ids that collide with another job's are
refused, and a resume counts the committed items its manifest no longer produces. No Ray: the plan is the driver's
(jobs/spilled_items.py), the rows are built by the worker's row builder (render_service/records.py)."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pytest

from snapref_ray.jobs.manifest_check import ManifestSettings
from snapref_ray.jobs.spilled_items import SpilledItems, plan_against_output
from snapref_ray.render_service.records import metadata_row
from snapref_ray.render_service.work_items import WorkItem
from snapref_ray.report.rows import JobRows
from snapref_ray.storage.backends import LocalStorage, open_storage
from snapref_ray.storage.item_contents import JOB_COLUMN, ItemContentError, read_committed_state
from snapref_ray.storage.ledger import CommittedIds, claim_output
from snapref_ray.storage.metadata import (
    METADATA_SCHEMA,
    MetadataWriter,
    compact_parts,
    read_metadata_table,
    winning_rows,
)
from tests.service.test_work_items import png, spec_for, write_manifest

ROWS = [
    {"id": "a", "reference": "refs/r0.png", "prompt": "1girl, beach", "seed": 1},
    {"id": "b", "reference": "refs/r0.png", "prompt": "1girl, library", "seed": 2},
    {"id": "c", "reference": "refs/r1.png", "prompt": "1girl, snow", "seed": 3, "images_per_prompt": 2},
    {"reference": "refs/r1.png", "prompt": "1girl, train station", "seed": 4},  # no id: the id is the content
]


@pytest.fixture
def job(tmp_path) -> Path:
    refs = tmp_path / "refs"
    refs.mkdir()
    for k in range(2):
        (refs / f"r{k}.png").write_bytes(png((60 * k, 200 - 60 * k, 90)))
    return tmp_path


def plan_of(folder: Path, rows: list[dict], name: str = "manifest.csv") -> SpilledItems:
    manifest = write_manifest(folder / name, rows)
    spec = spec_for(manifest, defaults={"width": 256, "height": 256, "steps": 4})
    return SpilledItems.build(ManifestSettings.of(spec), adapter_kind="snapref")


def items_to_render(plan: SpilledItems) -> list[WorkItem]:
    return [item for group in plan.reference_groups() for item in group]


def row_of(item: WorkItem, *, job: str | None = None) -> dict:
    """The row a worker commits for `item` (the real row builder, over a stand-in for the render)."""
    rendered = SimpleNamespace(
        request=item.request(), reference_hash=item.reference_hash, timings={}, forward_batch=1, skipped_forwards=None
    )
    row = metadata_row(
        rendered,
        item_id=item.item_id,
        reference_uris=list(item.reference.uris),
        model="tiny",
        adapter="snapref",
        worker_id="w0",
        node_id="n0",
        image_format="png",
        started_at=0.0,
        manifest_row=item.manifest_row,
        image_key=f"images/{item.item_id}.png",  # the gallery draws only items with an image
    )
    return row if job is None else row | {JOB_COLUMN: job}


def commit(storage, items: list[WorkItem], *, job: str | None = None) -> None:
    with MetadataWriter(storage, schema=METADATA_SCHEMA, flush_seconds=0) as writer:  # its `job` column included
        for item in items:
            writer.add(row_of(item, job=job))


def render_all(
    storage, folder: Path, rows: list[dict], fingerprint: str, *, append: bool = False, **kw
) -> SpilledItems:
    """What a run of the job does to the output, without Ray: claim, plan against it, commit every item left."""
    claim_output(storage, fingerprint, {"job": fingerprint}, append=append)
    with plan_of(folder, rows) as plan:
        plan_against_output(plan, read_committed_state(storage, fingerprint), **kw)
        commit(storage, items_to_render(plan))
        return plan


def test_the_row_builder_records_the_content_id_the_plan_gives(job):
    with plan_of(job, ROWS) as plan:
        plan.skip_committed(CommittedIds.from_strings([]))
        items = items_to_render(plan)
    by_id = {item.item_id: item for item in items}
    assert sorted(by_id) == sorted(["a-0", "b-0", "c-0", "c-1", by_id[next(i for i in by_id if "-" not in i)].item_id])
    for item in items:
        row = row_of(item)
        # Without an explicit id the content id is the item id; with one, the id the row would have without it.
        assert row["content_id"] == (item.content_id or item.item_id)
        if item.content_id is None:
            assert row["content_id"] == row["item_id"]
    assert by_id["c-0"].content_id != by_id["c-1"].content_id  # two images of one row: two seeds, two contents


def test_a_resume_refuses_an_edited_explicit_id_row_naming_it(job):
    storage = open_storage(str(job / "out"))
    render_all(storage, job, ROWS, "f1")
    edited = [dict(r) for r in ROWS]
    edited[1]["prompt"] = "1girl, library, rain"  # row 2, id b
    edited[2]["seed"] = 30  # row 3, id c: both of its images change
    with plan_of(job, edited) as plan, pytest.raises(ItemContentError) as refused:
        plan_against_output(plan, read_committed_state(storage, "f1"))
    message = str(refused.value)
    assert "\n" not in message
    assert "2 row(s) (3 item(s)): row 2 (id 'b-0'), row 3 (id 'c-0')" in message
    assert "--rerender-changed" in message and "from an earlier version of this manifest" in message
    # The unedited manifest resumes with nothing to do: the check compares content, not row numbers.
    with plan_of(job, ROWS) as plan:
        plan_against_output(plan, read_committed_state(storage, "f1"))
        assert (plan.committed, plan.to_render, plan.rerendered) == (5, 0, 0)


def test_rerender_changed_renders_the_edited_rows_and_readers_keep_their_new_rows(job):
    storage = open_storage(str(job / "out"))
    render_all(storage, job, ROWS, "f1")
    edited = [dict(r) for r in ROWS]
    edited[1]["prompt"] = "1girl, library, rain"
    with plan_of(job, edited) as plan:
        plan_against_output(plan, read_committed_state(storage, "f1"), rerender_changed=True)
        again = items_to_render(plan)
        assert [i.item_id for i in again] == ["b-0"] and (plan.rerendered, plan.committed) == (1, 4)
        commit(storage, again)
    # Retried rows of one content keep their first row: a second commit of 'a-0' with the same content changes nothing.
    with plan_of(job, ROWS[:1], name="retry.csv") as retry:
        retry.skip_committed(CommittedIds.from_strings([]))
        commit(storage, [i for i in items_to_render(retry)])

    def prompts(table: pa.Table) -> dict[str, str]:
        return dict(zip(table.column("item_id").to_pylist(), table.column("prompt").to_pylist()))

    table = read_metadata_table(storage)
    assert table.num_rows == 5 and prompts(table)["b-0"] == "1girl, library, rain"
    report = JobRows.from_storage(storage)  # the gallery's reader follows the same rule
    assert report.n_items == 5 and prompts(report.page(0, 5, ["item_id", "prompt"])) == prompts(table)
    # Compaction keeps the same rows, and the next resume of the edited manifest has nothing to do and no refusal.
    assert compact_parts(storage, min_parts=2)
    assert prompts(read_metadata_table(storage)) == prompts(table)
    with plan_of(job, edited) as plan:
        plan_against_output(plan, read_committed_state(storage, "f1"))
        assert (plan.to_render, plan.rerendered) == (0, 0)


def test_winning_rows_first_row_of_the_latest_content():
    ids = pa.array(["x", "y", "x", "x", "z", "y"])
    contents = pa.array(["c1", "y", "c1", "c2", None, "y"])
    # x: rows 0, 2 (c1), then 3 (c2): its latest content is c2 -> row 3; y: a retry -> its first row, 1; z: row 4.
    assert winning_rows(ids, contents).tolist() == [1, 3, 4]
    assert winning_rows(ids, None).tolist() == [0, 1, 4]  # no content ids (older parts): the first row
    assert winning_rows(pa.array(["x", "y"]), contents.slice(0, 2)) is None  # unique ids: nothing to choose


def test_an_appended_job_whose_ids_collide_is_refused_naming_the_rows(job):
    storage = open_storage(str(job / "out"))
    render_all(storage, job, ROWS, "f1")
    other = [
        {"id": "b", "reference": "refs/r1.png", "prompt": "1boy, harbour", "seed": 7},
        {"id": "z", "reference": "refs/r1.png", "prompt": "1boy, market", "seed": 8},
        {"id": "a", "reference": "refs/r1.png", "prompt": "1boy, desert", "seed": 9},
    ]
    before = read_metadata_table(storage)
    with pytest.raises(ItemContentError) as refused:
        render_all(storage, job, other, "f2", append=True)
    message = str(refused.value)
    assert "2 row(s) (2 item(s)): row 1 (id 'b-0'), row 3 (id 'a-0')" in message
    assert "by another job appended to it" in message and "\n" not in message
    assert read_metadata_table(storage).equals(before)


def test_rows_that_name_their_job_refuse_another_jobs_ids_even_with_the_same_content(job):
    """Where rows record their job, an appended job that asks for the very same content under the same id is
    refused too (its model may differ: the content id does not hold the model)."""
    storage = open_storage(str(job / "out"))
    claim_output(storage, "f1", {"job": "f1"})
    with plan_of(job, ROWS) as plan:
        plan.skip_committed(CommittedIds.from_strings([]))
        commit(storage, items_to_render(plan), job="f1")
    claim_output(storage, "f2", {"job": "f2"}, append=True)
    with plan_of(job, ROWS[:2], name="same.csv") as plan, pytest.raises(ItemContentError) as refused:
        plan_against_output(plan, read_committed_state(storage, "f2"))
    assert "2 row(s) (2 item(s)): row 1 (id 'a-0'), row 2 (id 'b-0') give ids that another job" in str(refused.value)
    # The job that committed them resumes as before; its count of items no longer produced is its own.
    with plan_of(job, ROWS[:3], name="fewer.csv") as plan:
        plan_against_output(plan, read_committed_state(storage, "f1"))
        assert (plan.to_render, plan.committed_not_in_manifest) == (0, 1)


def test_a_resume_counts_the_committed_items_the_manifest_no_longer_produces(job, caplog):
    storage = open_storage(str(job / "out"))
    render_all(storage, job, ROWS, "f1")
    shorter = [ROWS[0], ROWS[2]]  # rows b and the id-less one removed
    with caplog.at_level(logging.WARNING), plan_of(job, shorter) as plan:
        plan_against_output(plan, read_committed_state(storage, "f1"))
        assert (plan.committed, plan.to_render, plan.committed_not_in_manifest) == (3, 0, 2)
    assert f"2 committed item(s) of {storage.uri} are no longer produced by manifest" in caplog.text
    with plan_of(job, ROWS) as plan:
        plan_against_output(plan, read_committed_state(storage, "f1"))
        assert plan.committed_not_in_manifest == 0
    # An output that holds another job's items, whose rows do not say whose: the count is unknown, not wrong.
    claim_output(storage, "f2", {"job": "f2"}, append=True)
    with plan_of(job, shorter) as plan:
        plan_against_output(plan, read_committed_state(storage, "f2"))
        assert plan.committed_not_in_manifest is None


def test_the_plan_records_the_sha256_of_the_manifest_it_read(job):
    with plan_of(job, ROWS) as plan:
        assert plan.manifest_sha256 == hashlib.sha256((job / "manifest.csv").read_bytes()).hexdigest()


def test_the_check_holds_explicit_ids_as_bytes_not_objects(job):
    """What the check keeps of a committed output: its explicit ids and their content ids as fixed-width bytes."""
    from snapref_ray.storage.item_contents import read_committed_contents

    storage = LocalStorage(job / "out")
    render_all(storage, job, ROWS, "f1")
    contents = read_committed_contents(storage, "f1")
    assert contents.explicit.sorted_ids() == ["a-0", "b-0", "c-0", "c-1"]  # the id-less item costs nothing
    assert contents.contents.dtype == "S20" and len(contents.contents) == 4
    assert not len(contents.foreign) and not contents.rows_name_their_job and not contents.other_jobs


def test_the_committed_state_says_whose_output_it_is(job):
    """One read of what an output holds (its claim, ids and contents); the dry run's owner line is decided on it."""
    storage = open_storage(str(job / "out"))
    assert read_committed_state(storage, "f1").owner("f1", append=False) == "new"
    render_all(storage, job, ROWS, "f1")
    state = read_committed_state(storage, "f1")
    assert (state.uri, state.claimed, state.jobs, len(state.ids)) == (storage.uri, True, {"f1"}, 5)
    assert [state.owner("f1", append=False), state.owner("f2", append=False), state.owner("f2", append=True)] == [
        "this job",
        "another job",
        "appended",
    ]
    claim_output(storage, "f2", {"job": "f2"}, append=True)
    state = read_committed_state(storage, "f2")
    assert state.jobs == {"f1", "f2"} and state.owner("f2", append=False) == "this job"
    assert state.contents.other_jobs  # f1's claim, seen from f2
    # Rows without a job.json (written by something else) are no new output.
    unclaimed = open_storage(str(job / "bare"))
    with plan_of(job, ROWS) as plan:
        plan.skip_committed(CommittedIds.from_strings([]))
        commit(unclaimed, items_to_render(plan))
    assert read_committed_state(unclaimed, "f1").owner("f1", append=False) == "another job"
