"""Recovery: what the batch schedule does when a call fails, whose fault it was, and what it costs.

- Attempts count an item's own failures only (an error its render returned or raised: bad input that validation
  could not see, NaN output, an exception in the model); an item that keeps failing is reported as an error with its
  last exception after `max_attempts`. When a batch's forward fails, its items are retried one at a time first, so
  that the batch-mates of the item that raises are not charged for it.
- A call lost to the cluster (its worker's process or node died, Ray's memory monitor killed it, the schedule
  released it) is requeued without counting an attempt, by cause (cluster/failures.py), within a job-wide budget of
  `max_requeues_per_item` x the job's items. The actor restarts by itself and is probed before it gets work again
  (a worker whose probes keep failing is retired).
- A worker that fails drops the RefKVs it encoded from the schedule (their only copy may have gone with its node):
  the next worker that needs one encodes it again. A render whose RefKV could not be fetched encodes it itself
  (worker.py) and the driver forgets that handle the same way.
- Out of device memory (torch's, reported by the worker, or Ray's memory monitor killing it) splits the batch in
  half and requeues it without an attempt; the halved size is remembered per (width, height, rows per image) and
  later batches of that shape are cut to it (placement.py). One image that does not fit is the item's own failure,
  with its size, device and memory figures in the error.
- With webdataset output, an item is done when its worker commits the shard it went into; the items of a shard
  that will never be (its worker died, was restarted or retired, could not publish it) are requeued as
  `shard_lost` and render again in the same run (cluster/shard_ledger.py).
- A lost worker is `worker_lost` until Ray lists its node dead (failures.py says why that comes later): losses are
  classified when the worker answers its probe, when Ray declares it dead, or at the end of the job.

What is Ray's comes in as values: the loop's reading of an exception (a `Cause`), a probe's answer, the nodes Ray
lists dead (`nodes_dead`). A probe is asked for by making it due (`due_probes`: the policy dispatches it).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass
from typing import TYPE_CHECKING

from snapref_ray.cluster.call_records import RenderCall
from snapref_ray.cluster.members import Members
from snapref_ray.cluster.placement import Placement, QueuedReference
from snapref_ray.cluster.scheduler_config import SchedulerConfig
from snapref_ray.cluster.scheduler_stats import Cause, SchedulerStats
from snapref_ray.cluster.shard_ledger import Rendered
from snapref_ray.cluster.tasks import ItemOutcome, WorkerInfo
from snapref_ray.render_service.batching import batch_shape

if TYPE_CHECKING:  # the items are only handed through here; their module (the job's planning) imports torch
    from snapref_ray.render_service.work_items import WorkItem

log = logging.getLogger(__name__)

# emit(kind, worker, reference, items, refkv_node=..., cause=...): the policy's SchedulerEvent
Emit = Callable[..., None]


class RequeueBudgetExceeded(RuntimeError):
    """The cluster lost work more often than `max_requeues_per_item` x the job's items allows."""


@dataclass
class _Loss:
    """Items requeued because a worker was lost, counted as worker_lost until its node is known dead."""

    worker: int
    node_id: str | None
    items: int
    at: float  # time.monotonic() of the failure


