"""A batch job renders with ArcAnima v2 and pilot files on a real local Ray: the kind comes from the file,
a manifest row with a SnapRef-only setting is refused before rendering (the settings are resolved for the
file's kind as the rows are read), with its row, the field and the kind; the others render."""

from __future__ import annotations

import pandas as pd
import pytest

from snapref_ray.jobs.generate_dataset import run_job
from snapref_ray.tiny import TinyConfig, write_tiny_adapter
from tests.cluster.conftest import job_spec, write_manifest

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.timeout(600), pytest.mark.slow]


# One kind keeps the suite short: the pilot, whose "RefKV" is its reference latent (the other payload
# through the object store and the worker caches); v2 goes through the endpoint test, both through the
# engine tests. Add "arcanima-v2" here to run it too (both pass).
@pytest.mark.parametrize("kind", ["arcanima-pilot"])
def test_job_renders_with_an_arcanima_adapter(kind, job_inputs, tiny_models, tmp_path):
    adapter = write_tiny_adapter(tmp_path / f"{kind}.safetensors", TinyConfig(), kind)
    refs = job_inputs.references
    rows = [
        {"reference": refs[0], "prompt": "1girl, solo, park", "strength": 0.7},
        {"reference": refs[1], "prompt": "1girl, solo, beach", "fidelity": 1.0},
        {"reference": refs[0], "prompt": "1girl, solo, city", "mode": "char"},
    ]
    manifest = write_manifest(job_inputs.folder / f"{kind}.csv", rows)
    spec = job_spec(
        manifest, tiny_models, str(tmp_path / "out"), model={"adapter": str(adapter)}, cluster={"num_workers": 1}
    )
    summary = run_job(spec, progress=False, write_gallery=False)
    assert (summary.images_this_run, summary.invalid_rows, summary.failed_items) == (2, 1, 0)
    (error,) = pd.read_parquet(tmp_path / "out" / "errors").itertuples()
    assert (error.manifest_row, error.stage) == (3, "validate")  # rows count from 1
    assert error.error.startswith("field 'mode': ") and f"mode='char' does not apply to {kind} adapters" in error.error
    meta = pd.read_parquet(tmp_path / "out" / "metadata")
    assert len(meta) == 2 and meta["adapter"].str.startswith("sha256:").all()
    assert sorted(meta["prompt"]) == ["1girl, solo, beach", "1girl, solo, park"]
