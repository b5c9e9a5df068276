"""The worker memory estimate is made without torch: the driver that makes it imports none.

Oracle: the same call in this process, where torch is loaded (and was, for the estimate, before it went torch-free;
the figures for the tiny set and a real-size header listing were compared before and after that change).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from snapref_ray.models.bundle import resolve_model_files
from snapref_ray.render_service.memory_estimate import compute_dtype_name, estimate_worker_memory

REPO = Path(__file__).resolve().parents[2]
# (width, height, batch, on_gpu, dtype): CPU and GPU workers, every dtype name, one and several images.
CASES = [
    (256, 256, 1, False, "auto"),
    (832, 1216, 4, False, "bfloat16"),
    (1024, 1024, 2, False, "float16"),
    (512, 768, 3, False, "float32"),
    (1024, 1024, 2, True, "auto"),
    (832, 1216, 1, True, "float32"),
]

# torch blocked before anything is imported: `import torch` anywhere below raises ModuleNotFoundError.
_TORCH_FREE = """
import json, sys
sys.modules["torch"] = None
import snapref_ray.render_service.memory_estimate, snapref_ray.models.vae_config, snapref_ray.models.dit_config
from dataclasses import asdict
from snapref_ray.models.bundle import resolve_model_files
from snapref_ray.render_service.memory_estimate import estimate_worker_memory
folder, cases = sys.argv[1], json.loads(sys.argv[2])
files = resolve_model_files(folder)
print(json.dumps([
    asdict(estimate_worker_memory(files, width=w, height=h, batch=b, on_gpu=gpu, dtype=dtype))
    for w, h, b, gpu, dtype in cases
]))
"""


def test_the_estimate_needs_no_torch_and_gives_the_same_figures(tiny_models: Path) -> None:
    """A process that cannot import torch makes the same MemoryEstimate as this one, for each case."""
    out = subprocess.run(
        [sys.executable, "-c", _TORCH_FREE, str(tiny_models), json.dumps(CASES)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    files = resolve_model_files(tiny_models)
    here = [
        asdict(estimate_worker_memory(files, width=w, height=h, batch=b, on_gpu=gpu, dtype=dtype))
        for w, h, b, gpu, dtype in CASES
    ]
    assert json.loads(out.stdout) == here
    assert len({json.dumps(e) for e in here}) == len(CASES)  # the cases differ: a dtype or size that is ignored shows


def test_a_dtype_is_named_as_the_model_spec_names_it() -> None:
    """ "auto" is bfloat16 on a GPU and float32 on a CPU; a name the model spec does not know is refused."""
    assert compute_dtype_name("auto", on_gpu=True) == "bfloat16"
    assert compute_dtype_name("auto", on_gpu=False) == "float32"
    assert compute_dtype_name("float16", on_gpu=True) == "float16"
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of bfloat16, float16, float32, got 'float64'"):
        compute_dtype_name("float64", on_gpu=False)


@pytest.mark.parametrize(
    "dtype, quantize, computes_in",
    [("auto", "none", "float32"), ("float16", "none", "float16"), ("float32", "fp8", "bfloat16")],
)
def test_a_jobs_workers_ask_for_the_estimate_at_the_dtype_they_compute_in(
    tiny_models: Path, dtype: str, quantize: str, computes_in: str
) -> None:
    """The job's request (cluster/pool.py) passes the model spec's dtype by name; fp8 blocks compute in bfloat16."""
    from snapref_ray.cluster.pool import worker_memory
    from snapref_ray.model_spec import ModelSpec

    model = ModelSpec(models_dir=str(tiny_models), dtype=dtype, quantize=quantize)
    request, report = worker_memory(model, override=None, width=256, height=256, batch=2, use_gpu=False)
    expected = estimate_worker_memory(
        resolve_model_files(tiny_models), width=256, height=256, batch=2, on_gpu=False, dtype=computes_in
    )
    assert (request, report) == (expected.total, expected.report())
