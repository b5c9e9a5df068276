"""Connecting to Ray and creating render workers: what a job asks for, not what happens to be there.

A job on a cluster asks for GPU workers (`num_gpus=1` each) whether or not a GPU node is up yet:
a pending actor is what makes Ray's autoscaler add a GPU node. Counting the GPUs present at
start (as an earlier version did) makes a cold autoscaling cluster look GPU-less, and the job
then ran CPU workers on whatever node was there. CPU workers are only for `device: cpu`, or for
a local Ray on a machine without GPUs (the demo and the tests).

`WorkerPool` creates actors and reports them as they become ready; it never waits for them: actors still waiting
for a node never block, and each one joins the running schedule the moment its `info()` comes back (a worker whose
node died is restarted by Ray, which makes the autoscaler add a node). When the pool grows and which workers it gives
back is the batch policy's decision (cluster/members.py); the engine core's loop carries it out with these.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import ray

from snapref_ray import ray_console
from snapref_ray.cluster.feasibility import InfeasibilityWatch
from snapref_ray.cluster.tasks import ShardReport, WorkerInfo
from snapref_ray.cluster.worker import RenderWorker, WorkerConfig
from snapref_ray.local_ray import start_local_ray

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolShape:
    """What the job spec says about workers (`ClusterSpec`)."""

    num_workers: int | None = None  # exactly N (min = max = N)
    cpu_workers: int = 2  # workers of a CPU job when max_workers is not given
    num_cpus_per_worker: float = 1.0
    # Ray retries a call once on a restarted actor (this also lets lineage rebuild a lost RefKV);
    # the scheduler's own per-item attempt cap bounds poison items.
    max_task_retries: int = 1
    min_workers: int = 1
    max_workers: int | None = None


@dataclass(frozen=True)
class PoolPlan:
    """The resolved pool: GPU or CPU workers, and how many (start at min, grow up to max)."""

    use_gpu: bool
    min_workers: int
    max_workers: int
    num_cpus_per_worker: float = 1.0
    max_task_retries: int = 1
    memory_bytes: int = 0  # host memory each worker asks Ray for (0: none)


def on_a_cluster(address: str | None) -> bool:
    """Whether the job joins an existing cluster (an address, or RAY_ADDRESS as under `ray job submit`)."""
    return bool(address or os.environ.get("RAY_ADDRESS"))


def plan_pool(shape: PoolShape, device: str, *, on_cluster: bool, gpus_now: int) -> PoolPlan:
    """GPU workers for `cuda`, and for `auto` on a cluster (the autoscaler brings the GPUs) or on a
    local machine that has GPUs; CPU workers otherwise.

    Without `max_workers`: a GPU pool is as large as the GPUs present now (at least min_workers,
    at least 1), so on an autoscaling cluster set `max_workers` to the size you want; a CPU pool
    has `cpu_workers`.
    """
    if device == "cpu":
        use_gpu = False
    elif device == "auto" and not on_cluster:
        use_gpu = gpus_now > 0
    else:
        use_gpu = True
    if shape.num_workers is not None:
        low = high = shape.num_workers
    else:
        default = max(gpus_now, 1) if use_gpu else shape.cpu_workers
        high = shape.max_workers if shape.max_workers is not None else max(default, shape.min_workers)
        low = min(shape.min_workers, high)
    return PoolPlan(use_gpu, low, high, shape.num_cpus_per_worker, shape.max_task_retries)


class WorkerDoesNotFit(ValueError):
    """No node of the Ray the job runs on can hold one worker's memory request."""


