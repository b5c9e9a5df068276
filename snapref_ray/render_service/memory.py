"""How many images one forward may hold at a resolution: measured memory, for every device and front door.

Per (width, height, rows per image, whether rows read a reference) a renderer measures, once:

1. the peak of **one image**: a one-step render of one image (the DiT at that size, its attention
   workspace, one VAE decode), above what the process held before;
2. the peak of **the first real batch** it then runs at that key, which splits the one-image peak into
   what each further image adds (the DiT's activations, its latent) and what is paid once (one decode:
   the VAE decodes image by image, models/vae.py).

The batch that fits is what is available less a safety margin, divided by those figures, capped at the
batch asked for. "Available" is, on a GPU, the device's free memory plus what torch's caching allocator
holds unused; on the CPU, the process's memory budget (the `memory=` it asked Ray for, when it did)
less its resident set, bounded by what the machine (or the cgroup) has free. CPU peaks are the
process's peak resident set (Linux's VmHWM, reset before each measurement).

Job workers, Serve replicas, Ray Data actors and the CLI all render through one `RenderService`, which
owns one `MemoryFit`; its `report()` is what they publish (worker info, summary.json, /v1/models).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from snapref_ray.models.device_memory import available_memory_bytes, total_memory_bytes
from snapref_ray.requests import RenderError

log = logging.getLogger(__name__)

MAX_BATCH = 256  # a bound for the report; the batch asked for caps each render anyway
SAFETY_FRACTION = 0.85  # of what is available: fragmentation, kernels' workspaces, the RefKV cache growing
T = TypeVar("T")


class RenderOutOfMemory(RenderError):
    """One image does not fit the device: the message names its size, the device and the memory figures."""


@dataclass(frozen=True)
class FitKey:
    """What a forward's memory depends on, besides the batch."""

    width: int
    height: int
    rows_per_image: int  # CFG rows (+ the reference-guidance row)
    reads_reference: bool


@dataclass(frozen=True)
class BatchLimit:
    """What a renderer chose for one `FitKey`, and the figures behind it."""

    width: int
    height: int
    rows_per_image: int
    reads_reference: bool
    image_peak_bytes: int  # one image, one step: the probe
    per_image_bytes: int  # what each image of a batch adds (the probe's figure until a batch is measured)
    available_bytes: int  # what the renderer may use above its resident state, when the figures were taken
    batch: int  # images per forward that fit (before the request's own max_batch caps it)
    batch_peak_bytes: int | None = None  # the first measured batch's peak ...
    measured_batch: int | None = None  # ... and its size
    out_of_memory_cap: int | None = None  # a forward of more images than this ran out of memory


