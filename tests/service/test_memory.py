"""Batch selection on a GPU worker, against a linear device-memory model (no GPU needed)."""

from __future__ import annotations

import torch

from snapref_ray.cluster.batch_fit import BatchFitter, DeviceMemory, largest_batch

GiB = 2**30


class LinearMemory(DeviceMemory):
    """A device whose render of one image needs `per_image` bytes on top of `free` free bytes."""

    def __init__(self, free: int, per_image: int) -> None:
        self.free, self.per_image, self.probes = free, per_image, 0

    def measure(self, fn):
        fn()
        self.probes += 1
        return self.per_image

    def free_bytes(self):
        return self.free


def test_largest_batch_keeps_a_margin_and_bounds():
    assert largest_batch(100 * GiB, 10 * GiB, requested=64) == 8  # 85 GiB usable / 10 GiB
    assert largest_batch(100 * GiB, 10 * GiB, requested=4) == 4  # the job's max_batch caps it
    assert largest_batch(5 * GiB, 10 * GiB, requested=4) == 1  # never below one image
    assert largest_batch(100 * GiB, 0, requested=3) == 3  # nothing measured: as asked


def test_fitter_probes_once_per_resolution_and_rows():
    memory = LinearMemory(free=120 * GiB, per_image=12 * GiB)
    fitter = BatchFitter(torch.device("cuda"), memory)
    calls = []
    probe = lambda: calls.append(1)  # noqa: E731
    assert fitter.limit(832, 1216, 2, requested=16, probe=probe) == 8  # 102 GiB // 12 GiB
    assert fitter.limit(832, 1216, 2, requested=4, probe=probe) == 4
    memory.per_image = 30 * GiB  # a bigger size / more rows: its own probe
    assert fitter.limit(1024, 1024, 3, requested=16, probe=probe) == 3
    assert len(calls) == memory.probes == 2
    assert {(k, v.batch) for k, v in fitter.limits.items()} == {((832, 1216, 2), 8), ((1024, 1024, 3), 3)}


def test_cpu_worker_keeps_the_requested_batch_and_never_probes():
    fitter = BatchFitter(torch.device("cpu"))

    def probe():
        raise AssertionError("a CPU worker must not probe")

    assert fitter.limit(256, 256, 2, requested=4, probe=probe) == 4 and fitter.limits == {}


class RecordingRenderer:
    """Renders nothing: returns one marker per request and records each forward's size."""

    def __init__(self) -> None:
        self.device = torch.device("cuda")  # only its type is read
        self.forwards: list[int] = []

    def render(self, requests, refkv=None):
        self.forwards.append(len(requests))
        return [r.prompt for r in requests]


def test_worker_renders_in_chunks_of_the_fitted_batch_and_reports_it():
    from snapref_ray.cluster.worker import RenderWorker
    from snapref_ray.requests import RenderRequest, RenderSettings

    worker = RenderWorker.__new__(RenderWorker)  # no Ray, no model: only the chunking is under test
    worker.renderer = RecordingRenderer()
    memory = LinearMemory(free=40 * GiB, per_image=12 * GiB)  # 34 GiB usable: 2 images per forward
    worker.batch_fit = BatchFitter(worker.renderer.device, memory)
    settings = RenderSettings(width=832, height=1216, cfg=4.5)
    requests = [RenderRequest(prompt=f"p{i}", seed=i, settings=settings) for i in range(5)]

    results, forward_batches = worker._render_fitted(requests, kv=None)

    assert results == [f"p{i}" for i in range(5)]  # in order
    assert worker.renderer.forwards == [1, 2, 2, 1]  # the probe (one image), then chunks of 2
    assert forward_batches == [2, 2, 2, 2, 1]
    assert [limit["batch"] for limit in worker.batch_limits()] == [2]
