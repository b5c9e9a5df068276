"""`snapref-ray` in the situations a new user meets, run as a user runs it (a subprocess): each ends in one or two
lines that say why and an exit status a shell script can test, never a traceback.

0: every row rendered (with --allow-invalid: every valid row); 1: rows left out (failed items, invalid rows), the
first named; 2: a usage error or input that renders nothing (every row invalid, --strict and an invalid row, the
output of another job, a port in use, a worker no node type can hold); 130: Ctrl-C.

The cases that need no Ray (bad input is found before Ray starts) run first; the rest are drivers of the
session's local Ray (`RAY_ADDRESS`: no Ray start of their own, and `--device cpu`, as a driver joining a
cluster asks for GPU workers otherwise), grouped in one module.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.doc_blocks import REPO

EXAMPLES = REPO / "snapref_ray" / "examples"
SMALL = ["--width", "256", "--height", "256", "--steps", "2"]


# `snapref-ray` with torch made unimportable: every command here, a job's driver included, runs without it
# (docs/design.md), and an import of torch would end it with a traceback.
SNAPREF_WITHOUT_TORCH = "import sys; sys.modules['torch'] = None; from snapref_ray.cli import main; sys.exit(main())"


def snapref(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 240):
    """`snapref-ray ARGS` as a subprocess, torch unimportable: (exit status, stdout + stderr); never a traceback."""
    done = subprocess.run(
        [sys.executable, "-c", SNAPREF_WITHOUT_TORCH, *args],
        env=env or _env(),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    out = done.stdout + done.stderr
    assert "Traceback" not in out, out[-4000:]
    return done.returncode, out


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**env, **extra}


def error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("error: ")]


def said(out: str) -> list[str]:
    """What the command printed, less its log lines (on the terminal too when it is not a terminal: --no-progress)."""
    return [line for line in out.splitlines() if not re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [A-Z]+ ", line)]


@pytest.fixture(scope="module")
def misspelt(tmp_path_factory) -> Path:
    """A manifest whose reference column is spelt `refrence`: every row is invalid."""
    path = tmp_path_factory.mktemp("misspelt") / "manifest.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["refrence", "prompt", "seed"])
        writer.writerow([str(EXAMPLES / "example_refs" / "silver_hair_girl.png"), "1girl, cafe", 1])
        writer.writerow([str(EXAMPLES / "example_refs" / "brown_hair_boy.png"), "1boy, park", 2])
    return path


# -- bad input: found before Ray starts ---------------------------------------------------------------


def test_a_misspelt_column_exits_2_with_the_did_you_mean(misspelt, tiny_models, tmp_path):
    status, out = snapref("render", str(misspelt), "--models", str(tiny_models), "--out", str(tmp_path / "out"))
    assert status == 2, out
    lines = error_lines(out)
    assert len(lines) == 1, out
    assert lines[0].startswith(f"error: every row of {misspelt} is invalid (2 row(s)), nothing rendered; row 1")
    assert "unknown column 'refrence' (did you mean 'reference'?)" in lines[0]
    assert not (tmp_path / "out" / "summary.json").exists() and not (tmp_path / "out" / "gallery.html").exists()


def test_report_on_a_misspelt_folder_exits_2_and_creates_nothing(tmp_path):
    (tmp_path / "run1").mkdir()
    (tmp_path / "run1" / "summary.json").write_text("{}")
    status, out = snapref("report", str(tmp_path / "rnu1"))
    assert status == 2, out
    typo, job = tmp_path / "rnu1", tmp_path / "run1"
    expected = f"error: no job output at {typo}: the folder does not exist (did you mean {str(job)!r}?)"
    assert error_lines(out) == [expected]
    assert not (tmp_path / "rnu1").exists()


def test_serve_on_a_port_in_use_exits_2(tiny_models):
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        status, out = snapref("serve", "--models", str(tiny_models), "--port", str(port))
    assert status == 2, out
    assert error_lines(out) == [
        f"error: port {port} on 127.0.0.1 is in use (Address already in use): another server listens there;"
        " stop it, or choose another --port"
    ]


def test_strict_on_the_quick_form_refuses_an_invalid_row_before_ray_starts(tiny_models, tmp_path):
    manifest = with_a_missing_reference(tmp_path / "manifest.csv")
    out = tmp_path / "out"
    status, printed = snapref("render", str(manifest), "--models", str(tiny_models), "--out", str(out), "--strict")
    assert status == 2, printed
    assert error_lines(printed) == [
        f"error: manifest {manifest}: 1 invalid row(s) and the job is strict; nothing was rendered: row 3, field"
        f" 'reference': reference file not found: {manifest.parent / 'missing.png'}"
    ]
    assert "Started a local Ray instance" not in (out / "job.log").read_text() and not (out / "metadata").exists()
    status, printed = snapref("render", str(manifest), "--models", str(tiny_models), "--out", str(out), "--strict",
                              "--allow-invalid")  # fmt: skip
    assert status == 2 and error_lines(printed) == [
        "error: --strict refuses to start on an invalid row and --allow-invalid accepts them: give one"
    ]


def with_a_missing_reference(path: Path) -> Path:
    """Two good rows and, in row 3, a reference file that is not there."""
    write_manifest(path, ["1girl, cafe", "1boy, park"])
    with path.open("a", newline="") as f:
        csv.writer(f).writerow([str(path.parent / "missing.png"), "1girl, beach", 2])
    return path


def test_version():
    from importlib.metadata import version

    from snapref_ray import __version__

    status, out = snapref("--version")
    assert status == 0
    assert out.startswith(f"snapref-ray {__version__} (ray {version('ray')}, torch {version('torch')}; Python ")


# -- on the session's local Ray --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_env(local_ray_job) -> dict[str, str]:
    """A driver's environment for the session's local Ray."""
    return {**local_ray_job.driver_env(), "RAY_ADDRESS": local_ray_job.address}


def write_manifest(path: Path, prompts: list[str]) -> Path:
    """A manifest of `prompts`, one row each, alternating the example references."""
    refs = ["silver_hair_girl.png", "brown_hair_boy.png"]
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["reference", "prompt", "seed"])
        for seed, prompt in enumerate(prompts):
            writer.writerow([str(EXAMPLES / "example_refs" / refs[seed % 2]), prompt, seed])
    return path


@pytest.fixture(scope="module")
def first_job(ray_env, tiny_models, tmp_path_factory) -> tuple[Path, Path, str]:
    """A 2-row manifest rendered into out/ by one CPU worker: (the manifest, the output, what the command printed)."""
    folder = tmp_path_factory.mktemp("jobs")
    manifest = write_manifest(folder / "first.csv", ["1girl, cafe", "1boy, park"])
    out = folder / "out"
    status, printed = snapref(
        "render", str(manifest), "--models", str(tiny_models), "--out", str(out), "--device", "cpu",
        "--workers", "1", *SMALL, env=ray_env,
    )  # fmt: skip
    assert status == 0, printed
    return manifest, out, printed


@pytest.mark.slow
def test_a_job_that_leaves_an_invalid_row_out_names_it_and_exits_1_unless_allowed(ray_env, tiny_models, tmp_path):
    """The row, its reason, the count and where the rest are; the same words and counts in summary.json and the
    gallery. Run again with --allow-invalid: nothing left to render, said so (no throughput of an earlier run), 0."""
    manifest, out = with_a_missing_reference(tmp_path / "manifest.csv"), tmp_path / "out"
    command = ["render", str(manifest), "--models", str(tiny_models), "--out", str(out), "--device", "cpu"]
    command += ["--workers", "1", *SMALL]
    status, printed = snapref(*command, env=ray_env)
    assert status == 1, printed
    lines = said(printed)
    assert lines[0].startswith(f"2 images in {out} (2 this run, 0 already there, 0 failed items, 1 invalid row); ")
    reason = f"field 'reference': reference file not found: {tmp_path / 'missing.png'}"
    assert lines[-2:] == [
        f"invalid row 3: {reason}",
        f"not rendered: 1 invalid row (the first above; every one in {out / 'errors'}/ and {out / 'errors.html'});"
        " fix the invalid rows in the manifest, or add --allow-invalid to accept them; exit status 1",
    ]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["invalid_rows"], summary["failed_items"], summary["images_total"]) == (1, 0, 2)
    assert summary["not_rendered"] == [{"kind": "invalid row", "manifest_row": 3, "item_id": None, "reason": reason}]
    gallery = (out / "gallery.html").read_text()
    assert "<dt>invalid rows</dt><dd>1</dd>" in gallery and "<dt>failed items</dt><dd>0</dd>" in gallery
    assert "<dt>failed</dt>" not in gallery

    status, printed = snapref(*command, "--allow-invalid", env=ray_env)
    assert status == 0, printed
    lines = said(printed)
    assert lines[0] == (
        f"2 images in {out} (0 this run, 2 already there, 0 failed items, 1 invalid row); nothing left to render:"
        " every valid row was rendered by an earlier run"
    )
    assert lines[-1].endswith("the invalid rows are accepted (--allow-invalid); exit status 0")
    assert lines[-2] == f"invalid row 3: {reason}"


@pytest.mark.slow
def test_render_says_where_the_gallery_and_the_log_are_and_keeps_rays_lines_in_the_log(first_job):
    _, out, printed = first_job
    assert f"2 images in {out} (2 this run" in printed
    assert f"gallery: {out / 'gallery.html'}; log: {out / 'job.log'}" in printed
    assert len([line for line in printed.splitlines() if line.startswith("memory: ")]) == 1
    assert "(RenderWorker" not in printed  # the workers' own lines: in job.log, not over the progress bar
    log = (out / "job.log").read_text()
    assert "(RenderWorker pid=" in log and "snapref_ray.engine: loaded" in log


@pytest.mark.slow
def test_another_jobs_output_needs_append(first_job, ray_env, tiny_models, tmp_path):
    """Refused in one line that names --append; with --append, the dry run finds it would add to it. (Appending
    itself is `output.append`, which --append sets: tests/storage/test_ledger.py.)"""
    _, out, _ = first_job
    manifest = write_manifest(tmp_path / "other.csv", ["1girl, library"])  # another job: a row of its own
    other = ["render", str(manifest), "--models", str(tiny_models), "--out", str(out), "--device", "cpu", *SMALL]
    status, printed = snapref(*other, env=ray_env)
    assert status == 2, printed
    (line,) = error_lines(printed)
    assert f"output {out} belongs to another job" in line and "add --append" in line
    status, printed = snapref(*other, "--dry-run", env=ray_env)
    assert status == 2 and "another job's: add --append" in printed, printed
    status, printed = snapref(*other, "--dry-run", "--append", env=ray_env)
    assert status == 0 and f"dry run: output {out}: another job's; --append adds this job's images to it" in printed
    assert json.loads((out / "summary.json").read_text())["images_total"] == 2  # nothing was added


@pytest.mark.slow
def test_dry_run_counts_what_is_committed_and_writes_nothing(first_job, ray_env, tiny_models):
    manifest, out, _ = first_job
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    status, printed = snapref(
        "render", str(manifest), "--models", str(tiny_models), "--out", str(out), "--device", "cpu",
        "--workers", "1", *SMALL, "--dry-run", env=ray_env,
    )  # fmt: skip
    assert status == 0, printed
    assert "dry run: 2 manifest row(s) -> 2 item(s) (0 invalid row(s)); 2 already committed, 0 to render" in printed
    assert f"dry run: output {out}: this job's: a run resumes it" in printed
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


@pytest.mark.slow
def test_ctrl_c_during_render_exits_130_without_a_traceback(ray_env, tiny_models, tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, "-m", "snapref_ray.cli", "render", str(EXAMPLES / "example_manifest.csv")]
    command += ["--models", str(tiny_models), "--out", str(out), "--device", "cpu", "--workers", "1"]
    command += ["--width", "256", "--height", "256", "--steps", "30"]
    proc = subprocess.Popen(
        command, env=ray_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 180
        # The first image on disk: the workers render, and the driver waits on them (where Ctrl-C lands).
        while time.monotonic() < deadline and not any((out / "images").glob("*")) and proc.poll() is None:
            time.sleep(0.2)
        assert proc.poll() is None, "the job ended before it could be interrupted"
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the terminal's whole foreground group
        printed, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, printed[-3000:]
    assert "Traceback" not in printed and "KeyboardInterrupt" not in printed, printed[-3000:]
    assert printed.rstrip().splitlines()[-1] == (
        "interrupted: what was committed stays; run the same command again to resume"
    )
    assert json.loads((out / "summary.json").read_text())["interrupted"] is True


@pytest.mark.slow
def test_a_worker_no_node_can_hold_ends_the_job_in_one_line(ray_env, tiny_models, tmp_path):
    """`--device cuda` on the session's local Ray (no GPU): Ray's autoscaler reports the request infeasible, and
    the job stops on that report, long before cluster.start_timeout_s (900 s): the subprocess has 120 s."""
    status, printed = snapref(
        "render", str(EXAMPLES / "example_manifest.csv"), "--models", str(tiny_models), "--out",
        str(tmp_path / "out"), "--device", "cuda", *SMALL, env=ray_env, timeout=120,
    )  # fmt: skip
    assert status == 2, printed
    (line,) = error_lines(printed)
    assert line.startswith("error: a render worker can never start: it asks Ray for CPU 1, GPU 1, memory ")
    assert "no node type has enough GPU" in line and "the nodes up now offer" in line
    assert "set model.device: cpu" in line
