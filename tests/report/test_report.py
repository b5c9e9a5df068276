"""`snapref-ray report` on a place that holds no job output: refused in one line, nothing written."""

from __future__ import annotations

import pytest

from snapref_ray.cli import main
from snapref_ray.report import NoJobOutputError, write_report
from snapref_ray.storage.backends import open_storage
from snapref_ray.storage.metadata import write_summary


def test_report_on_a_misspelt_folder_exits_2_in_one_line_and_creates_nothing(tmp_path, capsys):
    job = tmp_path / "demo-output"
    write_summary(open_storage(str(job)), {"images_this_run": 0})
    typo = tmp_path / "demo-ouptut"

    assert main(["report", str(typo)]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"error: no job output at {typo}: the folder does not exist (did you mean {str(job)!r}?)"
    ]
    assert "Traceback" not in err
    assert not typo.exists()


def test_report_on_a_folder_without_job_output_writes_no_gallery(tmp_path):
    (tmp_path / "notes.txt").write_text("not a job")
    with pytest.raises(
        NoJobOutputError, match=r"no job output at .*: it holds no job\.json, summary\.json or metadata/"
    ):
        write_report(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    with pytest.raises(NoJobOutputError, match="it is a file, not the folder a job wrote"):
        write_report(str(tmp_path / "notes.txt"))


def test_report_on_an_empty_s3_prefix_writes_nothing(s3_server):
    uri = f"s3://{s3_server.bucket}/report-test/no-such-job"
    with pytest.raises(NoJobOutputError, match=f"no job output at {uri}"):
        write_report(uri, s3_server.s3_options())
    assert open_storage(uri, s3_server.s3_options()).list("") == []


def test_report_of_a_job_that_has_only_claimed_its_output_is_an_empty_gallery(tmp_path):
    """A job that started but committed nothing yet (job.json only) still gets its page."""
    (tmp_path / "job.json").write_text("{}")
    result = write_report(str(tmp_path))
    assert (result["images"], result["pages"]) == (0, 1)
    assert "No images in this job yet." in (tmp_path / "gallery.html").read_text()


def test_every_template_and_static_file_is_package_data():
    """An installed package (pip install .) carries what the gallery reads at run time."""
    import fnmatch
    import tomllib
    from pathlib import Path

    import snapref_ray

    package = Path(snapref_ray.__file__).parent
    patterns = tomllib.loads((package.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    files = [
        p.relative_to(package).as_posix() for d in ("templates", "static") for p in (package / "report" / d).iterdir()
    ]
    assert len(files) >= 6
    assert [f for f in files if not any(fnmatch.fnmatch(f, pat) for pat in patterns["snapref_ray"])] == []