class Recovery:
    """Attempts, requeues, out-of-memory splits, worker probes and loss classification for one schedule."""

    def __init__(
        self,
        config: SchedulerConfig,
        stats: SchedulerStats,
        placement: Placement,
        members: Members,
        *,
        on_failed: Callable[[ItemOutcome, WorkItem, int], None],
        on_progress: Callable[[int], None] | None,
        emit: Emit,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # `stats`: the policy's delta, taken each step; the budget's count is recovery's own, over the whole run.
        self.config, self.stats, self.placement, self.members = config, stats, placement, members
        self.on_failed, self.on_progress, self.emit, self.clock = on_failed, on_progress, emit, clock
        self.budget = 0  # requeues the run may take: max_requeues_per_item x its items (`add_budget`)
        self.spent: Counter[str] = Counter()  # requeues by cause, over the run
        self.dead: set[str] = set()  # nodes Ray listed dead (the loop's answers to `suspect_nodes`)
        self.requeued: list[str] = []  # item ids put back since the policy last took them (its step's outcome)
        self._attempts: dict[str, int] = {}
        self._unclassified: list[_Loss] = []

    def add_budget(self, items: int) -> None:
        """Items joined the run: the budget grows by max_requeues_per_item for each."""
        self.budget += self.config.max_requeues_per_item * items
        self.stats.requeue_budget += self.config.max_requeues_per_item * items

    def attempt(self, item_id: str) -> int:
        """The attempt number the item's next render is (1-based)."""
        return self._attempts.get(item_id, 0) + 1

    # -- the items' own failures --------------------------------------------------------------------------------
    def item_failed(self, ref: QueuedReference, item: WorkItem, outcome: ItemOutcome) -> int:
        """The item failed by its own fault: count the attempt, then retry it or report it failed; returns how
        many items finished (0 or 1)."""
        attempt = self._attempts.get(item.item_id, 0) + 1
        self._attempts[item.item_id] = attempt
        self.stats.attempts_charged += 1
        if attempt >= self.config.max_attempts:
            self.on_failed(outcome, item, attempt)
            self.stats.failed_items += 1
            return 1
        self.stats.retried_items += 1
        self._put_back(ref, [item])
        return 0

    def items_failed(self, ref: QueuedReference, outcomes: Sequence[tuple[WorkItem, ItemOutcome]]) -> int:
        finished = sum(self.item_failed(ref, item, outcome) for item, outcome in outcomes)
        if self.on_progress and finished:
            self.on_progress(finished)
        return finished

    def isolate(self, ref: QueuedReference, items: Sequence[WorkItem]) -> int:
        """One forward failed for a whole batch: retry each item alone, so that only the one that raises is
        charged."""
        self.placement.render_alone(items)
        self.stats.isolated_batches += 1
        self._put_back(ref, items)
        return 0

    # -- the cluster's failures ---------------------------------------------------------------------------------
    def requeue(self, ref: QueuedReference, items: Sequence[WorkItem], cause: Cause, worker: int | None) -> int:
        """Put items back at the front of their reference's queue without counting an attempt; returns 0 (none
        finished). Raises RequeueBudgetExceeded past the job's budget."""
        self._count_requeues(cause, len(items))
        spent = sum(n for c, n in self.spent.items() if c != Cause.REFKV_LOST)
        if spent > self.budget:
            counts = ", ".join(f"{c}={n}" for c, n in self.spent.items() if n)
            left = self.placement.pending_items() + len(items)
            raise RequeueBudgetExceeded(
                f"the cluster lost work {spent} times ({counts}), over the budget of {self.budget} "
                f"(max_requeues_per_item={self.config.max_requeues_per_item} x the job's items); about {left} "
                "item(s) not rendered. Committed items are kept: run the same spec again once the cluster is healthy."
            )
        self._put_back(ref, items)
        self.emit("requeued", worker, ref, items, cause=cause)
        return 0

    def _put_back(self, ref: QueuedReference, items: Sequence[WorkItem]) -> None:
        """The one way items go back to the queue (a retry, a lone retry of a failed batch, a cluster requeue): at
        the front of their reference's queue, in their order; `requeued` lists them for the step's outcome."""
        self.placement.requeue(ref, items)
        self.requeued.extend(i.item_id for i in items)

    def _count_requeues(self, cause: str, n: int) -> None:
        self.stats.requeues[cause] = self.stats.requeues.get(cause, 0) + n
        self.spent[cause] += n

    def requeue_lost_shards(self, entries: Sequence[Rendered]) -> None:
        """Render again, in this run, items whose webdataset shard will never be committed (shard_lost)."""
        by_reference: dict[int, tuple[QueuedReference, list[Rendered]]] = {}
        for entry in entries:
            by_reference.setdefault(id(entry.reference), (entry.reference, []))[1].append(entry)
        for ref, lost in by_reference.values():
            self.placement.reopen(ref)  # it may have been closed meanwhile (no work was left)
            self.requeue(ref, [e.item for e in lost], Cause.SHARD_LOST, lost[0].worker)

    def render_raised(self, call: RenderCall, error: Exception, cause: Cause | None) -> int:
        """A render call raised at the driver: the cluster's failure (`cause`, the loop's reading of `error`
        (cluster/failures.py): a requeue) or, with no cause, the items' own (an attempt)."""
        ref, task = call.reference, call.task
        if cause is None:  # the call's own code raised (RayTaskError)
            message = f"{type(error).__name__}: {str(error).splitlines()[0][:500]}"
            return self.items_failed(
                ref, [(item, ItemOutcome(item.item_id, error=message, stage="worker")) for item in task.items]
            )
        if cause != Cause.DEVICE_OOM:  # torch's error raised through: the worker itself is fine
            # Ray's memory monitor is its node's raylet: the node, and the RefKVs in its store, are alive.
            self.worker_failed(call.worker, error, drop_refkvs=cause != Cause.OOM_KILLED)
        if cause in (Cause.OOM_KILLED, Cause.DEVICE_OOM):
            return self.out_of_memory(call, " ".join(str(error).split())[:600], cause)
        member = self.members.members[call.worker]
        if member.released:
            cause = Cause.RELEASED
        elif cause == Cause.WORKER_LOST:
            self._unclassified.append(_Loss(call.worker, member.node_id, len(task.items), self.clock()))
        return self.requeue(ref, task.items, cause, call.worker)

    def worker_failed(self, index: int, error: Exception, *, drop_refkvs: bool) -> None:
        """A worker lost a call: it is probed until it answers again; its device cache is gone, and with
        `drop_refkvs` the RefKVs it encoded are forgotten too (their node may be gone)."""
        member = self.members.members[index]
        self.stats.worker_failures += 1
        log.warning(
            "worker %d lost a call (%s: %s); requeueing its batch, probing the worker",
            index,
            type(error).__name__,
            str(error).splitlines()[0][:200] if str(error) else "",
        )
        for ref in self.placement.forget_worker(index, drop_refkvs=drop_refkvs):
            self.drop_refkv(ref, f"worker {index}, which encoded it, failed")
        if member.available and not member.retired:
            member.available = False
            member.probe_due = self.clock()  # probed at once: the policy's next schedule sends it

    def drop_refkv(self, ref: QueuedReference, why: str) -> None:
        """Forget a RefKV handle: no worker is sent to fetch it again; the next one without it encodes it."""
        log.warning("dropping the RefKV of reference %s: %s", ref.task.reference_hash[:12], why)
        node = ref.refkv_node
        ref.forget_refkv()
        self.stats.refkvs_dropped += 1
        self.emit("refkv_dropped", None, ref, refkv_node=node)

    def refkv_lost(self, call: RenderCall, error_class: str) -> None:
        """The render could not fetch the RefKV it was handed and encoded the reference itself."""
        ref = call.reference
        self._count_requeues(Cause.REFKV_LOST, len(call.task.items))
        if call.refkv is not None and ref.refkv is call.refkv:
            self.drop_refkv(ref, f"worker {call.worker} could not fetch it ({error_class})")

    def out_of_memory(self, call: RenderCall, message: str, cause: Cause) -> int:
        """Halve a batch that ran out of memory (remembering the cap for its shape) and requeue it without an
        attempt; one image that does not fit fails as its own error, with the figures known."""
        ref, items = call.reference, call.task.items
        width, height, rows = batch_shape(items[0].settings)
        info: WorkerInfo | None = self.members.members[call.worker].info
        where = f"worker {info.worker_id} ({info.device})" if info else f"worker {call.worker}"
        if len(items) > 1:
            _, cap = self.placement.cap_shape(items)
            self.stats.batch_splits += 1
            log.warning(
                "a batch of %d at %dx%d (%d row(s) per image) ran out of memory on %s; split, and batches of that "
                "shape are cut to %d: %s",
                len(items),
                width,
                height,
                rows,
                where,
                cap,
                message[:300],
            )
            self.emit("batch_split", call.worker, ref, items, cause=cause)
            return self.requeue(ref, items, cause, call.worker)
        (item,) = items
        if cause == Cause.OOM_KILLED:  # Ray's memory monitor killed the worker: say what it was rendering
            message = f"one {width}x{height} image ({rows} row(s) per image) does not fit: {message}"
        error = f"out of memory on {where}: {message}"
        return self.items_failed(ref, [(item, ItemOutcome(item.item_id, error=error, stage="sample"))])

    # -- probes: is a worker that lost a call back? -------------------------------------------------------------
    def due_probes(self) -> list[int]:
        """The workers to probe now (each is then counted as probing until its probe returns)."""
        now, due = self.clock(), []
        for index, member in enumerate(self.members.members):
            if member.probe_due is not None and member.probe_due <= now and not member.retired:
                member.probe_due, member.probing = None, True
                due.append(index)
        return due

    def next_probe_due(self) -> float | None:
        """When the next probe is due (time.monotonic()), or None when no worker waits for one."""
        due = [m.probe_due for m in self.members.members if m.probe_due is not None]
        return min(due) if due else None

    def probe_returned(
        self, index: int, info: WorkerInfo | None, error: Exception | None, *, restarting: bool = False
    ) -> None:
        """A probe came back: `info`, or `error` (`restarting`: the loop read it as Ray's ActorUnavailableError, an
        actor that is coming back, which costs it no probe failure)."""
        member = self.members.members[index]
        member.probing = False
        if member.retired:
            return  # released (no work left) while its probe was out
        if error is not None:
            # Restarting (not dead): ask again later, without blocking the loop for the others.
            if not restarting:
                member.probe_failures += 1
                if member.probe_failures >= self.config.max_probe_failures:
                    log.error(
                        "worker %d is dead (%s after %d probes); retiring it",
                        index,
                        type(error).__name__,
                        member.probe_failures,
                    )
                    self.members.retire(index)
                    self.classify_losses(settled=index)  # Ray declared it dead: after its node, if that died
                    return
            member.probe_due = self.clock() + self.config.probe_interval_s
            return
        member.info = info
        member.available, member.probe_failures = True, 0
        self.members.shards.writer_seen(index, info.worker_id)  # a restarted actor: its open shard is gone
        log.info("worker %d is back (%s)", index, info.worker_id)
        self.classify_losses(settled=index)

    # -- telling a lost node from a lost worker process (cluster/failures.py) -----------------------------------
    def classify_losses(self, settled: int | None = None, final: bool = False) -> None:
        """Move losses whose node Ray now lists dead to node_lost. Those of the worker whose fate Ray has settled
        (`settled`: it answered its probe, or Ray declared it dead; either comes after Ray declared its node dead,
        had the node died), and all that are left when `final`, stay worker_lost."""
        if not self._unclassified:
            return
        left = []
        for loss in self._unclassified:
            if loss.node_id in self.dead:
                self._count_requeues(Cause.WORKER_LOST, -loss.items)
                self._count_requeues(Cause.NODE_LOST, loss.items)
            elif not (final or loss.worker == settled):
                left.append(loss)
        self._unclassified = left

    def suspect_nodes(self) -> Set[str]:
        """The nodes of losses not classified yet: the loop asks Ray whether they are dead (`nodes_dead`)."""
        return {loss.node_id for loss in self._unclassified if loss.node_id and loss.node_id not in self.dead}

    def nodes_dead(self, dead: Set[str]) -> None:
        self.dead |= set(dead)
        self.classify_losses()

    def losses_unsettled_until(self, grace_s: float) -> float | None:
        """Classify what Ray has settled; then the time (`clock()`) until which the loop should keep answering probes
        and asking again (`grace_s` after the latest loss), or None when nothing is left to wait for."""
        self.classify_losses()
        if not self._unclassified:
            return None
        deadline = max(loss.at for loss in self._unclassified) + grace_s
        return deadline if self.clock() < deadline else None

    def settle_losses(self) -> None:
        """Classify what is left without waiting (a failed or interrupted job, or the grace spent); never raises."""
        try:
            self.classify_losses(final=True)
        except Exception as e:  # never mask the error that ended the job
            log.warning("could not classify %d lost worker call(s): %s", len(self._unclassified), e)
