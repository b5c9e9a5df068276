"""Ray's console on a machine that runs a command: where the lines Ray and its processes print end up.

A job run from the command line (job_console.py) and `snapref-ray serve` (serve/cli.py) both keep Ray's lines off
the terminal and in a log file, keep the terminal for what needs a person, and tell a local Ray that did not start
in one line (`ray_start_failures_in_one_line`, `ray_lines_to_file`, `serve_console`). The cluster's actor pool and
its feasibility check read the same stream (`install`, `on_autoscaler_line`).

With `log_to_driver` (what `connect` asks for) Ray's log monitor streams the stdout and stderr of every worker,
actor and of the autoscaler to the driver, which prints them as they come, prefixed `(RenderWorker pid=...)`.
A job run from the command line keeps them off the terminal, where they tear the progress bar apart and arrive
after its last line: `divert_to(logger)` before the job connects, and `install()` (which `connect` calls once
Ray is up) hands each line to that logger instead. The autoscaler's lines also go to the listeners added with
`on_autoscaler_line` (cluster/feasibility.py reads its infeasible-request reports), diverted or not.

This sits on Ray's driver-side dispatcher of those streams (`ray._private.worker.global_worker_stdstream_dispatcher`,
Ray 2.60), the one place they pass through; its printing handler is put back by `divert_to(None)`. The messages of
Ray's error channel (an actor killed while a call to it was pending, e.g. Serve's controller at shutdown) do not
pass through it: the thread that prints them calls `ray._private.worker.print_to_stdstream` itself, which is
diverted too while a logger is set.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from snapref_ray.ray_token_note import explain_ray_token_warning

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_RAY_OUTPUT_LOGGER = "snapref_ray.ray_output"  # Ray's processes' lines, to the file only
_HANDLER = "snapref_ray_output"
_RAY_PRINT_HANDLER = "ray_print_logs"  # the name Ray's connect() registers its printer under

_target: logging.Logger | None = None
_listeners: list[Callable[[str], None]] = []
_removed_printer = False
_last_output_at = 0.0  # time.monotonic() of the last lines Ray's processes sent


def divert_to(logger: logging.Logger | None) -> None:
    """Send Ray's process output to `logger` (None: print it again, as Ray does). Takes effect at once when Ray
    is connected, else at `install()`."""
    global _target
    _target = logger
    if logger is None:
        _restore_printer()
    elif _connected():
        install()


def on_autoscaler_line(listener: Callable[[str], None]) -> Callable[[], None]:
    """Call `listener(line)` with each line the autoscaler reports to drivers; returns the function that stops it."""
    _listeners.append(listener)
    return lambda: _listeners.remove(listener) if listener in _listeners else None


def install() -> None:
    """Put this module's handler on the connected driver (called by `connect` after `ray.init`)."""
    global _removed_printer
    dispatcher = _dispatcher()
    if dispatcher is None:
        return
    dispatcher.remove_handler(_HANDLER)
    dispatcher.add_handler(_HANDLER, _on_output)
    if _target is not None and any(name == _RAY_PRINT_HANDLER for name, _ in dispatcher.handlers):
        dispatcher.remove_handler(_RAY_PRINT_HANDLER)
        _removed_printer = True
    _divert_error_channel()


def _divert_error_channel() -> None:
    """Ray's error-channel thread prints through the module's `print_to_stdstream`: while a logger is set, the
    messages go to `_on_output` instead (the dispatcher's own printer holds the original function, untouched)."""
    import ray._private.worker as worker

    if not callable(getattr(worker, "print_to_stdstream", None)):  # another Ray: its messages stay where it prints
        return
    original = getattr(worker.print_to_stdstream, "__wrapped__", worker.print_to_stdstream)

    @functools.wraps(original)
    def print_or_divert(data, ignore_prefix: bool):
        if _target is None:
            return original(data, ignore_prefix=ignore_prefix)
        return _on_output(data)

    worker.print_to_stdstream = print_or_divert


def settle(quiet_s: float = 1.0, max_s: float = 3.0) -> None:
    """Wait until Ray's processes have been quiet for `quiet_s` (at most `max_s`): their last lines reach the
    driver a moment after they are written, and a driver that leaves at once never gets them."""
    start = time.monotonic()
    deadline = start + max_s
    while time.monotonic() < deadline:
        quiet = time.monotonic() - max(_last_output_at, start)  # lines still in flight arrive within quiet_s
        if quiet >= quiet_s:
            return
        time.sleep(min(quiet_s - quiet, max(0.0, deadline - time.monotonic())))


def _on_output(data: dict) -> None:
    global _last_output_at
    _last_output_at = time.monotonic()
    pid = data.get("pid")
    lines = data.get("lines") or []
    if pid == "autoscaler":
        for line in lines:
            for listener in list(_listeners):
                listener(line)
    if _target is None:
        return
    who = (
        "autoscaler"
        if pid in ("autoscaler", "raylet")
        else f"{data.get('actor_name') or data.get('task_name') or 'worker'} pid={pid}"
    )
    for line in lines:
        _target.log(logging.WARNING if data.get("is_err") and "ERROR" in line else logging.INFO, "(%s) %s", who, line)


def _restore_printer() -> None:
    global _removed_printer
    dispatcher = _dispatcher()
    if dispatcher is None or not _removed_printer:
        return
    from ray._private.worker import print_to_stdstream

    dispatcher.add_handler(_RAY_PRINT_HANDLER, functools.partial(print_to_stdstream, ignore_prefix=False))
    _removed_printer = False


def _dispatcher():
    try:
        from ray._private.worker import global_worker_stdstream_dispatcher
    except ImportError:  # another Ray: its output stays where Ray prints it
        return None
    return global_worker_stdstream_dispatcher


def _connected() -> bool:
    import ray

    return ray.is_initialized()


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
def serve_console(log_path: str, *, verbose: bool = False) -> Iterator[str]:
    """For `snapref-ray serve`: what Ray and Serve log (their start-up, the controller's and proxies' lines, the
    replicas' output) and this project's INFO lines go to `log_path` (appended to; yields it), the terminal keeps
    the server's own lines, this project's warnings and every line Ray or a replica logs at ERROR."""
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    terminal_level = logging.DEBUG if verbose else logging.WARNING
    with ray_lines_to_file(log_path, verbose=verbose, terminal_level=terminal_level, ray_errors_on_terminal=True):
        yield log_path


# Ray's driver-side loggers: Serve's does not propagate to Ray's and has a terminal handler of its own.
_RAY_LOGGERS = ("ray", "ray.serve")


@contextmanager
def ray_lines_to_file(
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
            # A line of Ray's processes is logged at WARNING when it is an ERROR on stderr (ray_console.py).
            ray_output_logger.propagate = ray_errors_on_terminal  # through the root: the file, and errors the terminal
            if not ray_errors_on_terminal:
                ray_output_logger.addHandler(file_handler)
            ray_output_logger.setLevel(logging.INFO)
            divert_to(ray_output_logger)
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
            settle()  # the workers' last lines, into the file rather than after the command's end
        if not ray_before and _ray_connected():
            # The local Ray the command started stops while its last lines (workers killed at the end) still go to
            # the file; a Ray the caller had connected to stays.
            sys.modules["ray"].shutdown()
        divert_to(None)
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
