"""The job's figures over its driver runs (snapref_ray/jobs/job_summary.py): a resume with nothing to do keeps them.

tests/cluster/test_batch_job.py checks the same through a real resumed job; these check the arithmetic, worked out
by hand, and an output whose summary.json was written before `runs` existed.
"""

from __future__ import annotations

from snapref_ray.jobs.job_summary import RunFigures, job_throughput


def run(images: int, wall: float, render: float, *, to_render: int | None = None, startup: float = 1.0) -> RunFigures:
    return RunFigures(
        started_at=1000.0,
        finished_at=1000.0 + wall,
        items_to_render=images if to_render is None else to_render,
        images=images,
        wall_seconds=wall,
        startup_seconds=startup,
        render_seconds=render,
    )


def test_the_throughput_is_the_jobs_over_the_runs_that_had_work():
    interrupted = run(9, wall=36.0, render=18.0, to_render=20)
    resumed = run(11, wall=54.0, render=27.0, startup=2.0)
    nothing_left = run(0, wall=2.5, render=0.0, to_render=0)
    # 20 images in 90 s of wall (45 s rendering); the empty resume adds nothing.
    expected = {
        "wall_seconds": 90.0,
        "images_per_hour": 800.0,
        "startup_seconds": 3.0,
        "render_seconds": 45.0,
        "images_per_hour_rendering": 1600.0,
    }
    assert job_throughput([interrupted, resumed, nothing_left]) == expected
    assert job_throughput([nothing_left])["images_per_hour"] == 0.0


def test_a_summary_written_before_runs_existed_counts_as_one_run():
    old = {
        "images_this_run": 12,
        "failed_items": 1,
        "wall_seconds": 60.0,
        "startup_seconds": 10.0,
        "render_seconds": 48.0,
        "interrupted": False,
        "finished_at": 5000.0,
        "images_per_hour": 720.0,
    }
    (first,) = RunFigures.from_earlier_summary(old)
    assert (first.started_at, first.images, first.items_to_render, first.render_seconds) == (4940.0, 12, 13, 48.0)
    assert job_throughput([first])["images_per_hour"] == old["images_per_hour"]
    # A summary with runs gives them back as written; one with neither has no run to keep.
    new = {"runs": [first.model_dump(mode="json")]}
    assert RunFigures.from_earlier_summary(new) == [first]
    assert RunFigures.from_earlier_summary({"images_total": 3}) == []


def test_an_unreadable_earlier_summary_starts_the_figures_again(tmp_path):
    from snapref_ray.jobs.generate_dataset import _earlier_runs
    from snapref_ray.storage.backends import open_storage

    storage = open_storage(str(tmp_path))
    assert _earlier_runs(storage) == []  # a new output
    (tmp_path / "summary.json").write_text('{"runs": [{"images": 3')  # a driver killed while writing it
    assert _earlier_runs(storage) == []
    (tmp_path / "summary.json").write_text('{"runs": [' + run(3, wall=9.0, render=6.0).model_dump_json() + "]}")
    assert _earlier_runs(storage) == [run(3, wall=9.0, render=6.0)]