def largest_batch(
    available_bytes: int, image_peak_bytes: int, per_image_bytes: int, safety_fraction: float = SAFETY_FRACTION
) -> int:
    """Images per forward that fit: one image's peak, plus `per_image_bytes` per further image, within
    `safety_fraction` of `available_bytes`; at least 1, at most MAX_BATCH."""
    usable = int(available_bytes * safety_fraction)
    if image_peak_bytes <= 0 or per_image_bytes <= 0:
        return MAX_BATCH
    return max(1, min(MAX_BATCH, 1 + (usable - image_peak_bytes) // per_image_bytes))


class DeviceMemory:
    """The two figures the fit needs from a device."""

    kind = "device"

    def measure(self, fn: Callable[[], T]) -> tuple[T, int]:
        """fn's result, and the peak bytes it allocated above what was held before it ran."""
        raise NotImplementedError

    def available_bytes(self) -> int:
        raise NotImplementedError


class CudaMemory(DeviceMemory):
    kind = "cuda"

    def __init__(self, device) -> None:
        self.device = device

    def measure(self, fn: Callable[[], T]) -> tuple[T, int]:
        import torch

        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        result = fn()
        torch.cuda.synchronize(self.device)
        return result, torch.cuda.max_memory_allocated(self.device) - before

    def available_bytes(self) -> int:
        # The driver's free memory plus the blocks torch's caching allocator holds unused.
        return available_memory_bytes(self.device)


class HostMemory(DeviceMemory):
    """The CPU: this process's resident set against its budget and the machine's free memory."""

    kind = "cpu"

    def __init__(self, budget_bytes: int | None = None) -> None:
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()  # the peak counter is per process: one measurement at a time

    def measure(self, fn: Callable[[], T]) -> tuple[T, int]:
        with self._lock:
            before = resident_bytes()
            if reset_peak_resident():
                result = fn()
                return result, max(0, peak_resident_bytes() - before)
            return _sampled_peak(fn, before)

    def available_bytes(self) -> int:
        free = machine_available_bytes()
        if self.budget_bytes is None:
            return free
        return max(0, min(free, self.budget_bytes - resident_bytes()))


class MemoryFit:
    """Per-`FitKey` batch limits of one renderer (see the module docstring)."""

    def __init__(self, memory: DeviceMemory) -> None:
        self.memory = memory
        self.limits: dict[FitKey, BatchLimit] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_device(cls, device, budget_bytes: int | None = None) -> MemoryFit:
        if getattr(device, "type", str(device)) == "cuda":
            return cls(CudaMemory(device))
        return cls(HostMemory(budget_bytes))

    def limit(self, key: FitKey, requested: int, probe: Callable[[], Any]) -> int:
        """The batch to render at `key`; `probe` renders one image for one step (called once per key)."""
        if requested <= 1:
            return requested  # nothing to choose; the first batch of more images measures the figures
        with self._lock:
            if key not in self.limits:
                t0 = time.perf_counter()
                _, peak = self.memory.measure(probe)
                available = self.memory.available_bytes()
                batch = largest_batch(available, peak, peak)
                self.limits[key] = BatchLimit(
                    key.width, key.height, key.rows_per_image, key.reads_reference, peak, peak, available, batch
                )
                log.info(
                    "batch at %dx%d (%d rows per image%s): %d image(s) fit (one image %.2f GiB; %.1f GiB"
                    " available on %s; probed in %.1f s)",
                    key.width,
                    key.height,
                    key.rows_per_image,
                    ", reading a reference" if key.reads_reference else "",
                    batch,
                    peak / 2**30,
                    available / 2**30,
                    self.memory.kind,
                    time.perf_counter() - t0,
                )
            return min(requested, self.limits[key].batch)

    def run(self, key: FitKey, batch: int, fn: Callable[[], T]) -> T:
        """Run one forward of `batch` images at `key`; the first batch of more than one image there is
        measured, and the limit refined from it."""
        limit = self.limits.get(key)
        if limit is None or batch <= 1 or limit.measured_batch is not None:
            return fn()
        with self._lock:
            result, peak = self.memory.measure(fn)
            per_image = max(1, (peak - limit.image_peak_bytes) // (batch - 1))
            refined = largest_batch(limit.available_bytes, limit.image_peak_bytes, per_image)
            if limit.out_of_memory_cap is not None:
                refined = min(refined, limit.out_of_memory_cap)
            self.limits[key] = dataclasses.replace(
                limit, per_image_bytes=per_image, batch=refined, batch_peak_bytes=peak, measured_batch=batch
            )
            log.info(
                "batch at %dx%d: %d images peaked at %.2f GiB (%.2f GiB per further image): %d fit",
                key.width,
                key.height,
                batch,
                peak / 2**30,
                per_image / 2**30,
                refined,
            )
            return result

    def cap(self, key: FitKey, batch: int) -> None:
        """At most `batch` images per forward at `key` from now on (a forward of more ran out of memory)."""
        with self._lock:
            limit = self.limits.get(key)
            if limit is None:
                available = self.memory.available_bytes()
                limit = BatchLimit(
                    key.width, key.height, key.rows_per_image, key.reads_reference, 0, 0, available, batch
                )
            self.limits[key] = dataclasses.replace(limit, batch=min(limit.batch, batch), out_of_memory_cap=batch)

    def report(self) -> list[dict]:
        """The limits chosen so far, as plain dicts (worker info, summary.json, /v1/models)."""
        return [{"device": self.memory.kind, **dataclasses.asdict(limit)} for limit in self.limits.values()]


def describe_device_memory(device) -> str:
    """The memory figures a person needs to see why an image did not fit: for CUDA the device's total and free
    memory and what torch allocated, reserved and peaked at; for the CPU the host's (or cgroup's) total and
    what is available. '' when they cannot be read (figures are a courtesy; the error must still be told)."""
    gib = 2**30
    try:
        if getattr(device, "type", str(device)) == "cuda":
            import torch

            free, total = torch.cuda.mem_get_info(device)
            allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
            peak = torch.cuda.max_memory_allocated(device)
            return (
                f"device {total / gib:.2f} GiB total, {free / gib:.2f} GiB free; torch allocated "
                f"{allocated / gib:.2f} GiB, reserved {reserved / gib:.2f} GiB, peak {peak / gib:.2f} GiB"
            )
        return (
            f"host {machine_total_bytes() / gib:.2f} GiB total, {machine_available_bytes() / gib:.2f} GiB available,"
            f" this process {resident_bytes() / gib:.2f} GiB resident"
        )
    except Exception:
        return ""


# ---------------------------------------------------------------------------------------------
# The host's figures (Linux /proc and cgroups; elsewhere the best approximation there is)


def resident_bytes() -> int:
    """This process's resident set size."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_resident_bytes() -> int:
    """This process's peak resident set since it started or since the last reset (Linux VmHWM)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_resident() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _sampled_peak(fn: Callable[[], T], before: int) -> tuple[T, int]:
    """fn's peak RSS by sampling every 5 ms (where the peak counter cannot be reset)."""
    peak = [before]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.005):
            peak[0] = max(peak[0], resident_bytes())

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        result = fn()
    finally:
        stop.set()
        thread.join()
    return result, max(0, max(peak[0], resident_bytes()) - before)


def machine_available_bytes() -> int:
    """What the machine can still give this process: MemAvailable, bounded by its cgroup (models/device_memory.py)."""
    return available_memory_bytes("cpu")


def machine_total_bytes() -> int:
    """The machine's memory, or the cgroup's limit when that is lower."""
    return total_memory_bytes()
