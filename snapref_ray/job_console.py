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
import traceback
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from snapref_ray.cluster import ray_output
from snapref_ray.ray_token_note import explain_ray_token_warning

LOG_NAME = "job.log"
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_RAY_OUTPUT_LOGGER = "snapref_ray.ray_output"  # Ray's processes' lines, to the file only


class RayDidNotStart(TimeoutError):
    """The local Ray this command started did not come up in time (a busy machine, most often): a TimeoutError, so
    that the command tells it in one `error:` line with exit status 2 (snapref_ray/validation.py)."""


# What Ray 2.60 raises when its local start times out: the raylet not registered within 30 s (node.py), the node
# not seen (services.py), the GCS not up (node.py).
_RAY_START_TIMEOUTS = ("timed out during startup", "waiting for node to startup", "Failed to start GCS")


@contextmanager
def ray_start_failures_in_one_line() -> Iterator[None]:
    """A local Ray start that times out inside the block is raised again as RayDidNotStart (one line), instead of
    Ray's own exception and its traceback through ray.init."""
    try:
        yield
    except Exception as e:
        if not _is_ray_start_timeout(e):
            raise
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RayDidNotStart(
            f"the local Ray did not start in time ({reason}); the machine is probably busy: run the command again"
            " (Ray's own logs: /tmp/ray/session_latest/logs)"
        ) from e


def _is_ray_start_timeout(error: BaseException) -> bool:
    """Whether `error` is one of Ray's start-up timeouts, raised from inside ray.init."""
    if not any(marker in str(error) for marker in _RAY_START_TIMEOUTS):
        return False
    frames = traceback.extract_tb(error.__traceback__)
    return any(f.name == "init" and f.filename.endswith(os.path.join("ray", "_private", "worker.py")) for f in frames)


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
            _ray_lines_to_file(local, verbose=verbose, terminal_level=terminal_level, progress=progress),
            ray_start_failures_in_one_line(),
        ):
            yield where
    finally:
        if remote:
            _upload_log(output_uri, s3, local)


@contextmanager
def serve_console(log_path: str, *, verbose: bool = False) -> Iterator[str]:
    """For `snapref-ray serve`: what Ray and Serve log (their start-up, the controller's and proxies' lines, the
    replicas' output) and this project's INFO lines go to `log_path` (appended to; yields it), the terminal keeps
    the server's own lines, this project's warnings and every line Ray or a replica logs at ERROR."""
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    terminal_level = logging.DEBUG if verbose else logging.WARNING
    with _ray_lines_to_file(log_path, verbose=verbose, terminal_level=terminal_level, ray_errors_on_terminal=True):
        yield log_path


# Ray's driver-side loggers: Serve's does not propagate to Ray's and has a terminal handler of its own.
_RAY_LOGGERS = ("ray", "ray.serve")


@contextmanager
def _ray_lines_to_file(
    local: str, *, verbose: bool, terminal_level: int, progress: bool = False, ray_errors_on_terminal: bool = False
) -> Iterator[None]:
    """The file handler on this project's, Ray's and Ray's processes' lines; the terminal at `terminal_level` (and,
    with `ray_errors_on_terminal`, Ray's own ERROR lines). A local Ray started meanwhile stops here, its last lines
    still going to the file."""
    file_handler = _file_handler(local, verbose)
    root = logging.getLogger()
    ray_output_logger = logging.getLogger(_RAY_OUTPUT_LOGGER)
    console = [h for h in root.handlers if _is_terminal(h)]
    ray_loggers = [logging.getLogger(name) for name in _RAY_LOGGERS]
    # Each Ray logger gets a handler of its own on the same file: ray.init sets the format of that logger's handlers.
    ray_file_handlers = [_file_handler(local, verbose) for _ in ray_loggers]
    saved = {
        "root_level": root.level,
        "console_levels": [h.level for h in console],
        "ray_handlers": [list(logger.handlers) for logger in ray_loggers],
        "ray_handler_levels": [[h.level for h in logger.handlers] for logger in ray_loggers],
        "ray_propagate": [logger.propagate for logger in ray_loggers],
        "ray_output_propagate": ray_output_logger.propagate,
    }
    ray_before = _ray_connected()
    try:
        with ExitStack() as stack:
            root.addHandler(file_handler)
            root.setLevel(min(root.level or logging.WARNING, file_handler.level))
            for handler in console:
                handler.setLevel(terminal_level)
            # Ray's driver lines (start-up, the token notice) and its processes' output: the file (and the terminal
            # keeps Ray's errors, where asked).
            for logger, file_handler_of_ray in zip(ray_loggers, ray_file_handlers):
                terminal = [h for h in logger.handlers if _is_terminal(h)]
                if ray_errors_on_terminal:
                    for handler in terminal:
                        handler.setLevel(logging.ERROR)
                else:
                    logger.handlers = [h for h in logger.handlers if h not in terminal]
                logger.handlers = [*logger.handlers, file_handler_of_ray]
                logger.propagate = False
            # A line of Ray's processes is logged at WARNING when it is an ERROR on stderr (cluster/ray_output.py).
            ray_output_logger.propagate = ray_errors_on_terminal  # through the root: the file, and errors the terminal
            if not ray_errors_on_terminal:
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
            yield
    finally:
        if _ray_connected():
            ray_output.settle()  # the workers' last lines, into the file rather than after the command's end
        if not ray_before and _ray_connected():
            # The local Ray the command started stops while its last lines (workers killed at the end) still go to
            # the file; a Ray the caller had connected to stays.
            sys.modules["ray"].shutdown()
        ray_output.divert_to(None)
        ray_output_logger.removeHandler(file_handler)
        ray_output_logger.propagate = saved["ray_output_propagate"]
        for logger, handlers, levels, propagate in zip(
            ray_loggers, saved["ray_handlers"], saved["ray_handler_levels"], saved["ray_propagate"]
        ):
            logger.handlers = handlers
            for handler, level in zip(handlers, levels):
                handler.setLevel(level)
            logger.propagate = propagate
        for handler, level in zip(console, saved["console_levels"]):
            handler.setLevel(level)
        root.removeHandler(file_handler)
        root.setLevel(saved["root_level"])
        file_handler.close()
        for handler in ray_file_handlers:
            handler.close()


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
