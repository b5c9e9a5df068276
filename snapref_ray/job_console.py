"""The terminal and the log file of a job run from the command line (`snapref-ray render`, `demo`).

The terminal shows the progress bar, warnings and errors, and the few lines the command prints at the end;
everything else goes to `job.log` in the job's output folder (appended to on every run, so a resumed job's
log follows the first run's): this project's INFO lines, Ray's own driver lines (its start-up, its token-auth
notice, explained) and what Ray's workers and autoscaler print (cluster/ray_output.py), which otherwise arrive on the
terminal prefixed `(RenderWorker pid=...)`, tear the progress bar apart and keep coming after the last line.
With `--no-progress` (logs only) this project's INFO lines go to the terminal too.

An `s3://` output gets its job.log at the end of the run (S3 has no append: the run's lines are added to the
object's), a local one line by line.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from snapref_ray.cluster import ray_output
from snapref_ray.ray_token_note import explain_ray_token_warning

LOG_NAME = "job.log"
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_RAY_OUTPUT_LOGGER = "snapref_ray.ray_output"  # Ray's processes' lines, to the file only


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
    file_handler = _file_handler(local, verbose)
    # Ray's own logger gets a handler of its own on the same file: ray.init sets the format of that logger's handlers.
    ray_file_handler = _file_handler(local, verbose)
    root = logging.getLogger()
    ray_logger = logging.getLogger("ray")
    ray_output_logger = logging.getLogger(_RAY_OUTPUT_LOGGER)
    console = [h for h in root.handlers if _is_terminal(h)]
    saved = {
        "root_level": root.level,
        "console_levels": [h.level for h in console],
        "ray_handlers": list(ray_logger.handlers),
        "ray_propagate": ray_logger.propagate,
        "ray_output_propagate": ray_output_logger.propagate,
    }
    ray_before = _ray_connected()
    try:
        with ExitStack() as stack:
            root.addHandler(file_handler)
            root.setLevel(min(root.level or logging.WARNING, file_handler.level))
            # INFO to the file; the terminal keeps the bar and what needs a person (all of it with --no-progress).
            terminal_level = logging.DEBUG if verbose else logging.INFO if not progress else logging.WARNING
            for handler in console:
                handler.setLevel(terminal_level)
            # Ray's driver lines (start-up, the token notice) and its processes' output: the file only.
            ray_logger.handlers = [h for h in ray_logger.handlers if not _is_terminal(h)] + [ray_file_handler]
            ray_logger.propagate = False
            ray_output_logger.propagate = False
            ray_output_logger.addHandler(file_handler)
            ray_output_logger.setLevel(logging.INFO)
            ray_output.divert_to(ray_output_logger)
            explain_ray_token_warning()
            logging.getLogger(__name__).info("snapref-ray %s", " ".join(sys.argv[1:]))
            if progress:
                from tqdm.contrib.logging import logging_redirect_tqdm

                stack.enter_context(logging_redirect_tqdm())  # log lines above the bar, not through it
                for handler in root.handlers:
                    if handler not in console and handler is not file_handler:
                        handler.setLevel(terminal_level)  # tqdm's stand-in for the terminal handler
            yield where
    finally:
        if _ray_connected():
            ray_output.settle()  # the workers' last lines, into the file rather than after the command's end
        if not ray_before and _ray_connected():
            # The local Ray the job started stops while its last lines (workers killed at the end) still go to the
            # file; a Ray the caller had connected to stays.
            sys.modules["ray"].shutdown()
        ray_output.divert_to(None)
        ray_output_logger.removeHandler(file_handler)
        ray_output_logger.propagate = saved["ray_output_propagate"]
        ray_logger.handlers = saved["ray_handlers"]
        ray_logger.propagate = saved["ray_propagate"]
        for handler, level in zip(console, saved["console_levels"]):
            handler.setLevel(level)
        root.removeHandler(file_handler)
        root.setLevel(saved["root_level"])
        file_handler.close()
        ray_file_handler.close()
        if remote:
            _upload_log(output_uri, s3, local)


def _ray_connected() -> bool:
    ray = sys.modules.get("ray")
    return bool(ray is not None and ray.is_initialized())


def _file_handler(path: str, verbose: bool) -> logging.Handler:
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter(_FORMAT))
    handler.setLevel(logging.DEBUG if verbose else logging.INFO)
    return handler


def _is_terminal(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) in (sys.stderr, sys.stdout)


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
