"""The batch schedule as a policy on the engine core's loop (cluster/engine_core.py): values in, values out.

It owns every decision of a batch job and imports neither Ray nor torch:
- placement (cluster/placement.py): which reference and batch a free worker takes, and whether it fetches the
  RefKV or encodes the reference itself;
- recovery (cluster/recovery.py), as part of `update`: attempts, requeues and their budget, out-of-memory splits,
  lost workers (probed: a probe is a dispatch like any other) and their classification by node;
- the workers and the elastic pool's decisions (cluster/members.py): `scale` says how many more actors to start and
  which workers to give back; workers that join or are given back come back as calls;
- the call records per kind (cluster/call_records.py) and the webdataset shards' ledger (cluster/shard_ledger.py).

A reference is opened by an encode call with two returns: the RefKV, which the driver never waits on nor fetches
(at real size that would pull ~1 GB per reference to the driver's node; it is an `ObjectSlot` here, filled by the
loop), and a small `EncodeInfo` the loop waits on to learn that the RefKV is ready, its size and encode time.

Work enters with `start` (a plan's reference groups) and, while the schedule runs, `add` (a judged job's re-renders,
as their verdicts come in: each joins its reference while that reference is open, so its RefKV is not encoded
again); `drop_reference` and `skip_reference` (the quota seam) take a reference's queued items off. Each step's
counts are a `SchedulerStats` delta in its outcome; the loop keeps the sum.

`on_event` receives a `SchedulerEvent` at each step the schedule takes (scheduler_events.py): for monitoring, and for
tests that must act at an exact moment of a job. It runs on the loop: keep it short.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence, Set
from typing import TYPE_CHECKING

from snapref_ray.cluster.call_records import EncodeCall, ProbeCall, PublishCall, ReleaseCall, RenderCall, StartCall
from snapref_ray.cluster.members import Members, PoolLimits
from snapref_ray.cluster.placement import Placement, PlannedWork, QueuedReference
from snapref_ray.cluster.recovery import Recovery
from snapref_ray.cluster.scheduler_config import SchedulerConfig
from snapref_ray.cluster.scheduler_events import SchedulerEvent
from snapref_ray.cluster.scheduler_stats import RESTARTING, Cause, SchedulerStats
from snapref_ray.cluster.scheduling_policy import (
    Dispatch,
    FreeWorker,
    ObjectSlot,
    PoolOrder,
    ReturnedCall,
    SchedulingPolicy,
    StepOutcome,
)
from snapref_ray.cluster.shard_ledger import Rendered
from snapref_ray.cluster.tasks import EncodeInfo, ItemOutcome, RenderTask, ShardReport, WorkerInfo

if TYPE_CHECKING:  # an item is only carried here; its module (the job's planning) imports torch
    from snapref_ray.render_service.work_items import WorkItem

log = logging.getLogger(__name__)

# What of a sharded item's row the driver holds until its shard commits: what `on_done` reads (the row itself is in
# the shard already). The whole row is a few KB; held for every item of every worker's open shard, that is the
# driver's memory times shard_max_items x workers.
_ROW_HELD_WHILE_SHARDED = (
    "item_id",
    "shard_key",
    "node_id",
    "worker_id",
    "forward_batch",
    "skipped_forwards",
    "steps",
    "encode_s",
)


def _held_while_sharded(outcome: ItemOutcome) -> ItemOutcome:
    row = {k: outcome.row[k] for k in _ROW_HELD_WHILE_SHARDED if k in outcome.row}
    return dataclasses.replace(outcome, row=row, shards=None)


class BatchPolicy(SchedulingPolicy):
    """The batch job's scheduling policy; see the module docstring."""

    def __init__(
        self,
        infos: Sequence[WorkerInfo | None],
        config: SchedulerConfig,
        *,
        on_done: Callable[[ItemOutcome, WorkItem], None],
        on_failed: Callable[[ItemOutcome, WorkItem, int], None],
        on_progress: Callable[[int], None] | None = None,
        on_event: Callable[[SchedulerEvent], None] | None = None,
        commit_shard: Callable[[str], bool] | None = None,
        skip_reference: Callable[[str], bool] | None = None,
        limits: PoolLimits | None = None,
        adds_work: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config, self.clock = config, clock
        # The job may `add` items while the run goes (a judged job's re-renders, decided as renders are committed):
        # idle workers are kept, not given back, and asked to stage their open shard (`PublishCall`) instead, so
        # that the verdicts on it come in while there is a worker to render what they ask for.
        self.adds_work = adds_work
        self.on_done, self.on_progress, self.on_event = on_done, on_progress, on_event
        # The quota seam (a judged job: jobs/judge_loop.py): a reference for which this says True when a worker is
        # about to be given its next batch has its queued items dropped instead; they count as finished.
        self.skip_reference = skip_reference
        self.skipped_items = 0  # items so dropped
        self.stats = SchedulerStats()  # this step's counts, taken into its outcome (`SchedulerStats.take`)
        self.placement = Placement(config, self.stats)
        self.members = Members(infos, limits, config, self.stats, commit_shard, clock)
        self.recovery = Recovery(
            config,
            self.stats,
            self.placement,
            self.members,
            on_failed=self._failed(on_failed),
            on_progress=on_progress,
            emit=self._emit,
            clock=clock,
        )
        self.encodes_by_reference: Counter[str] = Counter()  # reference-stream runs per hash, as workers report
        self.remaining = 0  # items neither finished nor dropped
        self._next_task_id = 0
        self._finished: list[str] = []  # item ids finished (done or failed for good) this step
        self._rendering: Counter[int] = Counter()  # render calls out per worker
        self._skipped_since = 0  # items skipped at this dispatch (skip_reference)
        self._unpublished: set[int] = set()  # workers with renders in their open shard (adds_work)

    # -- work in ------------------------------------------------------------------------------------------------
    def start(self, work: Sequence[WorkItem] | PlannedWork) -> None:
        """Queue a run's work: a list of items, or a plan's reference groups (read as references open)."""
        if not isinstance(work, PlannedWork):
            work = PlannedWork([work], len(work))
        self.placement.queue_planned(work)
        self.recovery.add_budget(work.items)
        self.remaining += work.items
        self.members.start_clock()

    def add(self, items: Sequence[WorkItem]) -> None:
        """Items that join the running schedule (see the module docstring)."""
        self.placement.add(items)
        self.recovery.add_budget(len(items))
        self.remaining += len(items)

    def drop_reference(self, reference_hash: str) -> int:
        """Take a reference's queued, not yet dispatched items off the run (its quota is met); its items in flight
        still come back. Returns how many were dropped (they are neither done nor failed)."""
        dropped = self.placement.drop_reference(reference_hash)
        self.remaining -= dropped
        return dropped

    # -- the engine core's interface ----------------------------------------------------------------------------
    def has_work(self) -> bool:
        """Items left; or, once none is, lost workers whose node Ray may still declare dead (a grace after each
        loss, `loss_classification_grace_s`, answering their probes meanwhile)."""
        if self.remaining > 0:
            return True
        return self.recovery.losses_unsettled_until(self.config.loss_classification_grace_s) is not None

    def scale(self, starting: int) -> PoolOrder:
        if self.remaining <= 0:
            return PoolOrder()
        unassigned = self.placement.unassigned_work()
        return self.members.scale(unassigned, starting, self._keeps_worker, keep_idle=self.adds_work)

    def schedule(self, free: Sequence[FreeWorker]) -> list[Dispatch]:
        self._finish(self.placement.take_dropped())  # items of dropped references skipped as the plan was read
        dispatches = [Dispatch(ProbeCall(i), "info") for i in self.recovery.due_probes()]
        if self.remaining <= 0 or not self.members.started:
            return dispatches
        for worker in free:
            slots = worker.slots if self.members.takes_work(worker.index) else 0
            while slots > 0:
                sent = self._dispatch(worker.index, dispatches)
                if sent is None:
                    break
                slots -= sent
        if self.adds_work and self._unpublished and not self.placement.unassigned_work():
            for worker in free:  # idle: every slot free
                if worker.index in self._unpublished and not self._rendering[worker.index]:
                    self._unpublished.discard(worker.index)
                    dispatches.append(Dispatch(PublishCall(worker.index), "publish_outputs"))
        skipped, self._skipped_since = self._skipped_since, 0
        if skipped and self.on_progress:
            self.on_progress(skipped)
        self._finish(skipped)
        return dispatches

    def update(self, returned: Sequence[ReturnedCall]) -> StepOutcome:
        for r in returned:
            call = r.call
            if isinstance(call, RenderCall):
                finished = self._render_call_returned(call, r)
                self._finish(finished)
            elif isinstance(call, EncodeCall):
                self._encode_returned(call, r.value, r.error)
            elif isinstance(call, ProbeCall):
                self.recovery.probe_returned(call.worker, r.value, r.error, restarting=r.cause == RESTARTING)
            elif isinstance(call, StartCall):
                self._joined(call, r)
            elif isinstance(call, PublishCall):
                self._published(call.worker, r.value, r.error)
            elif isinstance(call, ReleaseCall):
                self.members.released(call.worker, r.value)
                self.placement.forget_worker(call.worker, drop_refkvs=False)
                self._emit("worker_released", call.worker)
        finished = self._settle_shards()
        self._finish(finished)
        self.placement.close_finished()
        return self._outcome()

    def pause_s(self) -> float | None:
        """Nothing is out: wait for the next probe due, or for Ray to settle a loss (the grace at the end)."""
        due = self.recovery.next_probe_due()
        if due is not None:  # only restarting workers left
            return max(0.0, due - self.clock())
        if self.remaining <= 0:  # the last items were skipped as they were dispatched, or a loss is unsettled
            until = self.recovery.losses_unsettled_until(self.config.loss_classification_grace_s)
            return 0.0 if until is None else min(0.5, max(0.0, until - self.clock()))
        workers = self.members.members
        if workers and all(m.retired for m in workers):
            raise RuntimeError(
                f"every worker died for good ({len(workers)} retired); {self.remaining} item(s) not rendered"
            )
        raise RuntimeError("scheduler stalled: items remain but nothing is in flight (no available worker)")

    def suspect_nodes(self) -> Set[str]:
        return self.recovery.suspect_nodes()

    def nodes_dead(self, dead: Set[str]) -> None:
        self.recovery.nodes_dead(dead)

    # -- the end of a run ---------------------------------------------------------------------------------------
    def finish(self) -> StepOutcome:
        """The run ended (however): losses Ray has not settled stay worker_lost; the batch caps it ended with."""
        self.recovery.settle_losses()
        self.stats.batch_limits = self.placement.batch_limits()
        return self._outcome()

    def workers_to_release(self) -> tuple[list[int], list[int], bool]:
        """(live workers not given back yet, workers dead for good, whether they stage outputs): what the loop
        kills as the job ends."""
        workers = self.members.members
        live = [i for i, m in enumerate(workers) if not m.released and not m.retired]
        dead = [i for i, m in enumerate(workers) if m.retired and not m.released]
        limits = self.members.limits
        return live, dead, limits is None or limits.publishes_outputs

    def released_at_end(self, returned: Sequence[ReturnedCall], *, published: bool) -> StepOutcome:
        """The job's last release came back: the shards it committed count; with `published`, those it did not
        are reported (nothing renders them now)."""
        for r in returned:
            self.members.released(r.call.worker, r.value)
        if published:
            self._finish(self._settle_shards(loop_ended=True))
        return self._outcome()

    def open_refkvs(self) -> list[object]:
        """The RefKVs the driver holds now (one per open reference)."""
        return [slot.value for slot in self.placement.open_refkvs()]

    # -- dispatch -----------------------------------------------------------------------------------------------
    def _dispatch(self, index: int, dispatches: list[Dispatch]) -> int | None:
        """Give `index` its next batch: 1 when a render was dispatched, 0 when a reference's queue was skipped
        instead (the worker may take another), None when none suits it now."""
        member = self.members.members[index]
        assignment = self.placement.assign(index, member.node_id, self.members.live())
        if assignment is None:
            return None
        ref = assignment.reference
        if self.skip_reference is not None and self.skip_reference(ref.task.reference_hash):
            dropped = len(assignment.batch) + len(ref.pending)  # not encoded, not sent
            ref.pending.clear()
            self.skipped_items += dropped
            self._skipped_since += dropped
            return 0
        if assignment.opens:  # the RefKV is encoded where it will be sampled; the loop fills the slot
            slot = ObjectSlot()
            self.placement.opened(ref, slot, index, member.node_id)
            dispatches.append(
                Dispatch(EncodeCall(index, ref, slot), "encode", (ref.task,), {"num_returns": 2}, fills=slot)
            )
            self.stats.encodes_requested += 1
            self._emit("encode_sent", index, ref)
        batch = assignment.batch
        attempts = {i.item_id: self.recovery.attempt(i.item_id) for i in batch}
        task = RenderTask(self._next_task_id, ref.task, batch, attempts)
        self._next_task_id += 1
        self._emit("render_sending", index, ref, batch, refkv_node=assignment.fetch_from)
        # No Ray retry of a render on a restarted actor: the policy requeues a lost call's items itself, once.
        call = RenderCall(index, ref, task, assignment.refkv)
        dispatches.append(Dispatch(call, "render", (task, assignment.refkv), {"max_task_retries": 0}))
        ref.in_flight += 1
        self._rendering[index] += 1
        self.stats.dispatched_batches += 1
        return 1

    def _keeps_worker(self, index: int) -> bool:
        """A worker the pool keeps once no work is unassigned: it renders, or holds a RefKV others may fetch."""
        return self._rendering[index] > 0 or self.placement.holds_needed_refkv(index)

    # -- update -------------------------------------------------------------------------------------------------
    def _joined(self, call: StartCall, returned: ReturnedCall) -> None:
        error = None if returned.error is None else str(returned.error)
        index = self.members.join(returned.value if returned.error is None else None, error)
        if index is not None:
            assert index == call.worker, (index, call.worker)  # the loop keeps the handles in the same order
            self._emit("worker_joined", index)

    def _published(self, index: int, report: ShardReport | None, error: Exception | None) -> None:
        if error is None:
            if report is not None:
                self.members.shards.report(index, report)
            return
        # Its open shard could not be staged (the store refused it, or the worker went): its renders go back.
        log.warning("worker %d could not stage its open shard (%s); its items render again", index, error)
        self.members.shards.lose(index)

    def _encode_returned(self, call: EncodeCall, info: EncodeInfo | None, error: Exception | None) -> None:
        ref = call.reference
        current = ref.refkv is call.refkv  # else the RefKV was dropped (and maybe re-opened) meanwhile
        if error is not None:
            log.warning(
                "encode of reference %s on worker %d failed (%s); its renders will encode it themselves",
                ref.task.reference_hash[:12],
                call.worker,
                type(error).__name__,
            )
            if current:
                ref.forget_refkv()
            ref.holders.discard(call.worker)
            return
        if info.encoded:
            self._count_encode(ref.task.reference_hash)
        if current:
            ref.ready = True
            ref.nbytes, ref.encode_seconds = info.nbytes, info.encode_seconds
            self._emit("refkv_ready", call.worker, ref)

    def _render_call_returned(self, call: RenderCall, returned: ReturnedCall) -> int:
        """A render call came back; returns how many items finished (committed or failed for good)."""
        call.reference.in_flight -= 1
        self._rendering[call.worker] -= 1
        if returned.error is not None:
            cause = Cause.WORKER_LOST if returned.cause == RESTARTING else returned.cause
            return self.recovery.render_raised(call, returned.error, Cause(cause) if cause else None)
        outcomes: list[ItemOutcome] = returned.value
        if outcomes and outcomes[0].shards is not None:  # webdataset: the shards it closed meanwhile
            self.members.shards.report(call.worker, outcomes[0].shards)
        return self._render_returned(call, outcomes)

    def _render_returned(self, call: RenderCall, outcomes: list[ItemOutcome]) -> int:
        ref, task = call.reference, call.task
        lost = next((o.refkv_lost for o in outcomes if o.refkv_lost), "")
        if lost:
            self.recovery.refkv_lost(call, lost)
        if outcomes and outcomes[0].refkv_source == "encoded":
            self._count_encode(ref.task.reference_hash)
        if outcomes and outcomes[0].refkv_source == "object_store":
            node = self.members.members[call.worker].node_id
            self.placement.measure_transfer(ref, node, outcomes[0].fetch_seconds)
        if outcomes and all(o.out_of_memory for o in outcomes):
            return self.recovery.out_of_memory(call, outcomes[0].error or "", Cause.DEVICE_OOM)
        if len(task.items) > 1 and all(o.row is None and o.stage == "sample" for o in outcomes):
            return self.recovery.isolate(ref, task.items)
        by_id = {i.item_id: i for i in task.items}
        finished = 0
        for outcome in outcomes:
            item = by_id[outcome.item_id]
            if outcome.row is not None:
                if ref.encode_seconds is None and outcome.row.get("encode_s"):
                    ref.encode_seconds = float(outcome.row["encode_s"])
                if outcome.row.get("shard_key"):  # done when its shard is committed (cluster/shard_ledger.py)
                    writer = outcomes[0].shards.writer if outcomes[0].shards else outcome.row["worker_id"]
                    entry = Rendered(call.worker, _held_while_sharded(outcome), item, ref)
                    self.members.shards.rendered(writer, outcome.row["shard_key"], entry)
                    self._unpublished.add(call.worker)
                    self._emit("item_rendered", call.worker, ref, (item,))
                    continue
                self._done(call.worker, ref, outcome, item)
                finished += 1
            else:
                finished += self.recovery.item_failed(ref, item, outcome)
        if self.on_progress and finished:
            self.on_progress(finished)
        return finished

    def _done(self, worker: int, ref: QueuedReference, outcome: ItemOutcome, item: WorkItem) -> None:
        self.on_done(outcome, item)
        self.stats.done_items += 1
        self._finished.append(item.item_id)
        self._emit("item_done", worker, ref, (item,))

    def _settle_shards(self, *, loop_ended: bool = False) -> int:
        """Count the items whose webdataset shard was committed; render again those whose shard never will be (or,
        once the loop has ended, report them). Returns how many finished."""
        settled = self.members.shards.take()
        for worker, outcome, item, ref in settled.done:
            self._done(worker, ref, outcome, item)
        if settled.lost and loop_ended:  # nothing renders them now: say so, in the log and in errors/
            self.stats.uncommitted_items += len(settled.lost)
            log.error("%d rendered item(s) not committed: their shard was lost as the job ended", len(settled.lost))
            error = "rendered, but its webdataset shard was not committed as the job ended; it renders on the next run"
            for _, _, item, _ in settled.lost:
                outcome = ItemOutcome(item.item_id, error=error, stage="write")
                self.recovery.on_failed(outcome, item, self.recovery.attempt(item.item_id))
        elif settled.lost:
            self.recovery.requeue_lost_shards(settled.lost)
        if self.on_progress and settled.done:
            self.on_progress(len(settled.done))
        return len(settled.done)

    def _count_encode(self, reference_hash: str) -> None:
        self.encodes_by_reference[reference_hash] += 1
        self.stats.reference_encodes += 1
        self.stats.max_encodes_per_reference = max(
            self.stats.max_encodes_per_reference, self.encodes_by_reference[reference_hash]
        )

    def _finish(self, items: int) -> None:
        # A separate statement from the call that counts them: `on_done` may drop a reference meanwhile.
        self.remaining -= items

    def _failed(self, on_failed: Callable[[ItemOutcome, WorkItem, int], None]) -> Callable:
        def failed(outcome: ItemOutcome, item: WorkItem, attempt: int) -> None:
            self._finished.append(item.item_id)
            on_failed(outcome, item, attempt)

        return failed

    def _outcome(self) -> StepOutcome:
        finished, requeued = tuple(self._finished), tuple(self.recovery.requeued)
        self._finished, self.recovery.requeued = [], []
        return StepOutcome(finished, requeued, self.stats.take(), self.members.take_killed())

    def _emit(
        self,
        kind: str,
        index: int | None,
        ref: QueuedReference | None = None,
        items: Sequence[WorkItem] = (),
        *,
        refkv_node: str | None = None,
        cause: str | None = None,
    ) -> None:
        if self.on_event is None:
            return
        node = self.members.members[index].node_id if index is not None else None
        item_ids = tuple(i.item_id for i in items)
        cause = str(cause) if cause else None
        self.on_event(
            SchedulerEvent(kind, index, node, ref.task.reference_hash if ref else None, item_ids, refkv_node, cause)
        )
