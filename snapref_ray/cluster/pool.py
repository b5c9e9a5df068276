"""Starting Ray and the render workers: one per GPU, or a few CPU workers where there is none."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import ray

from snapref_ray.cluster.tasks import WorkerInfo
from snapref_ray.cluster.worker import RenderWorker, WorkerConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolShape:
    num_workers: int | None = None  # None: one per GPU, else cpu_workers
    cpu_workers: int = 2
    num_cpus_per_worker: float = 1.0
    # Ray retries a call once on a restarted actor (this also lets lineage rebuild a lost RefKV);
    # the scheduler's own per-item attempt cap bounds poison items.
    max_task_retries: int = 1


def connect(address: str | None = None, *, num_cpus: int | None = None, num_gpus: int | None = None) -> None:
    """Join the given cluster (or RAY_ADDRESS, as under `ray job submit`), else start Ray locally."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        # "local" never attaches to a stale cluster left by an unclean exit (ray-notes.md).
        ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False,
                 log_to_driver=True)


def start_workers(config: WorkerConfig, shape: PoolShape,
                  renderer_factory: Callable[[WorkerConfig], object] | None = None,
                  ready_timeout_s: float = 900.0) -> tuple[list, list[WorkerInfo]]:
    """Create the worker actors and wait until each has loaded its model and warmed up."""
    gpus = int(ray.cluster_resources().get("GPU", 0))
    use_gpu = gpus > 0 and config.device != "cpu"
    count = shape.num_workers or (gpus if use_gpu else shape.cpu_workers)
    actor = ray.remote(RenderWorker).options(
        num_gpus=1 if use_gpu else 0, num_cpus=shape.num_cpus_per_worker, max_restarts=-1,
        max_task_retries=shape.max_task_retries, max_concurrency=2)
    handles = [actor.remote(config, renderer_factory) for _ in range(count)]
    try:
        infos = ray.get([h.info.remote() for h in handles], timeout=ready_timeout_s)
    except BaseException:
        # A model that does not load (constructor errors are never retried) or a timeout: do not
        # leave the other workers holding their GPUs.
        for h in handles:
            ray.kill(h, no_restart=True)
        raise
    log.info("%d %s worker(s) ready: %s", count, "GPU" if use_gpu else "CPU",
             ", ".join(f"{i.worker_id} on {i.device} (load {i.load_seconds:.1f} s)" for i in infos))
    return handles, infos
