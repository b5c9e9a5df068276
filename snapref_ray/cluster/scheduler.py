"""The batch job's schedule: its policy (cluster/batch_policy.py) handed to the engine core's loop
(cluster/engine_core.py).

Ray Data has no key affinity and `ActorPool` neither replaces dead actors nor resubmits their work
(docs/design.md#ray-facts-this-design-relies-on), so the job runs its own loop over `ray.wait`, split the way vLLM
splits its scheduler from its engine core: `BatchPolicy` decides (placement, recovery, the pool's size, the shards'
ledger) on values and imports neither Ray nor torch; `EngineCore` sends, waits, collects and reads exceptions
(cluster/failures.py), starts and kills the pool's actors (cluster/pool.py) and sums the stats each step returns.
`BatchScheduler` wires the two for a job and ends it (every worker released, however the run ended).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence

import ray

from snapref_ray.cluster.batch_policy import BatchPolicy
from snapref_ray.cluster.call_records import CallKind, ReleaseCall
from snapref_ray.cluster.engine_core import EngineCore
from snapref_ray.cluster.failures import call_cause, dead_nodes
from snapref_ray.cluster.members import PoolLimits
from snapref_ray.cluster.placement import PlannedWork
from snapref_ray.cluster.pool import WorkerPool, kill, release
from snapref_ray.cluster.recovery import RequeueBudgetExceeded
from snapref_ray.cluster.scheduler_config import SchedulerConfig
from snapref_ray.cluster.scheduler_events import EVENT_KINDS, SchedulerEvent
from snapref_ray.cluster.scheduler_stats import SchedulerStats
from snapref_ray.cluster.scheduling_policy import ReturnedCall
from snapref_ray.cluster.tasks import ItemOutcome, WorkerInfo
from snapref_ray.render_service.work_items import WorkItem

log = logging.getLogger(__name__)

__all__ = [
    "EVENT_KINDS",
    "BatchScheduler",
    "RequeueBudgetExceeded",
    "SchedulerConfig",
    "SchedulerEvent",
    "SchedulerStats",
]


class BatchScheduler:
    """Runs work items over RenderWorker actors: a fixed set, or an elastic `WorkerPool`; see the module
    docstring (the callbacks are the policy's: batch_policy.py)."""

    def __init__(
        self,
        workers: Sequence[ray.actor.ActorHandle],
        infos: Sequence[WorkerInfo | None],
        config: SchedulerConfig,
        *,
        on_done: Callable[[ItemOutcome, WorkItem], None],
        on_failed: Callable[[ItemOutcome, WorkItem, int], None],
        on_progress: Callable[[int], None] | None = None,
        pool: WorkerPool | None = None,
        on_worker: Callable[[ray.actor.ActorHandle, WorkerInfo], None] | None = None,
        on_event: Callable[[SchedulerEvent], None] | None = None,
        fence: Callable[[], object] | None = None,
        commit_shard: Callable[[str], bool] | None = None,
        skip_reference: Callable[[str], bool] | None = None,
        adds_work: bool = False,
    ) -> None:
        limits = None
        if pool is not None:
            plan = pool.plan
            publishes = pool.config.output_format == "webdataset"
            limits = PoolLimits(plan.min_workers, plan.max_workers, plan.use_gpu, publishes)
        self.policy = BatchPolicy(
            infos,
            config,
            on_done=on_done,
            on_failed=on_failed,
            on_progress=on_progress,
            on_event=on_event,
            commit_shard=commit_shard,
            skip_reference=skip_reference,
            limits=limits,
            adds_work=adds_work,
        )
        self.stats = SchedulerStats()  # the sum the engine core keeps
        self.core = EngineCore(
            workers,
            self.policy,
            kind=CallKind.RENDER,
            per_worker=config.max_in_flight_per_worker,
            classify=call_cause,
            wait_timeout_s=config.wait_timeout_s,
            stats=self.stats,
            pool=pool,
            on_worker=on_worker,
            fence=fence,
            dead_nodes=dead_nodes,
        )
        self.stats.update(self.policy.stats.take())  # the fixed workers counted as the policy met them

    @property
    def on_done(self) -> Callable[[ItemOutcome, WorkItem], None]:
        return self.policy.on_done

    @on_done.setter
    def on_done(self, on_done: Callable[[ItemOutcome, WorkItem], None]) -> None:
        self.policy.on_done = on_done

    @property
    def encodes_by_reference(self) -> Counter[str]:
        return self.policy.encodes_by_reference

    @property
    def skipped_items(self) -> int:
        return self.policy.skipped_items

    def open_object_refs(self) -> list[ray.ObjectRef]:
        """The RefKVs the driver holds now (one per open reference): what the object store must keep."""
        return self.policy.open_refkvs()

    def run(self, work: Sequence[WorkItem] | PlannedWork) -> SchedulerStats:
        """Render `work` (a list of items, or a plan's reference groups), and whatever `add` gives the run."""
        self.policy.start(work)
        try:
            self.core.run()
        finally:
            self.stats.update(self.policy.finish().stats)
        if self.core.pool is not None:
            self.core.pool.cancel_starting()
        return self.stats

    def add(self, items: Sequence[WorkItem]) -> None:
        """Items that join the running schedule (a judged job's re-renders): see BatchPolicy.add."""
        self.policy.add(items)

    def drop_reference(self, reference_hash: str) -> int:
        """See BatchPolicy.drop_reference."""
        return self.policy.drop_reference(reference_hash)

    def release_workers(self, *, publish: bool = True) -> None:
        """Kill the job's workers and the actors still starting (the job ended, however it ended: a driver that runs
        several jobs, or was interrupted, must not keep them, and the autoscaler can only remove idle nodes);
        `publish=False` (the driver lost the output) kills them without asking them to stage what they hold."""
        live, dead, publishes = self.policy.workers_to_release()
        if self.core.pool is not None:
            self.core.pool.cancel_starting()
        handles = self.core.workers
        reports = release([handles[i] for i in live], publish=publish and publishes)
        for i in dead:
            kill(handles[i])
        returned = [ReturnedCall(ReleaseCall(i), report) for i, report in zip(live, reports)]
        self.stats.update(self.policy.released_at_end(returned, published=publish).stats)
