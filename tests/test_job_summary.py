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
    from snapref_ray.jobs.job_summary import EarlierSummary
    from snapref_ray.storage.backends import open_storage
    from snapref_ray.storage.job_output import JobOutput, OutputSettings

    def earlier_runs() -> list:
        output = JobOutput.open(open_storage(str(tmp_path)), OutputSettings(fingerprint="f", spec={}))
        try:
            return EarlierSummary.of(output.earlier_summary, where="summary.json").runs
        finally:
            output.abandon()

    assert earlier_runs() == []  # a new output
    (tmp_path / "summary.json").write_text('{"runs": [{"images": 3')  # a driver killed while writing it
    assert earlier_runs() == []
    (tmp_path / "summary.json").write_text('{"runs": [' + run(3, wall=9.0, render=6.0).model_dump_json() + "]}")
    assert earlier_runs() == [run(3, wall=9.0, render=6.0)]


def test_an_earlier_summary_whose_runs_cannot_be_read_keeps_its_jobs_and_says_so_once(caplog):
    from snapref_ray.jobs.job_summary import EarlierSummary, JobPart

    part = JobPart(
        job="f", manifest="m.csv", manifest_rows=3, invalid_rows=0, items=3, images=3, failed_items=0, finished_at=5.0
    )
    summary = {"runs": [{"images": "three"}], "jobs": [part.model_dump(mode="json")]}
    with caplog.at_level("WARNING", logger="snapref_ray.jobs.job_summary"):
        earlier = EarlierSummary.of(summary, where="/out/summary.json")
    assert earlier == EarlierSummary(runs=[], jobs=[part])
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["/out/summary.json cannot be read"]
    assert EarlierSummary.of(None, where="x") == EarlierSummary(runs=[], jobs=[])


# -- the outcome of a run: its exit status and its last lines (snapref_ray/jobs/job_outcome.py) ----------------------


def outcome(*, items: int, job_images: int, invalid_rows: int = 0, failed: int = 0, to_render: int = 1, **more):
    """A summary with the fields the outcome reads (the rest are the job flow's: tests/test_cli_exit_codes.py)."""
    from snapref_ray.jobs.job_summary import JobSummary

    last = run(job_images, wall=10.0, render=5.0, to_render=to_render)
    fields = dict(output="/out", images_total=job_images, images_this_run=job_images, skipped_already_done=0)
    fields |= dict(images_per_hour=360.0, encodes_per_reference=1.0, not_rendered=[], runs=[last])
    return JobSummary.model_construct(
        items=items, job_images=job_images, invalid_rows=invalid_rows, failed_items=failed, **fields | more
    )


def test_the_exit_status_is_0_only_when_every_row_is_in_the_output():
    from snapref_ray.jobs.job_outcome import exit_status

    assert exit_status(outcome(items=8, job_images=8)) == 0
    assert exit_status(outcome(items=8, job_images=7, failed=1)) == 1  # a failed item
    assert exit_status(outcome(items=8, job_images=7, failed=1), allow_invalid=True) == 1  # is never "accepted"
    assert exit_status(outcome(items=8, job_images=7)) == 1  # an item not committed (a lost shard) is left out too
    assert exit_status(outcome(items=8, job_images=8, invalid_rows=1)) == 1  # an invalid row
    assert exit_status(outcome(items=8, job_images=8, invalid_rows=1), allow_invalid=True) == 0


