"""The judged job's seam into the running schedule, without Ray: a rejected render's next render, made as soon as its
verdict is committed (`JudgeLoop.next_render`), is the render the documented sequence names (render_service/
work_items.py `rerender_of` of the plan's item); a render an earlier run left, whose item's first seed this driver
never saw, goes to the spilled queue instead."""

from __future__ import annotations

from pathlib import Path

from snapref_ray.job_spec import JudgeSection
from snapref_ray.jobs.judge_loop import JudgeLoop
from snapref_ray.render_service.references import ReferenceInput
from snapref_ray.render_service.work_items import WorkItem, render_seed, rerender_of
from snapref_ray.requests import RenderSettings

SPEC = ReferenceInput(("/refs/A.png",), "single", ("reference",))
ITEM = WorkItem("A-0", 1, SPEC, "hash-A", "a scene", 1234, RenderSettings(width=256, height=256, steps=2), 0)


def row(item: WorkItem, *, rejected: bool) -> dict:
    """A committed row as the worker wrote it: the sanity check's verdict in `rejected_by`."""
    return {
        "item_id": item.item_id,
        "render_of": item.render_of or item.item_id,
        "render_index": item.render_index,
        "reference_hash": item.reference_hash,
        "phash": None,
        "rejected_by": "sanity" if rejected else None,
    }


def commit(judge: JudgeLoop, item: WorkItem, *, rejected: bool) -> WorkItem | None:
    """What the job does for each committed render: decide, apply, then ask for its next render."""
    judge.apply(judge.decide([row(item, rejected=rejected)]))
    return judge.next_render(item)


def loop(tmp_path: Path, renders: int = 3) -> JudgeLoop:
    return JudgeLoop(JudgeSection.model_validate({"sanity": {}, "max_renders_per_item": renders}), tmp_path)


def test_a_rejected_renders_next_render_is_the_documented_one_until_max_renders(tmp_path):
    judge = loop(tmp_path, renders=3)
    second = commit(judge, ITEM, rejected=True)
    assert second == rerender_of(ITEM, 1) and second.seed == render_seed(1234, 1) and second.item_id == "A-0-r1"
    third = commit(judge, second, rejected=True)
    # Render 2's seed comes from the item's first seed, not from render 1's.
    assert third == rerender_of(ITEM, 2) and third.seed == render_seed(1234, 2)
    assert commit(judge, third, rejected=True) is None  # 3 renders made: the item has no kept image
    assert judge.figures.items_without_kept_image == 1 and judge.queue.count == 0


def test_a_kept_render_asks_for_nothing(tmp_path):
    judge = loop(tmp_path)
    assert commit(judge, ITEM, rejected=False) is None
    assert judge.figures.kept == 1 and judge.queue.count == 0


def test_an_earlier_runs_re_render_that_is_rejected_again_goes_to_the_spilled_queue(tmp_path):
    judge = loop(tmp_path)
    carried = rerender_of(ITEM, 1)  # from the plan's `rerender_work`: this driver never saw render 0
    assert commit(judge, carried, rejected=True) is None
    queued = judge.queue.take()
    assert queued.to_pylist() == [{"render_of": "A-0", "render_index": 2}]


def test_a_verdict_whose_render_never_came_past_next_render_is_spilled_at_the_end(tmp_path):
    judge = loop(tmp_path)
    judge.apply(judge.decide([row(ITEM, rejected=True)]))  # committed, and the run ended before on_done
    judge.spill_wanted()
    assert judge.queue.take().to_pylist() == [{"render_of": "A-0", "render_index": 1}]
