"""Headless Chromium for tests: dump a page's DOM after its scripts ran, or screenshot it.

Plain subprocess calls of the ``chromium`` binary (Debian packages ``chromium`` and
``chromium-driver``, installed by ``.ci/run``); no WebDriver. Each call uses a fresh
profile folder and disables everything that would reach the network.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

_CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
_FLAGS = (
    "--headless",
    "--no-sandbox",  # tests run as root in containers, where the sandbox cannot start
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--force-device-scale-factor=1",
)


def find_chromium() -> str | None:
    """Path of a Chromium binary: ``$CHROMIUM`` if set, else the first on ``PATH``."""
    if os.environ.get("CHROMIUM"):
        return shutil.which(os.environ["CHROMIUM"])
    return next((p for p in map(shutil.which, _CANDIDATES) if p), None)


def require_chromium() -> str:
    """The Chromium binary, or skip the calling test saying how to get one."""
    path = find_chromium()
    if path is None:
        pytest.skip("no chromium binary on PATH (apt-get install -y chromium chromium-driver, or set $CHROMIUM)")
    return path


def _run(args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        cmd = [require_chromium(), *_FLAGS, f"--user-data-dir={profile}", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"chromium exited with {proc.returncode}: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return proc


def file_url(path: str | os.PathLike) -> str:
    """``file://`` URL of a local file."""
    return Path(path).resolve().as_uri()


def dump_dom(
    url: str, *, window_size: tuple[int, int] = (1280, 2400), budget_ms: int = 5000, timeout_s: float = 60
) -> str:
    """The serialized DOM after the page loaded and ran for ``budget_ms`` of virtual time.

    Virtual time advances only when the page is idle, so images and scripts finish loading
    within the budget; a tall window puts lazily loaded images in view.
    """
    w, h = window_size
    return _run([f"--window-size={w},{h}", f"--virtual-time-budget={budget_ms}", "--dump-dom", url], timeout_s).stdout


def screenshot(
    url: str,
    path: str | os.PathLike,
    *,
    window_size: tuple[int, int] = (1280, 900),
    budget_ms: int = 5000,
    timeout_s: float = 60,
) -> Path:
    """Save a PNG screenshot of the page's viewport to ``path``; returns the path."""
    path = Path(path).resolve()
    w, h = window_size
    _run([f"--window-size={w},{h}", f"--virtual-time-budget={budget_ms}", f"--screenshot={path}", url], timeout_s)
    if not path.is_file():
        raise RuntimeError(f"chromium did not write the screenshot {path}")
    return path
