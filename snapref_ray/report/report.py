"""Regenerate a job's report: plots and gallery pages from its stored metadata.

This is what ``snapref-ray report OUTPUT`` runs. It reads only what the job wrote (metadata
and errors parts, ``summary.json``), so it works on a finished job, on one still running,
and on a job whose gallery was never written, local or on S3 alike. A place that holds no
job output (a misspelt folder, most often) is refused before anything is written: the
report neither creates the folder nor leaves an empty gallery in it.
"""

from __future__ import annotations

import difflib
from dataclasses import asdict
from pathlib import Path

from snapref_ray.report.gallery import DEFAULT_TITLE, errors_page_key, failed_items, page_key, write_gallery
from snapref_ray.report.header import left_out
from snapref_ray.report.judging import SCORES_KEY, read_judged, write_judging
from snapref_ray.report.plots import write_plots
from snapref_ray.report.rows import JobRows
from snapref_ray.storage.backends import open_storage
from snapref_ray.storage.ledger import JOB_KEY
from snapref_ray.storage.metadata import (
    METADATA_PREFIX,
    SUMMARY_KEY,
    read_errors_table,
    read_summary,
)

__all__ = ["NoJobOutputError", "write_report"]


class NoJobOutputError(FileNotFoundError):
    """The report was pointed at a place that holds no job output.

    A FileNotFoundError, so the command line tells it in one line (exit status 2) like any
    other missing file (snapref_ray/validation.py).
    """


def write_report(output_uri: str, s3=None, *, page_size: int = 200, title: str = DEFAULT_TITLE) -> dict:
    """Write ``report/*.svg`` and the gallery pages under ``output_uri``; returns what was written.

    ``s3`` is passed to :func:`~snapref_ray.storage.backends.open_storage` (endpoint and
    credentials for an S3-compatible store). The result holds ``gallery`` (URI of page 1),
    ``pages`` (number of gallery pages), ``errors_page`` (URI of the first page of the rows not
    rendered, None when every row was), ``plots`` (plot name -> URI) and the counts
    ``images``, ``shown`` (items the gallery draws: every one, or a webdataset job's sample),
    ``references``, ``invalid_rows`` and ``failed_items`` (the words and counts of the terminal,
    summary.json and the gallery's header); ``judging``, a judged job's counts (report/judging.py), else
    None. The metadata is read a page at a time (report/rows.py).
    Raises :class:`NoJobOutputError` when ``output_uri`` is missing or holds none of
    ``job.json``, ``summary.json``, ``metadata/``.
    """
    if not output_uri.startswith("s3://"):
        _require_local_folder(Path(output_uri.removeprefix("file://")).expanduser())
    storage = open_storage(output_uri, s3=s3)
    if not (storage.exists(JOB_KEY) or storage.exists(SUMMARY_KEY) or storage.list(f"{METADATA_PREFIX}/")):
        raise NoJobOutputError(
            f"no job output at {storage.uri}: it holds no {JOB_KEY}, {SUMMARY_KEY} or {METADATA_PREFIX}/"
            " (give the folder a job wrote: its --out, or output.uri of its spec)"
        )
    rows = JobRows.from_storage(storage)  # the narrow columns of every item; pages read the rest as they go
    errors = read_errors_table(storage, exclude_ids=rows.keys.column("item_id"))
    summary = read_summary(storage)
    plots = write_plots(storage, rows.keys)
    judged = read_judged(storage)  # a judged job's columns only (None: the job did not judge)
    judging = write_judging(storage, judged) if judged is not None else None
    if judging is not None:
        plots = {**plots, "scores": SCORES_KEY}
    pages = write_gallery(
        storage,
        rows,
        page_size=page_size,
        title=title,
        errors=errors,
        summary=summary,
        plot_keys=plots,
        judging=judging,
    )
    return {
        "judging": asdict(judging) if judging is not None else None,
        "gallery": storage.uri_for(page_key(1)),
        "pages": sum(1 for key in pages if key.startswith("gallery")),
        "errors_page": storage.uri_for(errors_page_key(1)) if errors_page_key(1) in pages else None,
        "plots": {name: storage.uri_for(key) for name, key in plots.items()},
        "images": rows.n_items,
        "shown": rows.n_shown,
        "references": rows.n_references,
        **dict(zip(("invalid_rows", "failed_items"), left_out(failed_items(errors, set())), strict=True)),
    }


def _require_local_folder(path: Path) -> None:
    """Refuse a local output that is not a folder, naming a close sibling folder where one exists."""
    if path.is_dir():
        return
    if path.exists():
        raise NoJobOutputError(f"no job output at {path}: it is a file, not the folder a job wrote")
    siblings = [p.name for p in path.parent.iterdir() if p.is_dir()] if path.parent.is_dir() else []
    close = difflib.get_close_matches(path.name, siblings, n=1)
    hint = f" (did you mean {str(path.parent / close[0])!r}?)" if close else ""
    raise NoJobOutputError(f"no job output at {path}: the folder does not exist{hint}")
