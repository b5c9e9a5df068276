"""benchmarks/ray_data_vs_job.py --smoke runs all three runners end to end and reports every field.

No timing thresholds (the figures are for the README). What must hold whatever the machine: every
image rendered by every runner, the job encoding each reference exactly once, and the grouped Ray
Data pipeline never encoding a reference more often than there are actors (its LRU holds them all
at smoke size).

The runners run on the session's local Ray (tests/conftest.py) as this module's job: the benchmark
uses the Ray its caller is connected to, and starts its own only when run as a script.
"""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import ray_data_vs_job


@pytest.fixture(scope="module", autouse=True)
def ray_job(local_ray):
    # Worker output stays in Ray's logs, as when the benchmark starts its own Ray: stdout is the JSON.
    with local_ray(log_to_driver=False):
        yield


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ray_data_vs_job_smoke(capsys):
    result = ray_data_vs_job.main(["--smoke"])

    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(result))
    runs = {r["runner"]: r for r in result["runs"]}
    assert list(runs) == list(ray_data_vs_job.RUNNERS)
    for name, run in runs.items():
        fields = ray_data_vs_job.FIELDS + (ray_data_vs_job.RAY_DATA_FIELDS if name != "job" else ())
        assert set(fields) <= set(run), set(fields) - set(run)
        assert (run["images"], run["failed"]) == (12, 0), run
        assert math.isfinite(run["images_per_s"]) and run["images_per_s"] > 0
    assert (runs["job"]["encodes_per_reference"], runs["job"]["max_encodes_per_reference"]) == (1.0, 1)
    grouped = runs["ray_data_grouped"]
    assert 1 <= grouped["max_encodes_per_reference"] <= grouped["actors"] <= 2
    assert runs["ray_data_ungrouped"]["reference_encodes"] >= 3
    assert set(result["ratios"]) == {
        f"{a}_{f}"
        for a in ("job_vs_ray_data_grouped", "ray_data_grouped_vs_ray_data_ungrouped")
        for f in ("images_per_s", "rendering_images_per_s")
    }
