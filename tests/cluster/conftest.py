"""Fixtures for the batch renderer: the session's local Ray for each test module, generated
references and manifests.

`ray_cluster` is this module's job on the session's local Ray (tests/conftest.py: 8 logical CPUs,
more than cores, so that two render workers, the fake actors and their probes never wait for a
slot); its actors go with it at the module's end, also when a test fails. `ray_cluster_s3`
additionally puts the SeaweedFS credentials in the environment of the driver and of the job's
workers: job specs carry no credentials by design (they come from the standard AWS environment,
job_spec.py).
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Rendering settings small enough for a 2-core CI machine: the tiny models at their smallest size.
FAST_DEFAULTS = {"width": 256, "height": 256, "steps": 2, "cfg": 1.0, "sampler": "euler", "seed": 0}

GOOD_PROMPTS = ["1girl, solo, city street, night", "1girl, solo, beach, summer", "1girl, solo, library, reading"]


@pytest.fixture(scope="module")
def ray_cluster(local_ray) -> Iterator[None]:
    """This module's job on the session's local Ray (workers import the project from the checkout)."""
    with local_ray():
        yield


@pytest.fixture(scope="module")
def ray_cluster_s3(local_ray, s3_server) -> Iterator[None]:
    """`ray_cluster`, with the S3 test server's credentials in the driver's and the workers' environment."""
    creds = {"AWS_ACCESS_KEY_ID": s3_server.access_key, "AWS_SECRET_ACCESS_KEY": s3_server.secret_key}
    with local_ray({**creds, "AWS_EC2_METADATA_DISABLED": "true"}, driver_env=True):
        yield


# ---------------------------------------------------------------------------------------------
# References and manifests


def make_reference_png(path: Path, colour: tuple[int, int, int], size: tuple[int, int] = (128, 160)) -> Path:
    """A small character-sheet-like PNG: a coloured figure on white, distinct per colour."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, (255, 255, 255))
    draw = ImageDraw.Draw(img)
    w, h = size
    draw.ellipse((w * 0.3, h * 0.05, w * 0.7, h * 0.35), fill=colour)  # head
    draw.rectangle((w * 0.25, h * 0.35, w * 0.75, h * 0.95), fill=tuple(c // 2 for c in colour))  # body
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path


def write_manifest(path: Path, rows: list[dict]) -> Path:
    """A CSV manifest with the union of the rows' columns (blank where a row has none)."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return path


@dataclass(frozen=True)
class JobInputs:
    """A folder with generated references and manifests (references are relative to it)."""

    folder: Path
    references: tuple[str, ...]  # relative paths of the good references
    good_manifest: Path  # 3 references x 3 prompts
    bad_rows_manifest: Path  # the good rows plus one row per kind of bad input
    bad_rows: dict[int, tuple[str, str]]  # manifest row -> (field, expected reason substring)


@pytest.fixture(scope="module")
def job_inputs(tmp_path_factory) -> JobInputs:
    """Three generated references with three scene prompts each, and a manifest with bad rows too."""
    folder = tmp_path_factory.mktemp("job-inputs")
    colours = {"red": (200, 40, 40), "green": (40, 160, 60), "blue": (40, 70, 200)}
    refs = tuple(
        make_reference_png(folder / "refs" / f"{name}.png", c).relative_to(folder).as_posix()
        for name, c in colours.items()
    )
    good = [
        {"reference": ref, "prompt": prompt, "seed": 10 * i + j}
        for i, ref in enumerate(refs)
        for j, prompt in enumerate(GOOD_PROMPTS)
    ]
    whole = make_reference_png(folder / "refs" / "whole.png", (90, 90, 90)).read_bytes()
    (folder / "refs" / "corrupt.png").write_bytes(whole[: len(whole) * 2 // 3])  # a truncated download
    bad = [
        {"reference": "refs/missing.png", "prompt": "1girl, park"},
        {"reference": "refs/corrupt.png", "prompt": "1girl, park"},
        {"reference": refs[0], "prompt": "1girl, park", "sampler": "dpmpp_9m"},
        {"reference": refs[0], "prompt": ""},
        {"reference": refs[0], "prompt": "1girl, park", "width": 100000},
    ]
    # CSV rows are numbered from 1 after the header (manifest.py); the bad rows follow the 9 good ones.
    expected = {
        10: ("reference", f"reference file not found: {folder / 'refs' / 'missing.png'}"),
        11: ("reference", "cannot decode the image, the file is truncated or corrupt"),
        12: ("sampler", "Input should be 'euler' or 'er_sde'"),
        13: ("prompt", "empty prompt"),
        14: ("width", "width must be a multiple of 16 between 256 and 4096, got 100000"),
    }
    return JobInputs(
        folder,
        refs,
        write_manifest(folder / "good.csv", good),
        write_manifest(folder / "with_bad_rows.csv", good + bad),
        expected,
    )


def job_spec(
    manifest: Path | str,
    models: Path,
    out: str,
    *,
    defaults: dict | None = None,
    cluster: dict | None = None,
    output: dict | None = None,
    model: dict | None = None,
    **top,
):
    """A JobSpec for the tiny models on the CPU with fast settings; `model`/`cluster`/`output`/`defaults`
    entries override."""
    from snapref_ray.job_spec import JobSpec

    return JobSpec.model_validate(
        {
            "model": {"models_dir": str(models), "device": "cpu", **(model or {})},
            "manifest": str(manifest),
            "defaults": {**FAST_DEFAULTS, **(defaults or {})},
            "output": {"uri": out, **(output or {})},
            "cluster": {
                "num_workers": 2,
                "max_batch": 2,
                "max_in_flight_per_worker": 2,
                **(cluster or {}),
            },
            **top,
        }
    )


def expected_item_ids(spec) -> set[str]:
    """The ids the spec's valid rows must render to (the same validation run_job does)."""
    from snapref_ray.jobs.manifest_check import load_work_items
    from snapref_ray.render_service.loading import adapter_kind

    return {item.item_id for item in load_work_items(spec, adapter_kind=adapter_kind(spec.model)).items}
