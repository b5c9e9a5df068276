"""The largest batch a GPU worker can render at a resolution, from a measured memory model.

Per (width, height, rows per image) the worker renders one image for one step once and
records how much device memory that took above what was already allocated (activations,
attention workspace, the VAE decode: everything that grows with the batch). The memory model
is linear in the batch — a forward's activations and the decode are per row — so the batch
that fits is what is free (the device's free memory plus what torch's caching allocator holds
unused) less a safety margin, divided by that per-image figure, capped at the job's max_batch.

On the CPU nothing is probed: the job's max_batch is used as before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

MAX_BATCH = 256  # a bound for the report; a job's max_batch caps each request anyway
SAFETY_FRACTION = 0.85  # of the free memory: fragmentation, kernels' workspaces, the RefKV cache growing


@dataclass(frozen=True)
class BatchLimit:
    """What a worker chose for one resolution, and why (reported by `RenderWorker.batch_limits`)."""

    width: int
    height: int
    rows_per_image: int
    per_image_bytes: int
    free_bytes: int
    batch: int  # images per forward that fit (before the job's max_batch caps a request)


def largest_batch(
    free_bytes: int, per_image_bytes: int, requested: int, safety_fraction: float = SAFETY_FRACTION
) -> int:
    """Images per forward: as many as fit in `safety_fraction` of `free_bytes`, at least 1, at most `requested`."""
    if per_image_bytes <= 0:
        return requested
    return max(1, min(requested, int(free_bytes * safety_fraction) // per_image_bytes))


class BatchFitter:
    """Per-resolution batch limits of one worker (see the module docstring)."""

    def __init__(self, device, memory: DeviceMemory | None = None) -> None:
        self.device = device
        self.memory = (
            memory if memory is not None else (CudaMemory(device) if getattr(device, "type", "") == "cuda" else None)
        )
        self.limits: dict[tuple[int, int, int], BatchLimit] = {}

    def limit(self, width: int, height: int, rows_per_image: int, requested: int, probe: Callable[[], None]) -> int:
        """The batch to render; `probe` renders one image for one step (called once per key, on a GPU)."""
        if self.memory is None:
            return requested
        key = (width, height, rows_per_image)
        if key not in self.limits:
            t0 = time.perf_counter()
            per_image = self.memory.measure(probe)
            free = self.memory.free_bytes()
            fits = largest_batch(free, per_image, MAX_BATCH)
            self.limits[key] = BatchLimit(width, height, rows_per_image, per_image, free, fits)
            log.info(
                "batch at %dx%d (%d rows per image): %d images fit (%.2f GiB per image, %.1f GiB free;"
                " probed in %.1f s)",
                width,
                height,
                rows_per_image,
                fits,
                per_image / 2**30,
                free / 2**30,
                time.perf_counter() - t0,
            )
        return min(requested, self.limits[key].batch)


class DeviceMemory:
    """The two numbers the fitter needs from a device."""

    def measure(self, fn: Callable[[], None]) -> int:  # peak bytes fn allocated above the bytes allocated before
        raise NotImplementedError

    def free_bytes(self) -> int:
        raise NotImplementedError


class CudaMemory(DeviceMemory):
    def __init__(self, device) -> None:
        self.device = device

    def measure(self, fn: Callable[[], None]) -> int:
        import torch

        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        fn()
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - before

    def free_bytes(self) -> int:
        import torch

        free, _total = torch.cuda.mem_get_info(self.device)
        # Blocks torch's caching allocator holds but does not use are free to this process.
        return free + torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)


__all__ = ["BatchFitter", "BatchLimit", "CudaMemory", "DeviceMemory", "largest_batch"]
