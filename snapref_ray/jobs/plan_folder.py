"""The local folder a driver spills its validated items to (jobs/spilled_items.py), and the sweep of the folders that
killed drivers left behind.

A driver killed with SIGKILL (a preempted node, the OOM killer, `kill -9`) cannot remove its folder, and it holds
about 60-100 bytes per item: 600 MB to 1 GB at 10 M rows, left in the temp folder at every such kill. So each folder
holds a `.lock` file that its driver keeps an exclusive `flock` on while it runs. The kernel drops the lock when the
process ends, however it ends, so a folder whose lock another process can take belongs to nobody, and the next driver
that starts on the machine removes it. Unlike a pid in the name, a lock also tells the truth across PID namespaces
(containers that share /tmp) and after the pid was reused.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "snapref-plan-"
LOCK_NAME = ".lock"


class PlanFolder:
    """A new temporary folder, locked for as long as this process holds it (`remove` ends both)."""

    def __init__(self, directory: str | Path | None = None) -> None:
        remove_abandoned_plan_folders(directory)
        self.path = Path(tempfile.mkdtemp(prefix=PREFIX, dir=directory))
        # Locked before the lock file has its name: a sweep that finds `.lock` finds it held.
        unnamed = self.path / (LOCK_NAME + ".new")
        self._lock = os.open(unnamed, os.O_CREAT | os.O_WRONLY, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        os.rename(unnamed, self.path / LOCK_NAME)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self._lock >= 0:
            os.close(self._lock)  # the lock goes with the descriptor
            self._lock = -1


def remove_abandoned_plan_folders(directory: str | Path | None = None) -> list[Path]:
    """Remove the plan folders under `directory` (default: the temp folder) whose driver is gone: those whose lock
    can be taken. A folder without a lock file (one being made, or made by an older version) is left alone."""
    removed = []
    for path in Path(directory or tempfile.gettempdir()).glob(f"{PREFIX}*"):
        try:
            lock = os.open(path / LOCK_NAME, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its driver runs
            os.close(lock)
            continue
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        shutil.rmtree(path, ignore_errors=True)
        os.close(lock)
        log.info("removed %s, left by a driver that was killed (%.1f MB)", path, size / 1e6)
        removed.append(path)
    return removed