def check_memory_fits(plan: PoolPlan, *, on_cluster: bool) -> None:
    """A worker that fits on no node of a local Ray is an error before anything starts; on a cluster it is a
    warning (the autoscaler may add a larger node), and `start_timeout_s` ends the wait."""
    if not plan.memory_bytes:
        return
    offered = [node["Resources"].get("memory", 0) for node in ray.nodes() if node["Alive"]]
    if any(memory >= plan.memory_bytes for memory in offered):
        return
    gib = 2**30
    message = (
        f"a worker asks for {plan.memory_bytes / gib:.2f} GiB of memory, and the largest node offers"
        f" {max(offered, default=0) / gib:.2f} GiB (Ray's `memory` resource)"
    )
    if not on_cluster:
        raise WorkerDoesNotFit(
            message + ": lower cluster.memory_per_worker, max_batch or the image size, or run on a larger machine"
        )
    log.warning("%s; waiting for the autoscaler to add a node that fits", message)


def connect(address: str | None = None, *, num_cpus: int | None = None, num_gpus: int | None = None) -> None:
    """Join the given cluster (or RAY_ADDRESS, as under `ray job submit`), else start Ray locally."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        start_local_ray(num_cpus=num_cpus, num_gpus=num_gpus)
    ray_console.install()  # Ray's process output: the terminal, or the job's log (snapref_ray/ray_console.py)


def gpus_in_cluster() -> int:
    return int(ray.cluster_resources().get("GPU", 0))


class WorkerPool:
    """Creates RenderWorker actors and hands them over as their `info()` comes back.

    Actors that wait for resources (a GPU node the autoscaler is still launching) stay in
    `starting` without blocking anyone; the schedule waits on `starting_futures()` together with
    its render calls. Every actor is created with `max_restarts=-1`: a worker whose process or
    node dies is restarted by Ray wherever a GPU is free (the autoscaler adds a node if none is).
    """

    def __init__(
        self, config: WorkerConfig, plan: PoolPlan, renderer_factory: Callable[[WorkerConfig], object] | None = None
    ) -> None:
        self.config, self.plan, self.renderer_factory = config, plan, renderer_factory
        self._actor = ray.remote(RenderWorker).options(
            num_gpus=1 if plan.use_gpu else 0,
            num_cpus=plan.num_cpus_per_worker,
            max_restarts=-1,
            max_task_retries=plan.max_task_retries,
            max_concurrency=2,
            **({"memory": plan.memory_bytes} if plan.memory_bytes else {}),
        )
        self.starting: dict[ray.ObjectRef, ray.actor.ActorHandle] = {}
        self.launched = 0
        self.start_failures: list[str] = []
        # Until a worker starts, Ray's report that no node type can hold one ends the wait (cluster/feasibility.py).
        asked = {"CPU": plan.num_cpus_per_worker, "GPU": 1 if plan.use_gpu else 0, "memory": plan.memory_bytes}
        self.feasibility: InfeasibilityWatch | None = InfeasibilityWatch(asked)

    def launch(self, count: int) -> None:
        for _ in range(count):
            handle = self._actor.remote(self.config, self.renderer_factory)
            self.starting[handle.info.remote()] = handle
            self.launched += 1
        if count:
            log.info(
                "asked Ray for %d more %s worker(s) (%d starting)",
                count,
                "GPU" if self.plan.use_gpu else "CPU",
                len(self.starting),
            )

    def starting_futures(self) -> list[ray.ObjectRef]:
        if self.feasibility is not None and self.starting:
            self.feasibility.check()  # raises WorkerCannotBePlaced once Ray reported the request infeasible
        return list(self.starting)

    def ready(self, future: ray.ObjectRef) -> tuple[ray.actor.ActorHandle, WorkerInfo | None]:
        """The actor whose `info()` came back, and its info (None when it failed to start: its
        constructor raised, e.g. a model that does not load; the actor is killed)."""
        handle = self.starting.pop(future)
        try:
            info: WorkerInfo = ray.get(future, timeout=0)
        except Exception as e:
            self.start_failures.append(f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
            log.error("a worker failed to start: %s", self.start_failures[-1])
            kill(handle)
            return handle, None
        if self.feasibility is not None:  # a worker fits: the cluster can hold the request
            self.feasibility.stop()
            self.feasibility = None
        log.info("worker %s ready on %s (load %.1f s)", info.worker_id, info.device, info.load_seconds)
        return handle, info

    def cancel_starting(self) -> int:
        """Kill the actors that are not ready yet (no work is left for them); returns how many."""
        count = len(self.starting)
        for handle in self.starting.values():
            kill(handle)
        self.starting.clear()
        if self.feasibility is not None:  # nothing is waited for any more
            self.feasibility.stop()
            self.feasibility = None
        return count


def kill(handle: ray.actor.ActorHandle) -> None:
    """Kill an actor for good (its model and device cache go, its resources go back to Ray)."""
    try:
        ray.kill(handle, no_restart=True)
    except Exception as e:
        log.debug("could not kill worker: %s", e)


RELEASE_PUBLISH_TIMEOUT_S = 600.0  # a ~1 GB webdataset shard's upload, with room


def release(handles: Sequence[ray.actor.ActorHandle], *, publish: bool = True) -> list[ShardReport | None]:
    """Kill healthy workers the job no longer needs, with `publish` once each has staged what it holds (its open
    webdataset shard: storage/shards.py); a worker that cannot is killed anyway. Returns, per handle, the shards it
    reported closed (None: it staged nothing, or could not; the caller's `ShardLedger` then gives that worker's
    open shard back to render again, and a shard it staged after all is voided when the run ends). Without shards
    there is nothing to publish, and the driver's loop does not wait on the workers."""
    reports: list[ShardReport | None] = [None] * len(handles)
    pending: dict[ray.ObjectRef, int] = {}
    for i, handle in enumerate(handles) if publish else ():
        try:
            pending[handle.publish_outputs.remote()] = i
        except AttributeError:
            pass  # an actor that writes no outputs of its own (the scheduler's test doubles)
    if pending:
        ready, late = ray.wait(list(pending), num_returns=len(pending), timeout=RELEASE_PUBLISH_TIMEOUT_S)
        for ref in ready:
            try:
                reports[pending[ref]] = ray.get(ref)
            except Exception as e:  # a dead worker, a store that refuses the shard
                log.warning("a released worker did not stage its open shard: %s", e)
        if late:
            log.warning("%d released worker(s) did not stage within %.0f s", len(late), RELEASE_PUBLISH_TIMEOUT_S)
    for handle in handles:
        kill(handle)
    return reports


