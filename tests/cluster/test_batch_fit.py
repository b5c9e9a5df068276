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