def test_the_lines_name_what_was_left_out_and_the_exit_status():
    from snapref_ray.jobs.job_outcome import not_rendered_lines, summary_line
    from snapref_ray.jobs.job_summary import NotRendered

    left_out = [
        NotRendered(kind="invalid row", manifest_row=3, item_id=None, reason="field 'reference': no such file"),
        NotRendered(kind="failed item", manifest_row=5, item_id="abc", reason="RuntimeError: boom"),
    ]
    summary = outcome(items=8, job_images=7, invalid_rows=1, failed=1, not_rendered=left_out)
    assert summary_line(summary) == (
        "7 images in /out (7 this run, 0 already there, 1 failed item, 1 invalid row); 360 images/hour,"
        " 1.00 encodes per reference"
    )
    assert not_rendered_lines(summary, errors_at="/out/errors/") == [
        "invalid row 3: field 'reference': no such file",
        "failed item abc (manifest row 5): RuntimeError: boom",
        "not rendered: 1 invalid row and 1 failed item (the first above; every one in /out/errors/); fix the invalid"
        " rows in the manifest, or add --allow-invalid to accept them; run the same command again to retry the failed"
        " items; exit status 1",
    ]
    accepted = outcome(items=8, job_images=8, invalid_rows=2, not_rendered=left_out[:1])
    assert not_rendered_lines(accepted, errors_at="E", allow_invalid=True)[-1] == (
        "not rendered: 2 invalid rows (the first above; every one in E); the invalid rows are accepted"
        " (--allow-invalid); exit status 0"
    )
    assert not_rendered_lines(outcome(items=8, job_images=8), errors_at="E") == []


def test_the_memory_line_gives_the_request_and_the_smallest_batch_that_fit_per_size():
    from snapref_ray.jobs.job_outcome import memory_line

    fits = [
        {"worker_id": "w1", "width": 512, "height": 512, "batch": 4},
        {"worker_id": "w2", "width": 512, "height": 512, "batch": 3},  # the smaller one is what every worker fits
        {"worker_id": "w1", "width": 256, "height": 384, "batch": 8},
    ]
    summary = outcome(items=1, job_images=1, memory_per_worker={"bytes": 3 * 2**30 // 2}, memory_fit=fits)
    assert memory_line(summary) == (
        "memory: each worker asked Ray for 1.50 GiB; at 256x384 8 image(s) fit in one batch;"
        " at 512x512 3 image(s) fit in one batch"
    )
    assert memory_line(outcome(items=1, job_images=1, memory_per_worker=None, memory_fit=fits[2:])) == (
        "memory: at 256x384 8 image(s) fit in one batch"
    )
    assert memory_line(outcome(items=1, job_images=1, memory_per_worker=None, memory_fit=None)) is None


def test_a_run_that_renders_nothing_says_so_and_an_appended_output_counts_every_jobs_images():
    from snapref_ray.jobs.job_outcome import summary_line

    resumed = outcome(items=8, job_images=8, to_render=0, images_this_run=0, skipped_already_done=8)
    assert summary_line(resumed) == (
        "8 images in /out (0 this run, 8 already there, 0 failed items, 0 invalid rows); nothing left to render: every"
        " valid row was rendered by an earlier run"
    )
    appended = outcome(items=3, job_images=3, images_total=11)
    assert summary_line(appended).startswith("11 images in /out, 3 of them this manifest's (3 this run, ")


def test_each_jobs_part_of_an_output_is_kept_and_this_jobs_replaced():
    from snapref_ray.jobs.job_summary import JobPart, job_parts

    def part(job: str, images: int) -> JobPart:
        return JobPart(
            job=job, manifest=f"{job}.csv", manifest_rows=images, invalid_rows=0, items=images, images=images,
            failed_items=0, finished_at=1.0,
        )  # fmt: skip

    first, appended = part("a", 8), part("b", 3)
    assert job_parts([], first) == [first]
    assert job_parts([first], appended) == [first, appended]
    assert job_parts([first, appended], part("a", 9)) == [part("a", 9), appended]  # the first job resumed
    # A summary written before `jobs` existed described one job: its own images were `images_total`.
    old = {"config_hash": "a", "manifest": "a.csv", "manifest_rows": 8, "invalid_rows": 0, "items": 8}
    assert JobPart.from_earlier_summary({**old, "images_total": 8, "finished_at": 1.0}) == [first]
    assert JobPart.from_earlier_summary({"images_total": 8}) == []
