"""The memory fit: batch selection against device-memory models, the host's real peak RSS, and what the
render service does with it (forwards cut to the batch that fits; a forward that runs out of memory split)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from PIL import Image

from snapref_ray.engine import RenderResult
from snapref_ray.render_service.memory import FitKey, HostMemory, MemoryFit, RenderOutOfMemory, largest_batch
from snapref_ray.render_service.service import RenderService
from snapref_ray.requests import RenderRequest, RenderSettings

GiB = 2**30
KEY = FitKey(832, 1216, 2, True)


class LinearMemory:
    """A device on which one image's render needs `image_peak` bytes and each further one `per_image`."""

    kind = "fake"

    def __init__(self, available: int, image_peak: int, per_image: int | None = None) -> None:
        self.available, self.image_peak = available, image_peak
        self.per_image = per_image if per_image is not None else image_peak
        self.measured: list[int] = []

    def measure(self, fn):
        result = fn()
        n = len(result) if isinstance(result, list) else 1
        self.measured.append(n)
        return result, self.image_peak + (n - 1) * self.per_image

    def available_bytes(self):
        return self.available


def test_largest_batch_keeps_a_margin_and_bounds():
    assert largest_batch(100 * GiB, 10 * GiB, 10 * GiB) == 8  # 85 GiB usable: 10 + 7 x 10
    assert largest_batch(100 * GiB, 40 * GiB, 5 * GiB) == 10  # one decode paid once, 5 GiB per further image
    assert largest_batch(5 * GiB, 10 * GiB, 10 * GiB) == 1  # never below one image
    assert largest_batch(100 * GiB, 0, 0) == 256  # nothing measured: bounded only by the report's cap


def test_fit_probes_once_per_key_and_refines_from_the_first_batch():
    memory = LinearMemory(available=120 * GiB, image_peak=12 * GiB, per_image=4 * GiB)
    fit = MemoryFit(memory)
    probes = []
    # The probe knows one image only: 102 GiB usable / 12 GiB per image (the safe assumption).
    assert fit.limit(KEY, 16, probe=lambda: probes.append(1) or ["x"]) == 8
    assert fit.limit(KEY, 4, probe=lambda: probes.append(1)) == 4  # asked for fewer: as asked, no new probe
    # The first real batch of 8 shows 4 GiB per further image: 1 + (102 - 12) // 4 = 23 fit from now on.
    fit.run(KEY, 8, lambda: ["x"] * 8)
    assert fit.limit(KEY, 64, probe=lambda: probes.append(1)) == 23
    fit.run(KEY, 8, lambda: ["x"] * 8)  # measured once per key
    assert len(probes) == 1 and memory.measured == [1, 8]
    (report,) = fit.report()
    assert report["batch"] == 23 and report["image_peak_bytes"] == 12 * GiB and report["per_image_bytes"] == 4 * GiB
    assert report["batch_peak_bytes"] == 40 * GiB and report["measured_batch"] == 8


def test_a_cap_after_an_out_of_memory_holds():
    fit = MemoryFit(LinearMemory(available=120 * GiB, image_peak=12 * GiB))
    assert fit.limit(KEY, 16, probe=lambda: None) == 8
    fit.cap(KEY, 3)
    assert fit.limit(KEY, 16, probe=lambda: None) == 3


_HOST_PROBE = """
import json, numpy as np
from snapref_ray.render_service.memory import HostMemory
memory = HostMemory()

def allocate():
    block = np.ones(300 * 2**20 // 8)  # 300 MiB, touched
    return int(block[-1])

result, peak = memory.measure(allocate)
_, again = memory.measure(lambda: None)
print(json.dumps({"result": result, "peak": peak, "again": again, "available": memory.available_bytes()}))
"""


def test_host_memory_measures_the_real_peak_rss_of_a_call():
    # A fresh process: in this one, memory freed by earlier tests would be reused without growing the RSS
    # (which is right for the fit, whose budget is the process's RSS, but says nothing about the probe).
    out = subprocess.run([sys.executable, "-c", _HOST_PROBE], capture_output=True, text=True, timeout=120, check=True)
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["result"] == 1
    assert 280 * 2**20 < figures["peak"] < 600 * 2**20, figures  # the block, not the process's resident set
    assert figures["again"] < 64 * 2**20  # the peak counter was reset: the earlier block does not count again
    assert figures["available"] > 0


