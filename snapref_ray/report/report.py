"""Regenerate a job's report: plots and gallery pages from its stored metadata.

This is what ``snapref-ray report OUTPUT`` runs. It reads only what the job wrote (metadata
and errors parts, ``summary.json``), so it works on a finished job, on one still running,
and on a job whose gallery was never written, local or on S3 alike.
"""

from __future__ import annotations

from snapref_ray.report.gallery import DEFAULT_TITLE, errors_page_key, failed_items, page_key, write_gallery
from snapref_ray.report.plots import write_plots
from snapref_ray.storage.backends import open_storage
from snapref_ray.storage.metadata import read_errors_table, read_metadata_table, read_summary

__all__ = ["write_report"]


def write_report(output_uri: str, s3=None, *, page_size: int = 200, title: str = DEFAULT_TITLE) -> dict:
    """Write ``report/*.svg`` and the gallery pages under ``output_uri``; returns what was written.

    ``s3`` is passed to :func:`~snapref_ray.storage.backends.open_storage` (endpoint and
    credentials for an S3-compatible store). The result holds ``gallery`` (URI of page 1),
    ``pages`` (number of gallery pages), ``errors_page`` (URI of the first page of failed
    items, None when nothing failed), ``plots`` (plot name -> URI) and the counts
    ``images``, ``references`` and ``failed``.
    """
    storage = open_storage(output_uri, s3=s3)
    table = read_metadata_table(storage)
    done = {str(i) for i in table.column("item_id").to_pylist()}
    errors = read_errors_table(storage, exclude_ids=done)
    summary = read_summary(storage)
    plots = write_plots(storage, table)
    pages = write_gallery(
        storage, table, page_size=page_size, title=title, errors=errors, summary=summary, plot_keys=plots
    )
    return {
        "gallery": storage.uri_for(page_key(1)),
        "pages": sum(1 for key in pages if key.startswith("gallery")),
        "errors_page": storage.uri_for(errors_page_key(1)) if errors_page_key(1) in pages else None,
        "plots": {name: storage.uri_for(key) for name, key in plots.items()},
        "images": table.num_rows,
        "references": (
            len(set(table.column("reference_hash").to_pylist())) if "reference_hash" in table.column_names else 0
        ),
        "failed": len(failed_items(errors, done)),
    }
