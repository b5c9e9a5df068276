"""Where the lines Ray's own processes print end up on the driver: the terminal, or a logger (the job's job.log).

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
import time
from collections.abc import Callable

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