def test_a_memory_budget_bounds_what_is_available():
    budget = HostMemory(budget_bytes=None).available_bytes()
    from snapref_ray.render_service.memory import resident_bytes

    tight = HostMemory(budget_bytes=resident_bytes() + 100 * 2**20)
    assert 50 * 2**20 < tight.available_bytes() <= 100 * 2**20 < budget


class RecordingRenderer:
    """Renders nothing: a blank image per request, each forward's size recorded; out of memory above `fits`."""

    def __init__(self, fits: int | None = None) -> None:
        self.device = torch.device("cuda")  # only its type is read
        self.forwards: list[int] = []
        self.fits = fits
        self.adapter = None

    def resolve(self, settings):
        return settings

    def render(self, requests, *, refkv=None, references=None, layout="single", init_image=None, progress=None):
        self.forwards.append(len(requests))
        if self.fits is not None and len(requests) > self.fits:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")
        return [RenderResult(Image.new("RGB", (8, 8)), r, {"sample_s": 0.0}) for r in requests]


def _service(renderer, memory) -> RenderService:
    service = RenderService.__new__(RenderService)  # no model: only the fitting is under test
    RenderService.__init__(service, renderer)
    service.memory = MemoryFit(memory)
    return service


def _requests(n: int) -> list[RenderRequest]:
    settings = RenderSettings(width=832, height=1216, cfg=4.5)
    return [RenderRequest(prompt=f"p{i}", seed=i, settings=settings) for i in range(n)]


def test_the_service_renders_in_forwards_of_the_fitted_batch_and_reports_it():
    renderer = RecordingRenderer()
    service = _service(renderer, LinearMemory(available=40 * GiB, image_peak=12 * GiB))  # 34 usable: 2 per forward
    rendered = service.render(_requests(5))
    assert [r.request.prompt for r in rendered] == [f"p{i}" for i in range(5)]  # in order
    assert renderer.forwards == [1, 2, 2, 1]  # the probe (one image), then forwards of 2
    assert [r.forward_batch for r in rendered] == [2, 2, 2, 2, 1]
    assert [limit["batch"] for limit in service.memory.report()] == [2]


def test_a_forward_that_runs_out_of_memory_is_split_and_the_smaller_batch_kept():
    renderer = RecordingRenderer(fits=2)
    service = _service(renderer, LinearMemory(available=400 * GiB, image_peak=12 * GiB))  # the fit says 28
    rendered = service.render(_requests(8), max_batch=8)
    assert [r.request.prompt for r in rendered] == [f"p{i}" for i in range(8)]  # every image once, in order
    assert renderer.forwards == [1, 8, 4, 2, 2, 2, 2]  # probe, 8 fails, 4 fails, then forwards of 2
    assert [limit["batch"] for limit in service.memory.report()] == [2]
    renderer.forwards.clear()
    service.render(_requests(4))
    assert renderer.forwards == [2, 2]  # the next render at this size starts at the batch that fit


def test_one_image_that_does_not_fit_names_its_size_device_and_figures():
    service = _service(RecordingRenderer(fits=0), LinearMemory(available=40 * GiB, image_peak=12 * GiB))
    with pytest.raises(RenderOutOfMemory) as caught:
        service.render(_requests(1))
    message = str(caught.value)
    assert "832x1216" in message and "cuda" in message and "CUDA out of memory" in message
    assert caught.value.field == "width"


def test_a_cpu_workers_estimate_holds_its_vae_in_float32_whatever_the_model_dtype(tiny_models) -> None:
    """A CPU worker loads the DiT, text encoder and adapter in its dtype and the VAE in float32 (the dtype the VAE
    runs in on a CPU): the estimate's weight bytes count each file's elements at that size."""
    from safetensors import safe_open

    from snapref_ray.models.bundle import resolve_model_files
    from snapref_ray.render_service.memory_estimate import estimate_worker_memory

    files = resolve_model_files(tiny_models)

    def elements(path) -> int:
        with safe_open(str(path), "pt") as f:
            return sum(torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys())

    others = sum(elements(p) for p in (files.dit, files.text_encoder, files.adapter))
    for dtype, size in (("bfloat16", 2), ("float32", 4)):
        estimate = estimate_worker_memory(files, width=256, height=256, batch=1, on_gpu=False, dtype=dtype)
        assert estimate.weight_bytes == others * size + elements(files.vae) * 4, dtype
