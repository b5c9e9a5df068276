"""Explicit ids keep their content, as a user meets it (`snapref-ray render`, a subprocess, one CPU worker on the
session's local Ray): a row edited under a committed id is refused in one line (exit 2) and the output is left as it
was; `--rerender-changed` renders it again and every reader sees the new row and image; a resume says how many
committed items the manifest no longer produces; each run records the manifest's sha256; an `--append` whose ids
collide with the first job's is refused in one line."""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

import pytest
from PIL import Image

from snapref_ray.requests import RenderSettings
from snapref_ray.storage.backends import open_storage
from snapref_ray.storage.metadata import read_metadata_table
from tests.service.test_spilled_items import expected_id
from tests.test_cli_exit_codes import EXAMPLES, SMALL, error_lines, snapref

REFS = [str(EXAMPLES / "example_refs" / name) for name in ("silver_hair_girl.png", "brown_hair_boy.png")]


@pytest.fixture
def ray_env(local_ray_job) -> dict[str, str]:
    """A driver's environment for the session's local Ray."""
    return {**local_ray_job.driver_env(), "RAY_ADDRESS": local_ray_job.address}


def write_rows(path: Path, rows: list[dict]) -> Path:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["id", "reference", "prompt", "seed"])
        writer.writeheader()
        writer.writerows(rows)
    return path


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_explicit_ids_keep_their_content(ray_env, tiny_models, tmp_path):
    rows = [
        {"id": "a", "reference": REFS[0], "prompt": "1girl, cafe", "seed": 1},
        {"id": "b", "reference": REFS[1], "prompt": "1boy, park", "seed": 2},
        {"id": "", "reference": REFS[0], "prompt": "1girl, beach", "seed": 3},  # no id: the id is the content
    ]
    manifest = write_rows(tmp_path / "ids.csv", rows)
    out = tmp_path / "out"
    render = ["render", str(manifest), "--models", str(tiny_models), "--out", str(out), "--device", "cpu"]
    render += ["--workers", "1", *SMALL, "--no-progress"]

    status, printed = snapref(*render, env=ray_env)
    assert status == 0, printed
    table = read_metadata_table(open_storage(str(out)))
    # The content id the worker recorded is the item's id without its explicit id (written out apart from the code).
    for row in table.to_pylist():
        settings = RenderSettings.model_validate_json(row["settings_json"])
        assert row["content_id"] == expected_id(row["reference_hash"], row["prompt"], row["seed"], settings)
    ids = table.column("item_id").to_pylist()
    assert len(ids) == 3 and {"a-0", "b-0"} < set(ids)
    first = summary(out)
    assert first["runs"][-1]["manifest_sha256"] == hashlib.sha256(manifest.read_bytes()).hexdigest()

    # Row 2 edited under its id: refused in one line naming it, and nothing of the output changes.
    rows[1]["prompt"] = "1boy, rooftop, sunset"
    write_rows(manifest, rows)
    before = (out / "summary.json").read_bytes(), sorted(p.name for p in (out / "metadata").iterdir())
    for dry_run in ([], ["--dry-run"]):  # the dry run refuses what the run would
        status, printed = snapref(*render, *dry_run, env=ray_env)
        assert status == 2, printed
        (line,) = error_lines(printed)
        assert "1 row(s) (1 item(s)): row 2 (id 'b-0') give explicit ids that output" in line
        assert "--rerender-changed" in line
    assert ((out / "summary.json").read_bytes(), sorted(p.name for p in (out / "metadata").iterdir())) == before

    # --rerender-changed: that item alone is rendered again; readers and its image file say the new prompt.
    status, printed = snapref(*render, "--rerender-changed", env=ray_env)
    assert status == 0, printed
    assert f"3 images in {out} (1 this run, 2 already there" in printed
    table = read_metadata_table(open_storage(str(out)))
    prompts = dict(zip(table.column("item_id").to_pylist(), table.column("prompt").to_pylist()))
    assert prompts["b-0"] == "1boy, rooftop, sunset" and len(prompts) == 3
    assert "1boy, rooftop, sunset" in Image.open(out / "images" / "b-0.png").text["parameters"]
    second = summary(out)
    assert second["runs"][-1]["manifest_sha256"] == hashlib.sha256(manifest.read_bytes()).hexdigest()
    assert second["runs"][-1]["manifest_sha256"] != first["runs"][-1]["manifest_sha256"]
    assert second["committed_not_in_manifest"] == 0

    # The id-less row removed: nothing to render, and the resume says one committed item is no longer produced.
    write_rows(manifest, rows[:2])
    status, printed = snapref(*render, env=ray_env)
    assert status == 0, printed
    assert summary(out)["committed_not_in_manifest"] == 1
    assert f"1 committed item(s) of {out} are no longer produced by manifest {manifest}" in printed

    # Another job appended with an id the first committed, with other content: refused in one line naming the row.
    other = write_rows(tmp_path / "other.csv", [{"id": "a", "reference": REFS[1], "prompt": "1boy, snow", "seed": 9}])
    appended = ["render", str(other), *render[2:], "--append"]
    before = (out / "summary.json").read_bytes(), sorted(p.name for p in (out / "metadata").iterdir())
    status, printed = snapref(*appended, env=ray_env)
    assert status == 2, printed
    (line,) = error_lines(printed)
    # The rows name their job (the metadata's `job` column): the id is known to be the other job's.
    assert "1 row(s) (1 item(s)): row 1 (id 'a-0') give ids that another job on output" in line
    assert "the ids of one output's jobs must not overlap" in line
    assert ((out / "summary.json").read_bytes(), sorted(p.name for p in (out / "metadata").iterdir())) == before
    assert len(read_metadata_table(open_storage(str(out)))) == 3


def test_rerender_changed_is_refused_for_a_webdataset_output(tmp_path):
    """A shard cannot drop an id's old image: the flag is a usage error there, in one line, before anything runs."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        f"model: {{models_dir: {tmp_path / 'models'}}}\nmanifest: {tmp_path / 'm.csv'}\n"
        f"output: {{uri: {tmp_path / 'out'}, format: webdataset}}\n"
    )
    status, printed = snapref("render", str(spec), "--rerender-changed")
    assert status == 2, printed
    (line,) = error_lines(printed)
    assert "rerender_changed needs format: files" in line and not (tmp_path / "out").exists()