def start_workers(
    config: WorkerConfig,
    shape: PoolShape,
    renderer_factory: Callable[[WorkerConfig], object] | None = None,
    ready_timeout_s: float = 900.0,
    *,
    on_cluster: bool = False,
    memory_bytes: Callable[[bool], int] | None = None,
) -> tuple[list, list[WorkerInfo]]:
    """A fixed pool of `max_workers` actors, waited for until each is ready (for jobs without an
    elastic schedule, e.g. the identity evaluation). `memory_bytes(use_gpu)`: the host memory each asks Ray for."""
    plan = plan_pool(shape, config.model.device, on_cluster=on_cluster, gpus_now=gpus_in_cluster())
    memory = memory_bytes(plan.use_gpu) if memory_bytes else 0
    actor = ray.remote(RenderWorker).options(
        num_gpus=1 if plan.use_gpu else 0,
        num_cpus=plan.num_cpus_per_worker,
        max_restarts=-1,
        max_task_retries=plan.max_task_retries,
        max_concurrency=2,
        **({"memory": memory} if memory else {}),
    )
    handles = [actor.remote(config, renderer_factory) for _ in range(plan.max_workers)]
    try:
        infos = ray.get([h.info.remote() for h in handles], timeout=ready_timeout_s)
    except BaseException:
        # A model that does not load (constructor errors are never retried) or a timeout: do not
        # leave the other workers holding their GPUs.
        for h in handles:
            kill(h)
        raise
    log.info(
        "%d %s worker(s) ready: %s",
        len(handles),
        "GPU" if plan.use_gpu else "CPU",
        ", ".join(f"{i.worker_id} on {i.device} (load {i.load_seconds:.1f} s)" for i in infos),
    )
    return handles, infos
