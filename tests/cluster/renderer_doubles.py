"""`renderer_factory` test doubles for real RenderWorkers: the real tiny Renderer, with one failure added.

They are picklable factories (frozen dataclasses), so a job hands them to its workers on any node; the
workers import this module from the checkout (PYTHONPATH, tests/cluster/conftest.py and
benchmarks/fake_cluster.py). Everything but the failure is the real renderer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from snapref_ray.cluster.worker import WorkerConfig, load_worker_renderer


class _Wrapped:
    """Forwards everything to the real renderer; subclasses decide what `render` does first."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _OutOfMemoryRenderer(_Wrapped):
    def __init__(self, inner, most_images: dict[tuple[int, int], int]) -> None:
        super().__init__(inner)
        self._most = most_images

    def render(self, requests, **kwargs):
        s = requests[0].settings
        most = self._most.get((s.width, s.height))
        if most is not None and len(requests) > most:
            # The text torch's CUDA allocator raises, with the sizes of this double's "device".
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {len(requests) * 1.5:.2f} GiB. GPU 0 has a total capacity "
                f"of 79.19 GiB of which 1.06 GiB is free. ({len(requests)} images of {s.width}x{s.height}; at most "
                f"{most} fit on this test double)"
            )
        return self._inner.render(requests, **kwargs)


@dataclass(frozen=True)
class OutOfMemoryAbove:
    """The real renderer, whose `render` raises `torch.OutOfMemoryError` for more than N images of a size.

    `most_images`: ((width, height, N), ...); sizes not listed never run out. The worker's warm-up renders one
    256x256 image, so give that size N >= 1."""

    most_images: tuple[tuple[int, int, int], ...]

    def __call__(self, config: WorkerConfig):
        return _OutOfMemoryRenderer(load_worker_renderer(config), {(w, h): n for w, h, n in self.most_images})


class _PoisonRenderer(_Wrapped):
    def __init__(self, inner, marker: str) -> None:
        super().__init__(inner)
        self._marker = marker

    def render(self, requests, **kwargs):
        poisoned = [r.prompt for r in requests if self._marker in r.prompt]
        if poisoned:
            raise FloatingPointError(f"NaN in the sampled latents of {poisoned[0]!r}")
        return self._inner.render(requests, **kwargs)


@dataclass(frozen=True)
class PoisonPrompt:
    """The real renderer, whose `render` raises for any batch holding a prompt that contains `marker` (an item
    whose own render fails every time, as a NaN or a model exception would)."""

    marker: str

    def __call__(self, config: WorkerConfig):
        return _PoisonRenderer(load_worker_renderer(config), self.marker)


@dataclass(frozen=True)
class ExitAfterStagingAShard:
    """The real renderer, in a worker that exits (`os._exit`, as a kill would) right after it staged its first full
    webdataset shard inside a render call, before that call answers: the window in which a shard exists that the
    driver never hears of. Once per job: the `marker` file (created as it exits) keeps the restarted actor alive."""

    marker: str

    def __call__(self, config: WorkerConfig):
        import os
        from pathlib import Path

        from snapref_ray.storage import shards

        marker = Path(self.marker)
        stage = shards.ShardWriter._stage

        def stage_then_exit(writer, shard) -> None:
            stage(writer, shard)
            if not marker.exists():
                marker.write_text(shard.key)
                os._exit(1)

        shards.ShardWriter._stage = stage_then_exit  # this worker process only
        return load_worker_renderer(config)


@dataclass(frozen=True)
class SlowStaging:
    """The real renderer, in a worker whose first webdataset staging of the job takes `seconds` longer (a slow
    store, a 1 GB upload): a release that gives up waiting kills it while it still stages. Once per job (the
    `marker` file)."""

    seconds: float
    marker: str

    def __call__(self, config: WorkerConfig):
        import time
        from pathlib import Path

        from snapref_ray.storage import shards

        stage = shards.ShardWriter._stage
        marker = Path(self.marker)

        def slow_stage(writer, shard) -> None:
            if not marker.exists():
                marker.write_text(shard.key)
                time.sleep(self.seconds)
            stage(writer, shard)

        shards.ShardWriter._stage = slow_stage  # this worker process only
        return load_worker_renderer(config)
