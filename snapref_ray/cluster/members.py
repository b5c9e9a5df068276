"""The batch policy's workers, as values: what each answered last, whether it takes work, and when the elastic pool
grows or gives workers back (the decisions; cluster/pool.py `WorkerPool` starts and kills the actors).

A worker is its index, in the order it joined (the loop keeps the actor handles in the same order). With pool
limits the set is elastic (an autoscaling cluster):
- rendering starts as soon as `min_workers` are ready; each actor that becomes ready joins the running schedule;
- while items are left that no worker has taken, the pool is kept at `max_workers` (a retired worker is replaced);
- once every remaining item is in flight, actors still starting are cancelled and idle workers are given back, so the
  autoscaler can remove their nodes, except a worker whose RefKV others may still fetch: its node's object store
  holds the primary copy, and releasing the worker would let the autoscaler take the node (and the copy) away.

No Ray here: `scale` returns a `PoolOrder` the loop carries out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from snapref_ray.cluster.scheduler_config import SchedulerConfig
from snapref_ray.cluster.scheduler_stats import SchedulerStats
from snapref_ray.cluster.scheduling_policy import PoolOrder
from snapref_ray.cluster.shard_ledger import ShardLedger
from snapref_ray.cluster.tasks import ShardReport, WorkerInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolLimits:
    """The elastic pool's size (cluster/pool.py `PoolPlan`) and whether its workers stage outputs when released."""

    min_workers: int
    max_workers: int
    use_gpu: bool = False
    publishes_outputs: bool = True  # webdataset shards: a worker stages its open shard before it goes


@dataclass
class WorkerSlot:
    """A worker of the schedule: what it answered last, and whether it takes work."""

    info: WorkerInfo | None
    available: bool = True  # False while it is probed after losing a call (cluster/recovery.py)
    probing: bool = False  # a probe is out
    probe_due: float | None = None  # clock() at which to send the next probe
    probe_failures: int = 0
    retired: bool = False  # dead for good, or released: never given work again
    released: bool = False  # given back by the schedule because no work was left for it

    @property
    def live(self) -> bool:
        return not self.retired

    @property
    def node_id(self) -> str | None:
        return self.info.node_id if self.info else None


class Members:
    """The schedule's workers and the pool's decisions; see the module docstring. `stats` is the policy's delta."""

    def __init__(
        self,
        infos: Sequence[WorkerInfo | None],
        limits: PoolLimits | None,
        config: SchedulerConfig,
        stats: SchedulerStats,
        commit_shard: Callable[[str], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.members = [WorkerSlot(i) for i in infos]
        self.limits, self.config, self.stats, self.clock = limits, config, stats, clock
        # Items in the workers' open webdataset shards, committed by the driver (`commit_shard`) once staged; a
        # worker that goes gives its open shard back to render.
        self.shards = ShardLedger(commit_shard)
        self.started = limits is None or limits.min_workers <= len(self.members)
        self.start_failures: list[str] = []
        self.killed: list[int] = []  # retired since the loop last took them: it kills their actors
        self._t_run = clock()
        self._peak = 0
        self.stats.workers_started += sum(1 for m in self.members if m.info is not None)
        self._count_peak()

    def start_clock(self) -> None:
        """The job's workers are counted from now (start_timeout_s, seconds_to_start)."""
        self._t_run = self.clock()

    def live(self) -> int:
        return sum(1 for m in self.members if m.live)

    def takes_work(self, index: int) -> bool:
        member = self.members[index]
        return member.available and member.live

    def join(self, info: WorkerInfo | None, error: str | None) -> int | None:
        """An actor became ready (`info`), or failed to start (`error`): its index, or None."""
        if info is None:
            self.start_failures.append(error or "unknown")
            self.stats.worker_start_failures += 1
            return None
        self.members.append(WorkerSlot(info))
        self.stats.workers_started += 1
        self._count_peak()
        if not self.started and self.limits is not None and self.live() >= self.limits.min_workers:
            self.started = True
            self.stats.seconds_to_start = self.clock() - self._t_run
            log.info(
                "%d worker(s) ready after %.1f s: rendering starts",
                self.limits.min_workers,
                self.stats.seconds_to_start,
            )
        return len(self.members) - 1

    def _count_peak(self) -> None:
        self._peak = max(self._peak, sum(1 for m in self.members if m.live and m.info is not None))
        self.stats.peak_workers = max(self.stats.peak_workers, self._peak)

    def scale(
        self, unassigned_work: bool, starting: int, keep: Callable[[int], bool], *, keep_idle: bool = False
    ) -> PoolOrder:
        """Keep the pool at max_workers while unassigned work exists; once none does, give back the idle workers
        that `keep(index)` does not hold back (none with `keep_idle`: the run may still grow)."""
        limits = self.limits
        if limits is None:
            return PoolOrder()
        if not self.started and self.clock() - self._t_run > self.config.start_timeout_s:
            raise TimeoutError(
                f"only {sum(1 for m in self.members if m.live and m.info)} of min_workers={limits.min_workers} "
                f"{'GPU' if limits.use_gpu else 'CPU'} worker(s) ready after {self.config.start_timeout_s:.0f} s; "
                f"can the cluster provide {'a GPU' if limits.use_gpu else 'a CPU slot'} per worker? "
                f"(start failures: {self.start_failures[-1:] or 'none'})"
            )
        if unassigned_work:
            live = self.live()
            missing = limits.max_workers - live - starting
            if len(self.start_failures) >= self.config.max_start_failures:
                if live == 0 and not starting:
                    raise RuntimeError(
                        f"{len(self.start_failures)} workers failed to start; the last: {self.start_failures[-1]}"
                    )
                missing = 0  # a model that does not load: do not keep trying
            return PoolOrder(launch=max(0, missing))
        # Every remaining item is in flight: let the autoscaler take back what is idle.
        released = []
        for index, member in enumerate(self.members):
            if member.live and not keep_idle and not keep(index):
                member.retired = member.released = True
                member.available, member.probe_due = False, None
                self.stats.workers_released += 1
                log.info("releasing worker %s: no work left for it", member.info.worker_id if member.info else index)
                released.append(index)
        return PoolOrder(cancel_starting=starting > 0, release=tuple(released), publish=limits.publishes_outputs)

    def released(self, index: int, report: ShardReport | None) -> None:
        """A released worker's commits go to the ledger; whatever it still held open is lost with it."""
        if report is not None:
            self.shards.report(index, report)
        self.shards.lose(index)

    def retire(self, index: int) -> None:
        """Given up for dead: never given work again (the loop kills its actor)."""
        self.members[index].retired = True
        self.stats.retired_workers += 1
        self.killed.append(index)
        self.shards.lose(index)

    def take_killed(self) -> tuple[int, ...]:
        killed, self.killed = tuple(self.killed), []
        return killed
