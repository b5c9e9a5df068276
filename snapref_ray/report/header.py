"""The header of the gallery's first page: counts, the job's one throughput, and the runs of summary.json.

What the output left out is counted in the terminal's and summary.json's words: *invalid rows* (manifest rows
that did not validate, never rendered) and *failed items* (valid items whose render failed for good); a judged job with
a quota adds *skipped by the quota* (items whose reference has its kept images: not failed).

One throughput: images per minute while rendering. With ``summary.json``'s ``runs`` list (one entry per
driver run; a resume or an appended job adds one) it is the runs' images over the sum of their rendering
times, as summary.json's ``images_per_hour_rendering``: the hours between two runs are no rendering time.
Without one (a job still in its first run, an older output) it is the span from the first image's start to
the last image's finish, as the throughput chart computes its mean line. The last run's counts and a table of
every run's figures follow; a summary written by another version shows what it has and never fails the page.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from snapref_ray.report.items import FailedItem, clip, timestamp
from snapref_ray.report.plots import format_duration, format_rate, job_start, mean_images_per_minute
from snapref_ray.report.rows import JobRows

__all__ = ["Fact", "Header", "RunRow", "page_header", "sample_note"]


@dataclass(frozen=True)
class Fact:
    """A labelled figure of the header."""

    label: str
    value: str
    hint: str = ""  # hover text saying what the figure means


@dataclass(frozen=True)
class RunRow:
    """One run of the job (a row of the runs table), every figure formatted."""

    number: int
    started: str
    images: str
    failed: str
    wall: str
    startup: str
    rendering: str
    rate: str
    interrupted: str


@dataclass(frozen=True)
class Header:
    """What the first page's header shows."""

    facts: list[Fact]
    throughput_note: str
    run_facts: list[Fact]
    runs: list[RunRow]
    scalars: list[Fact]
    plots: list[tuple[str, str]]
    failed: int  # rows on the errors pages: invalid rows and failed items


_THROUGHPUT_HINT = "images per minute while rendering, from the first image's start to the last image's finish"
_RUNS_THROUGHPUT_HINT = (
    "images per minute while rendering: the images of summary.json's runs over the sum of their rendering times"
    " (the time between runs is not rendering time)"
)


def page_header(
    rows: JobRows,
    failed: Sequence[FailedItem],
    summary: Mapping,
    plot_keys: Mapping[str, str],
    n_pages: int,
    judging=None,
) -> Header:
    """The first page's header from the job's rows (report/rows.py), failed items, ``summary.json`` and plot keys."""
    workers = rows.n_workers
    invalid, failed_renders = left_out(failed)
    facts = [
        Fact("images", f"{rows.n_items:,}"),
        Fact("references", f"{rows.n_references:,}"),
        Fact("invalid rows", f"{invalid:,}", "manifest rows that did not validate: never rendered (errors/)"),
        Fact("failed items", f"{failed_renders:,}", "valid items whose render failed for good (errors/)"),
    ]
    if summary.get("skipped_by_quota") is not None:  # a judged job with a quota (jobs/quota_skips.py)
        facts.append(
            Fact(
                "skipped by the quota",
                f"{summary['skipped_by_quota']:,}",
                "items not rendered (again): their reference has its kept_per_reference images; not failed"
                " (skipped.parquet)",
            )
        )
    if workers:
        facts.append(Fact("workers", f"{workers:,}"))
    if rows.n_shown < rows.n_items:
        facts.append(Fact("shown", f"{rows.n_shown:,} (a sample)", sample_note(rows)))
    # The one throughput of the page, computed as the chart computes its mean line.
    finished = rows.timings("finished_at")
    start = job_start(rows.timings("started_at"))
    ends = finished[np.isfinite(finished)]
    rate = mean_images_per_minute(finished, start)
    note = "throughput: no images with start and finish times yet"
    rendering = _runs_rendering(summary.get("runs"))
    if rendering is not None:
        images, seconds, n_runs = rendering
        facts.append(Fact("rendering time", format_duration(seconds), "the sum of the runs' rendering times"))
        facts.append(Fact("throughput", f"{format_rate(images / seconds * 60)} images / min", _RUNS_THROUGHPUT_HINT))
        note = (
            f"throughput = {_RUNS_THROUGHPUT_HINT} ({images:,.0f} images in {format_duration(seconds)} over"
            f" {n_runs:,} run{'s' if n_runs != 1 else ''}); the throughput plot's mean line spans the first image's"
            " start to the last's finish, the time between runs included"
        )
    elif rate > 0 and start is not None:
        span = float(ends.max()) - start
        facts.append(Fact("rendering time", format_duration(span), "from the first image's start to the last's finish"))
        facts.append(Fact("throughput", f"{format_rate(rate)} images / min", _THROUGHPUT_HINT))
        note = (
            f"throughput = {_THROUGHPUT_HINT} ({len(ends):,} images in {format_duration(span)});"
            " the throughput plot draws it as its mean line"
        )
    if judging is not None:  # a judged job (report/judging.py): what was kept, and what a kept image cost
        facts += [
            Fact("kept", f"{judging.kept:,}", "renders accepted by every check (at most one per item)"),
            Fact("rejected", f"{judging.rejected:,}", ", ".join(f"{k} {v}" for k, v in judging.rejected_by.items())),
            Fact("renders / kept image", _ratio(judging.renders_per_kept_image), "renders made per image kept"),
            Fact(
                "GPU-s / kept image",
                _ratio(judging.gpu_seconds_per_kept_image),
                "(sample_s + decode_s) / forward_batch, summed over every render, per kept image",
            ),
        ]
    facts.append(Fact("pages", f"{n_pages:,}"))
    runs = _runs(summary.get("runs"))
    # With a runs list, the top-level wall time is the job's (over its runs), and each run's is in the table.
    shown = [fact for fact in _SUMMARY_FACTS if not (runs and fact[0] == "wall_seconds")]
    run_facts = [
        Fact(label, _format_or_str(fmt, summary[key])) for key, label, fmt in shown if summary.get(key) is not None
    ]
    return Header(
        facts=facts,
        throughput_note=note,
        run_facts=run_facts,
        runs=runs,
        scalars=_summary_scalars(summary),
        plots=list(plot_keys.items()),
        failed=len(failed),
    )


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.3g}"


