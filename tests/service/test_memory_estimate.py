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
    [("auto", "none", "float32"), ("bfloat16", "none", "bfloat16"), ("float32", "fp8", "bfloat16")],
)
def test_every_rendering_actor_asks_for_the_estimate_at_the_dtype_it_computes_in(
    tiny_models: Path, tmp_path: Path, dtype: str, quantize: str, computes_in: str
) -> None:
    """A job's workers, the endpoint's replicas, Ray Data's renderer, the identity evaluation's and the timing
    table's workers ask Ray for memory by one rule (render_service/memory_estimate.py `memory_request`): the model
    spec's dtype by name, fp8 blocks in bfloat16. The expected dtype is this test's own table; the endpoint and Ray
    Data asked at "auto" (float32 on a CPU) whatever the spec said."""
    from snapref_ray.data.renderer import SnapRefRenderer
    from snapref_ray.jobs.identity_eval import EvalSpec
    from snapref_ray.jobs.identity_eval import _worker_memory as eval_memory
    from snapref_ray.jobs.timing_spec import TimingSpec
    from snapref_ray.jobs.timing_table import _worker_memory as timing_memory
    from snapref_ray.model_spec import ModelSpec
    from snapref_ray.render_service.memory_estimate import memory_request
    from snapref_ray.serve.app import replica_memory_bytes
    from snapref_ray.serve.config import ServeConfig

    model = ModelSpec(models_dir=str(tiny_models), dtype=dtype, quantize=quantize)
    files = resolve_model_files(tiny_models)

    def expected(side: int, batch: int) -> int:
        return estimate_worker_memory(
            files, width=side, height=side, batch=batch, on_gpu=False, dtype=computes_in
        ).total

    request, estimate = memory_request(model, width=256, height=256, batch=2, on_gpu=False)
    assert request == expected(256, 2) and estimate is not None and estimate.total == request  # a job's worker
    serve = ServeConfig(model=model, gpus_per_replica=0, max_batch=2, limits={"max_side": 256, "max_n": 2})
    assert replica_memory_bytes(serve, on_gpu=False) == expected(256, 2)
    assert SnapRefRenderer.memory_request(model, width=256, height=256, max_batch=2, gpu=False) == expected(256, 2)
    # Six seeds of one row each: two three-row images, in a square of the target's area.
    evaluation = EvalSpec(
        model=model, manifest=str(tmp_path / "m.csv"), noise_seeds=list(range(6)), target_megapixels=0.0656
    )
    assert eval_memory(evaluation, on_gpu=False) == expected(256, 2)
    timing = TimingSpec(model=model, width=256, height=256)
    assert timing_memory(timing, turbo=False, on_gpu=False) == expected(256, 1)
    weights = estimate_worker_memory(files, width=256, height=256, batch=1, on_gpu=False, dtype=computes_in)
    assert timing_memory(timing, turbo=True, on_gpu=False) == expected(256, 1) + weights.weight_bytes


def test_a_set_memory_wins_and_remote_model_files_ask_for_none(tiny_models: Path) -> None:
    """The door's own figure wins over the estimate; model files on s3:// are not fetched to estimate."""
    from snapref_ray.model_spec import ModelSpec
    from snapref_ray.render_service.memory_estimate import memory_request

    local = ModelSpec(models_dir=str(tiny_models))
    assert memory_request(local, width=256, height=256, batch=2, on_gpu=False, override=123) == (123, None)
    remote = ModelSpec(models_dir="s3://bucket/models")
    assert memory_request(remote, width=256, height=256, batch=2, on_gpu=False) == (0, None)
