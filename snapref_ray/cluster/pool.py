"""Connecting to Ray and creating render workers: what a job asks for, not what happens to be there.

A job on a cluster asks for GPU workers (`num_gpus=1` each) whether or not a GPU node is up yet:
a pending actor is what makes Ray's autoscaler add a GPU node. Counting the GPUs present at
start (as an earlier version did) makes a cold autoscaling cluster look GPU-less, and the job
then ran CPU workers on whatever node was there. CPU workers are only for `device: cpu`, or for
a local Ray on a machine without GPUs (the demo and the tests).

`WorkerPool` creates actors and reports them as they become ready; it never waits for them.
`PoolMembers` is the schedule's side of the pool: the workers that joined it, and when to grow, replace and release
them. With a `WorkerPool` the set of workers is elastic (an autoscaling cluster):
- rendering starts as soon as `min_workers` are ready; actors still waiting for a node never block, and each one
  joins the running schedule the moment its `info()` comes back;
- while items are left that no worker has taken, the pool is kept at `max_workers` (a retired worker is replaced; a
  worker whose node died is restarted by Ray, which makes the autoscaler add a node);
- once every remaining item is in flight, idle workers and actors still starting are killed, so the autoscaler can
  remove their nodes, except a worker whose RefKV other workers may still fetch: its node's object store holds the
  primary copy, and releasing the worker would let the autoscaler take the node (and the copy) away.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import ray

from snapref_ray import ray_console
from snapref_ray.cluster.feasibility import InfeasibilityWatch
from snapref_ray.cluster.scheduler_config import SchedulerConfig
from snapref_ray.cluster.scheduler_stats import SchedulerStats
from snapref_ray.cluster.shard_ledger import ShardLedger
from snapref_ray.cluster.tasks import ShardReport, WorkerInfo
from snapref_ray.cluster.worker import RenderWorker, WorkerConfig
from snapref_ray.model_spec import ModelSpec
from snapref_ray.render_service.memory_estimate import estimate_worker_memory

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


def worker_memory(
    model: ModelSpec, *, override: int | None, width: int, height: int, batch: int, use_gpu: bool
) -> tuple[int, dict | None]:
    """(bytes of host memory each worker asks Ray for, the estimate's figures or None).

    `override` (cluster.memory_per_worker) wins; else the estimate from the model files' headers
    (render_service/memory_estimate.py) at the job's largest image and max_batch. Remote (s3://) model files are
    not fetched by the driver for it: without an override such a job asks for no memory, and says so.
    """
    if override is not None:
        return override, None
    if model.is_remote():
        log.info("model files are remote: workers ask Ray for no memory (set cluster.memory_per_worker)")
        return 0, None
    import torch

    dtype = None if model.dtype == "auto" else getattr(torch, model.dtype)
    if model.quantize == "fp8":
        dtype = torch.bfloat16
    estimate = estimate_worker_memory(
        model.local_files(), width=width, height=height, batch=batch, on_gpu=use_gpu, dtype=dtype
    )
    return estimate.total, estimate.report()


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
        # "local" never attaches to a stale cluster left by an unclean exit.
        ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, log_to_driver=True)
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


@dataclass
class Member:
    """A worker of the schedule: its actor, what it answered last, and whether it takes work."""

    handle: ray.actor.ActorHandle
    info: WorkerInfo | None
    available: bool = True  # False while it is probed after losing a call (cluster/recovery.py)
    probe: ray.ObjectRef | None = None
    probe_due: float | None = None  # time.monotonic() at which to send the next probe
    probe_failures: int = 0
    retired: bool = False  # dead for good, or released: never given work again
    released: bool = False  # killed by the schedule because no work was left for it

    @property
    def live(self) -> bool:
        return not self.retired

    @property
    def node_id(self) -> str | None:
        return self.info.node_id if self.info else None


class PoolMembers:
    """The workers a schedule runs on: a fixed set, or those a `WorkerPool` starts as they join; see the module
    docstring for when the pool grows and what it gives back."""

    def __init__(
        self,
        handles: Sequence[ray.actor.ActorHandle],
        infos: Sequence[WorkerInfo | None],
        pool: WorkerPool | None,
        config: SchedulerConfig,
        stats: SchedulerStats,
        commit_shard: Callable[[str], bool] | None = None,
    ) -> None:
        self.members = [Member(h, i) for h, i in zip(handles, infos)]
        self.pool, self.config, self.stats = pool, config, stats
        # Items in the workers' open webdataset shards, committed by the driver (`commit_shard`) once staged; a
        # worker that goes gives its open shard back to render.
        self.shards = ShardLedger(commit_shard)
        self.started = pool is None or pool.plan.min_workers <= len(self.members)
        self._t_run = time.monotonic()

    @property
    def publishes_outputs(self) -> bool:
        """Whether a worker holds outputs to stage before it is released (webdataset shards)."""
        return self.pool is None or self.pool.config.output_format == "webdataset"

    def _released(self, indices: Sequence[int], reports: Sequence[ShardReport | None]) -> None:
        """Released workers' commits go to the ledger; whatever a worker still held open is lost with it."""
        for index, report in zip(indices, reports):
            if report is not None:
                self.shards.report(index, report)
            self.shards.lose(index)

    def start_clock(self) -> None:
        """The job's workers are counted from now (start_timeout_s, seconds_to_start)."""
        self._t_run = time.monotonic()
        self.count()
        if self.started:
            self.stats.seconds_to_start = 0.0

    def live(self) -> int:
        return sum(1 for m in self.members if m.live)

    def takes_work(self, index: int) -> bool:
        member = self.members[index]
        return member.available and member.live

    def starting(self) -> list[ray.ObjectRef]:
        """The `info()` futures of actors still starting: the loop waits on them with its calls."""
        return self.pool.starting_futures() if self.pool else []

    def is_starting(self, future: ray.ObjectRef) -> bool:
        return self.pool is not None and future in self.pool.starting

    def join(self, future: ray.ObjectRef) -> int | None:
        """An actor's `info()` came back: its index among the members, or None when it failed to start."""
        handle, info = self.pool.ready(future)
        if info is None:
            self.stats.worker_start_failures += 1
            return None
        self.members.append(Member(handle, info))
        self.count()
        if not self.started and self.live() >= self.pool.plan.min_workers:
            self.started = True
            self.stats.seconds_to_start = time.monotonic() - self._t_run
            log.info(
                "%d worker(s) ready after %.1f s: rendering starts",
                self.pool.plan.min_workers,
                self.stats.seconds_to_start,
            )
        return len(self.members) - 1

    def count(self) -> None:
        live = sum(1 for m in self.members if m.live and m.info is not None)
        self.stats.workers_started = sum(1 for m in self.members if m.info is not None)
        self.stats.peak_workers = max(self.stats.peak_workers, live)

    def scale(self, unassigned_work: bool, keep: Callable[[int], bool]) -> list[int]:
        """Keep the pool at max_workers while unassigned work exists; once none does, release the idle workers that
        `keep(index)` does not hold back. Returns the indices released."""
        if self.pool is None:
            return []
        plan = self.pool.plan
        if not self.started and time.monotonic() - self._t_run > self.config.start_timeout_s:
            raise TimeoutError(
                f"only {sum(1 for m in self.members if m.live and m.info)} of min_workers={plan.min_workers} "
                f"{'GPU' if plan.use_gpu else 'CPU'} worker(s) ready after {self.config.start_timeout_s:.0f} s; "
                f"can the cluster provide {'a GPU' if plan.use_gpu else 'a CPU slot'} per worker? "
                f"(start failures: {self.pool.start_failures[-1:] or 'none'})"
            )
        if unassigned_work:
            live = self.live()
            missing = plan.max_workers - live - len(self.pool.starting)
            if len(self.pool.start_failures) >= self.config.max_start_failures:
                if live == 0 and not self.pool.starting:
                    raise RuntimeError(
                        f"{len(self.pool.start_failures)} workers failed to start; the last: "
                        f"{self.pool.start_failures[-1]}"
                    )
                missing = 0  # a model that does not load: do not keep trying
            if missing > 0:
                self.pool.launch(missing)
            return []
        # Every remaining item is in flight: let the autoscaler take back what is idle.
        cancelled = self.pool.cancel_starting()
        released = []
        for index, member in enumerate(self.members):
            if member.live and not keep(index):
                self._released([index], release([member.handle], publish=self.publishes_outputs))
                member.retired = member.released = True
                member.available = False
                member.probe_due = None
                self.stats.workers_released += 1
                log.info("released worker %s: no work left for it", member.info.worker_id if member.info else index)
                released.append(index)
        if cancelled:
            log.info("cancelled %d worker(s) still starting: no work left for them", cancelled)
        return released

    def retire(self, index: int) -> None:
        """Given up for dead: killed, never given work again."""
        self.members[index].retired = True
        self.stats.retired_workers += 1
        self.count()
        kill(self.members[index].handle)
        self.shards.lose(index)

    def release_all(self, *, publish: bool = True) -> None:
        """Kill every worker not released yet and the actors still starting (the job ended, however it ended):
        a driver that runs several jobs, or was interrupted, must not keep them, and the autoscaler can only
        remove idle nodes."""
        if self.pool is not None:
            self.pool.cancel_starting()
        indices = [i for i, m in enumerate(self.members) if not m.released and not m.retired]
        handles = [self.members[i].handle for i in indices]
        self._released(indices, release(handles, publish=publish and self.publishes_outputs))
        for member in self.members:
            if member.retired and not member.released:
                kill(member.handle)


def start_workers(
    config: WorkerConfig,
    shape: PoolShape,
    renderer_factory: Callable[[WorkerConfig], object] | None = None,
    ready_timeout_s: float = 900.0,
    *,
    on_cluster: bool = False,
) -> tuple[list, list[WorkerInfo]]:
    """A fixed pool of `max_workers` actors, waited for until each is ready (for jobs without an
    elastic schedule, e.g. the identity evaluation)."""
    plan = plan_pool(shape, config.model.device, on_cluster=on_cluster, gpus_now=gpus_in_cluster())
    actor = ray.remote(RenderWorker).options(
        num_gpus=1 if plan.use_gpu else 0,
        num_cpus=plan.num_cpus_per_worker,
        max_restarts=-1,
        max_task_retries=plan.max_task_retries,
        max_concurrency=2,
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