def left_out(failed: Sequence[FailedItem]) -> tuple[int, int]:
    """(invalid rows, failed items) among the errors pages' rows: an invalid row failed validation (its stage), a
    failed item its render."""
    invalid = {f.manifest_row if f.manifest_row is not None else id(f) for f in failed if f.stage == "validate"}
    return len(invalid), sum(1 for f in failed if f.stage != "validate")


def _runs_rendering(runs) -> tuple[float, float, int] | None:
    """(images, seconds of rendering, runs) summed over summary.json's runs that rendered; None without any."""
    if not isinstance(runs, list):
        return None
    images = seconds = 0.0
    counted = 0
    for run in runs:
        if not isinstance(run, Mapping):
            continue
        n, s = _number(run, "images"), _number(run, "render_seconds")
        if n is not None and s:
            images, seconds, counted = images + n, seconds + s, counted + 1
    return (images, seconds, counted) if seconds > 0 and images > 0 else None


def _number(run: Mapping, key: str) -> float | None:
    v = run.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def sample_note(rows: JobRows) -> str:
    """What the gallery shows of the job when it is not every item: a webdataset job has previews for a sample.

    Empty when every item is shown. Charts, counts and tables still count every item."""
    if rows.n_shown >= rows.n_items:
        return ""
    if not rows.n_shown:
        return (
            f"The job has {rows.n_items:,} images and none has a preview file, so the gallery shows none"
            " (with output.format webdataset the images are inside the shards; see output.thumbnail_every)."
            " Counts and charts cover every image."
        )
    return (
        f"The job has {rows.n_items:,} images; the gallery shows a sample of {rows.n_shown:,}, about one in"
        f" {round(rows.n_items / rows.n_shown):,}: those with a preview under thumbs/ (output.format webdataset"
        " writes one for a sample, output.thumbnail_every). Counts, charts and tables cover every image."
    )


# Counts of the last run, shown in the header when summary.json has them. Its throughput is not
# among them: the header shows one throughput, and each run's is in the runs table; nor its invalid rows:
# the header counts those of the whole output, from errors/.
_SUMMARY_FACTS = (
    ("images_this_run", "images this run", lambda v: f"{v:,}"),
    ("wall_seconds", "wall time", lambda v: format_duration(float(v))),
    ("encodes_per_reference", "encodes / reference", lambda v: f"{v:.2f}"),
    ("interrupted", "interrupted", lambda v: "yes" if v else "no"),
)


def _runs(runs) -> list[RunRow]:
    """The rows of the runs table from ``summary.json``'s ``runs`` list (a resume adds one).

    Each run as the job's summary records it (``started_at``, ``images``, ``failed_items``,
    ``wall_seconds``, ``startup_seconds``, ``render_seconds``, ``interrupted``); a run's rate is
    its images over its rendering time. A missing or odd figure shows as "–", never fails the page.
    """
    if not isinstance(runs, list):
        return []
    number = _number

    def duration(v: float | None) -> str:
        return format_duration(v) if v is not None else "–"

    rows = []
    for i, run in enumerate(r for r in runs if isinstance(r, Mapping)):
        images = number(run, "images")
        render_s = number(run, "render_seconds")
        rate = images / render_s * 60 if images is not None and render_s else None
        started = number(run, "started_at")
        interrupted = run.get("interrupted")
        rows.append(
            RunRow(
                number=i + 1,
                started=timestamp(started) if started is not None else "–",
                images=f"{images:,.0f}" if images is not None else "–",
                failed=f"{failed:,.0f}" if (failed := number(run, "failed_items")) is not None else "–",
                wall=duration(number(run, "wall_seconds")),
                startup=duration(number(run, "startup_seconds")),
                rendering=duration(render_s),
                rate=format_rate(rate) if rate else "–",
                interrupted="–" if interrupted is None else ("yes" if interrupted else "no"),
            )
        )
    return rows


def _format_or_str(fmt, v) -> str:
    try:
        return fmt(v)
    except (TypeError, ValueError):  # summary.json written by another version: show it as it is
        return clip(str(v), 80)


def _summary_scalars(summary: Mapping, limit: int = 24) -> list[Fact]:
    """Scalar entries of ``summary.json`` (nested one level as ``a.b``), at most ``limit``."""
    out: list[tuple[str, object]] = []
    for k, v in summary.items():
        if isinstance(v, Mapping):
            out += [(f"{k}.{k2}", v2) for k2, v2 in v.items() if not isinstance(v2, (Mapping, list))]
        elif not isinstance(v, list):
            out.append((str(k), v))

    def fmt(k: str, v) -> str:
        if k.endswith("_at") and isinstance(v, (int, float)) and not isinstance(v, bool):
            return timestamp(v) + " UTC"
        if isinstance(v, float):
            return f"{v:.4g}"
        if isinstance(v, int) and not isinstance(v, bool):
            return f"{v:,}"
        return clip(json.dumps(v) if v is None or isinstance(v, bool) else str(v), 80)

    return [Fact(clip(k, 80), fmt(k, v)) for k, v in out[:limit]]
