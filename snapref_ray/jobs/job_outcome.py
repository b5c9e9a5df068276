"""What a finished job run tells the person or script that started it: the lines at the end and the exit status.

One rule, the same for `snapref-ray render`, `snapref-ray demo` and `python -m jobs.generate_dataset`:

- 0: every row of the manifest is in the output (rendered now or by an earlier run); with `--allow-invalid`,
  every valid row is, and the invalid rows are accepted;
- 1: the job left rows out of the output: items whose render failed (a run of the same command retries
  them), or invalid rows (fix them in the manifest, or accept them with `--allow-invalid`);
- 2 (raised before this is reached, as a usage error): nothing could render, or `--strict` found an invalid row.

The words are the summary's, and the gallery's (report/header.py): an *invalid row* is a manifest row that did not
validate (it is never rendered); a *failed item* is a valid item whose render failed for good. `&& publish`
after a command never ships a short dataset unless it was told to.
"""

from __future__ import annotations

from snapref_ray.jobs.job_summary import JobSummary

ALL_RENDERED, ROWS_LEFT_OUT = 0, 1


def plural(n: int, noun: str) -> str:
    """`1 invalid row`, `2 invalid rows`."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def exit_status(summary: JobSummary, *, allow_invalid: bool = False) -> int:
    """0 when every row of the job is in the output (invalid rows accepted with `allow_invalid`), else 1."""
    if summary.unrendered_items or (summary.invalid_rows and not allow_invalid):
        return ROWS_LEFT_OUT
    return ALL_RENDERED


def summary_line(summary: JobSummary) -> str:
    """The one line of counts: the output's images, this job's share where others' are there too, this run's
    figures, and the throughput (or, for a run that found everything done, that it rendered nothing)."""
    where = f"{summary.images_total:,} images in {summary.output}"
    if summary.job_images != summary.images_total:
        where += f", {summary.job_images:,} of them this manifest's"
    counts = (
        f"{summary.images_this_run:,} this run, {summary.skipped_already_done:,} already there, "
        f"{plural(summary.failed_items, 'failed item')}, {plural(summary.invalid_rows, 'invalid row')}"
    )
    if summary.skipped_by_quota is not None:  # a judged job with a quota: not failed, not to retry (skipped.parquet)
        counts += f", {plural(summary.skipped_by_quota, 'item')} skipped by the quota"
    if summary.rendered_nothing_new:
        # The throughput is the output's over its runs with work: a resume that rendered nothing has none of its own.
        return f"{where} ({counts}); nothing left to render: every valid row was rendered by an earlier run"
    return (
        f"{where} ({counts}); {summary.images_per_hour:.0f} images/hour, "
        f"{summary.encodes_per_reference:.2f} encodes per reference"
    )


def memory_line(summary: JobSummary) -> str | None:
    """One line on memory: what each worker asked Ray for, and per image size the batch its workers measured fits
    (the smallest over the workers; each worker's figures are in summary.json and job.log)."""
    request = (summary.memory_per_worker or {}).get("bytes")
    fits: dict[tuple[int, int], int] = {}
    for fit in summary.memory_fit or []:
        size = (fit["width"], fit["height"])
        fits[size] = min(fits.get(size, fit["batch"]), fit["batch"])
    if not request and not fits:
        return None
    parts = [f"each worker asked Ray for {request / 2**30:.2f} GiB"] if request else []
    parts += [f"at {w}x{h} {n} image(s) fit in one batch" for (w, h), n in sorted(fits.items())]
    return "memory: " + "; ".join(parts)


def not_rendered_lines(summary: JobSummary, *, errors_at: str, allow_invalid: bool = False) -> list[str]:
    """The rows the job left out, the first few with their reason, and one last line: how many, where every one
    is (`errors_at`: the output's errors/ and errors.html), what to do, and the exit status. Empty when nothing
    was left out."""
    failed, invalid = summary.unrendered_items, summary.invalid_rows
    if not failed and not invalid:
        return []
    counts = " and ".join(
        text for n, text in ((invalid, plural(invalid, "invalid row")), (failed, plural(failed, "failed item"))) if n
    )
    shown = [str(row) for row in summary.not_rendered]
    where = f"{'the first above; ' if shown else ''}every one in {errors_at}"
    todo = []
    if invalid:
        todo.append(
            "the invalid rows are accepted (--allow-invalid)"
            if allow_invalid
            else "fix the invalid rows in the manifest, or add --allow-invalid to accept them"
        )
    if failed:
        todo.append("run the same command again to retry the failed items")
    status = exit_status(summary, allow_invalid=allow_invalid)
    return [*shown, f"not rendered: {counts} ({where}); {'; '.join(todo)}; exit status {status}"]
