"""The terminal and the log file of a job run from the command line (`snapref-ray render`, `demo`).

The terminal shows the progress bar, warnings and errors, and the few lines the command prints at the end;
everything else goes to `job.log` in the job's output folder (appended to on every run, so a resumed job's
log follows the first run's): this project's INFO lines, Ray's own driver lines (its start-up, its token-auth
notice, explained) and what Ray's workers and autoscaler print (ray_console.py), which otherwise arrive on the
terminal prefixed `(RenderWorker pid=...)`, tear the progress bar apart and keep coming after the last line.
With `--no-progress` (logs only) this project's INFO lines go to the terminal too.

An `s3://` output gets its job.log at the end of the run (S3 has no append: the run's lines are added to the
object's), a local one line by line.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from snapref_ray.ray_console import ray_lines_to_file, ray_start_failures_in_one_line

LOG_NAME = "job.log"


@contextmanager
def job_console(output_uri: str, *, s3=None, progress: bool = True, verbose: bool = False) -> Iterator[str]:
    """For the duration: job.log in `output_uri` (yields where it is written), Ray's output diverted to it, and the
    terminal's log lines written above the progress bar. Everything is put back afterwards."""
    remote = output_uri.startswith("s3://")
    if remote:
        handle, local = tempfile.mkstemp(prefix="snapref-job-", suffix=".log")
        os.close(handle)
        where = output_uri.rstrip("/") + "/" + LOG_NAME
    else:
        folder = Path(output_uri.removeprefix("file://")).expanduser()
        folder.mkdir(parents=True, exist_ok=True)
        local = str(folder / LOG_NAME)
        where = local
    # INFO to the file; the terminal keeps the bar and what needs a person (all of it with --no-progress).
    terminal_level = logging.DEBUG if verbose else logging.INFO if not progress else logging.WARNING
    try:
        with (
            ray_lines_to_file(local, verbose=verbose, terminal_level=terminal_level, progress=progress),
            ray_start_failures_in_one_line(),
        ):
            yield where
    finally:
        if remote:
            _upload_log(output_uri, s3, local)


def _upload_log(output_uri: str, s3, local: str) -> None:
    """This run's lines after the object's earlier ones; a failed upload is a warning, never the job's error."""
    from snapref_ray.storage.backends import open_storage

    try:
        storage = open_storage(output_uri, s3)
        earlier = storage.get_bytes(LOG_NAME) if storage.exists(LOG_NAME) else b""
        storage.put_bytes(LOG_NAME, earlier + Path(local).read_bytes(), content_type="text/plain")
    except Exception as e:
        logging.getLogger(__name__).warning("could not write %s/%s: %s", output_uri, LOG_NAME, e)
    finally:
        Path(local).unlink(missing_ok=True)
