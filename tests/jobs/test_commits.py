"""The driver's commit seam (jobs/commits.py), without Ray, over a real local output: what a plain job commits as it
lands, and what a judged job decides first (its verdict in the row, a rejected image taken out of the output, the
render that comes next), each read back from the output's own files."""

from __future__ import annotations

from snapref_ray.cluster.tasks import ItemOutcome
from snapref_ray.job_spec import JudgeSection
from snapref_ray.jobs.commits import PlainCommits
from snapref_ray.jobs.judge_loop import JudgeLoop
from snapref_ray.jobs.judged_commit import JudgedCommits
from snapref_ray.render_service.references import ReferenceInput
from snapref_ray.render_service.work_items import WorkItem, rerender_of
from snapref_ray.requests import RenderSettings
from snapref_ray.storage.backends import open_storage
from snapref_ray.storage.job_output import JobOutput, OutputSettings
from snapref_ray.storage.metadata import METADATA_SCHEMA, read_metadata_table

ITEM = WorkItem(
    "A-0", 1, ReferenceInput(("/refs/A.png",), "single", ("reference",)), "hash-A", "a scene", 1234, RenderSettings(), 0
)


def _output(tmp_path) -> JobOutput:
    settings = OutputSettings(fingerprint="job-a", spec={"job": "job-a"}, flush_seconds=0)
    return JobOutput.open(open_storage(str(tmp_path / "out")), settings)


def _outcome(item: WorkItem, output: JobOutput, **row) -> ItemOutcome:
    """A returned render whose image and thumbnail the worker wrote to the output."""
    for key in ("image_key", "thumb_key"):
        output.storage.put_bytes(f"{key}/{item.item_id}.png", b"png")
    values = dict.fromkeys(METADATA_SCHEMA.names) | {
        "item_id": item.item_id,
        "render_of": item.render_of or item.item_id,
        "render_index": item.render_index,
        "reference_hash": item.reference_hash,
        "image_key": f"image_key/{item.item_id}.png",
        "image_uri": f"file:///image_key/{item.item_id}.png",
        "thumb_key": f"thumb_key/{item.item_id}.png",
    }
    return ItemOutcome(item.item_id, values | row)


def _committed(output: JobOutput) -> list[dict]:
    output.metadata.flush()
    return read_metadata_table(output.storage).select(["item_id", "image_key", "accepted", "rejected_by"]).to_pylist()


def test_a_plain_job_commits_each_row_as_it_is_and_leaves_a_shards_rows_to_the_shard(tmp_path):
    output = _output(tmp_path)
    commits = PlainCommits(output)
    commits.commit_row(_outcome(ITEM, output))
    commits.commit_row(_outcome(rerender_of(ITEM, 1), output, shard_key="shards/000001"))
    assert [row["item_id"] for row in _committed(output)] == ["A-0"]
    assert commits.next_render(ITEM) is None and not commits.has_earlier_work()


def test_a_judged_job_decides_each_render_before_it_is_committed(tmp_path):
    output = _output(tmp_path)
    section = JudgeSection.model_validate({"sanity": {}, "max_renders_per_item": 2, "keep_rejected_images": False})
    commits = JudgedCommits(output, JudgeLoop(section, tmp_path))
    commits.commit_row(_outcome(ITEM, output, rejected_by="sanity"))
    [row] = _committed(output)
    assert row == {"item_id": "A-0", "image_key": None, "accepted": False, "rejected_by": "sanity"}
    assert not output.storage.exists("image_key/A-0.png") and not output.storage.exists("thumb_key/A-0.png")
    second = commits.next_render(ITEM)  # the rejected render asks for its next one, in the running schedule
    assert second == rerender_of(ITEM, 1)
    commits.commit_row(_outcome(second, output))
    assert _committed(output)[1] == {
        "item_id": "A-0-r1",
        "image_key": "image_key/A-0-r1.png",
        "accepted": True,
        "rejected_by": None,
    }
    assert commits.next_render(second) is None and commits.next_round(plan=None) is None
    assert commits.judge.figures.kept == 1 and commits.judge.figures.rejected == 1
