"""A killed driver's plan folder (jobs/plan_folder.py) is removed by the next driver on the machine; a running
driver's folder, and a folder without a lock, are left alone. Real processes: the lock is the kernel's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from snapref_ray.jobs.manifest_check import ManifestSettings
from snapref_ray.jobs.plan_folder import LOCK_NAME, PREFIX, PlanFolder, remove_abandoned_plan_folders
from snapref_ray.jobs.spilled_items import SpilledItems
from snapref_ray.requests import RowDefaults

REPO = Path(__file__).resolve().parents[2]

# A driver's stand-in: it makes its plan folder, spills a file into it, says where, and waits to be killed.
_DRIVER = textwrap.dedent(
    """
    import sys, time
    from snapref_ray.jobs.plan_folder import PlanFolder
    folder = PlanFolder(sys.argv[1])
    (folder.path / "run-000000.arrow").write_bytes(b"x" * 4096)
    print(folder.path, flush=True)
    time.sleep(600)
    """
)


def _driver(directory: Path) -> tuple[subprocess.Popen, Path]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(
        [sys.executable, "-c", _DRIVER, str(directory)], stdout=subprocess.PIPE, text=True, env=env
    )
    return process, Path(process.stdout.readline().strip())


def test_a_killed_drivers_folder_is_removed_and_a_running_ones_is_kept(tmp_path):
    killed, killed_folder = _driver(tmp_path)
    running, running_folder = _driver(tmp_path)
    unlocked = tmp_path / f"{PREFIX}older-version"  # no lock file: not ours to judge
    unlocked.mkdir()
    try:
        assert remove_abandoned_plan_folders(tmp_path) == []  # both drivers run
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
        assert killed_folder.exists()  # nobody removed it: it was killed
        mine = PlanFolder(tmp_path)  # the next driver
        assert not killed_folder.exists()
        assert running_folder.exists() and (running_folder / "run-000000.arrow").exists()
        assert unlocked.exists() and (mine.path / LOCK_NAME).exists()
        assert remove_abandoned_plan_folders(tmp_path) == []  # its own folder is held while it runs
        mine.remove()
        assert not mine.path.exists()
    finally:
        running.kill()
        running.wait(timeout=30)
    assert remove_abandoned_plan_folders(tmp_path) == [running_folder]
    assert unlocked.exists()


def test_a_jobs_spilled_items_live_in_a_locked_folder_until_closed(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    reference = tmp_path / "ref.png"
    from PIL import Image

    Image.new("RGB", (64, 64), (200, 30, 30)).save(reference)
    manifest = tmp_path / "m.csv"
    manifest.write_text(f"reference,prompt\n{reference},a\n")
    plan = SpilledItems.build(ManifestSettings(manifest=str(manifest), defaults=RowDefaults()))
    assert plan.items == 1 and plan.folder.parent == tmp_path and (plan.folder / LOCK_NAME).exists()
    assert remove_abandoned_plan_folders(tmp_path) == []
    plan.close()
    assert not plan.folder.exists()
