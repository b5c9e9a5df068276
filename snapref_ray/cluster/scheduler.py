"""The batch schedule's loop: it waits, dispatches and collects; the decisions are made elsewhere.

Ray Data has no key affinity and `ActorPool` neither replaces dead actors nor resubmits their work
(docs/design.md#ray-facts-this-design-relies-on), so the job runs its own loop over `ray.wait`, split the way vLLM
splits its scheduler from its engine loop:

- cluster/placement.py (no Ray): which reference and batch a free worker takes, and whether it fetches the RefKV
  from the object store or encodes the reference itself;
- cluster/recovery.py (no Ray): what a failure costs (attempts, requeues and their budget, out-of-memory splits) and
  when a lost worker is probed; this loop reads the exception into a `Cause` (cluster/failures.py), sends the probes
  and lists dead nodes for it;
- cluster/pool.py `PoolMembers`: the workers, and when the pool grows or gives workers back;
- cluster/calls.py: the calls in flight, each with its kind's record (cluster/call_records.py), and the one
  `ray.wait` over them. (cluster/engine_core.py is the same loop, handed a whole policy; the identity evaluation
  runs on it.)

A reference is opened by an encode call with two returns: the RefKV, which the driver never waits on nor fetches
(at real size that would pull ~1 GB per reference to the driver's node), and a small `EncodeInfo` that the driver
waits on to learn that the RefKV is ready, its size and its encode time. Each worker has at most
`max_in_flight_per_worker` render calls outstanding, so neither the object store nor driver memory grows with the
job.

`on_event` receives a `SchedulerEvent` at each step the schedule takes (see `EVENT_KINDS`): for monitoring, and for
tests that must act at an exact moment of a job (kill a node as a worker is sent to fetch from it) without sleeping.
It runs on the loop: keep it short.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence

import ray

from snapref_ray.cluster.call_records import CallKind, EncodeCall, ProbeCall, RenderCall
from snapref_ray.cluster.calls import InFlight, Returned
from snapref_ray.cluster.failures import dead_nodes, infrastructure_cause
from snapref_ray.cluster.placement import Assignment, Placement, PlannedWork, QueuedReference
from snapref_ray.cluster.pool import Member, PoolMembers, WorkerPool
from snapref_ray.cluster.recovery import Recovery, RequeueBudgetExceeded
from snapref_ray.cluster.scheduler_config import SchedulerConfig
from snapref_ray.cluster.scheduler_events import EVENT_KINDS, SchedulerEvent
from snapref_ray.cluster.scheduler_stats import Cause, SchedulerStats
from snapref_ray.cluster.shard_ledger import Rendered
from snapref_ray.cluster.tasks import EncodeInfo, ItemOutcome, RenderTask, WorkerInfo
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


class BatchScheduler:
    """Runs work items over RenderWorker actors: a fixed set, or an elastic `WorkerPool`; see the module
    docstring."""

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
    ) -> None:
        self.config = config
        # The quota seam (a judged job: jobs/judge_loop.py): a reference for which this says True when a worker
        # is about to be given its next batch has its queued items dropped instead; they count as finished.
        self.skip_reference = skip_reference
        self.skipped_items = 0  # items so dropped, over every run
        self._skipped_since = 0  # ... not yet counted by the loop
        self.on_done, self.on_progress = on_done, on_progress
        self.on_worker = on_worker  # called for each worker that joins (monitoring, failure tests)
        self.on_event = on_event
        # The output's lease, checked once per step (raises LeaseLostError): a driver that lost the output stops.
        self.fence = fence
        self.stats = SchedulerStats()
        # Reference-stream runs per reference hash, as reported by the workers.
        self.encodes_by_reference: Counter[str] = Counter()
        self.calls = InFlight()
        self.placement = Placement(config, self.stats)
        self.members = PoolMembers(workers, infos, pool, config, self.stats, commit_shard)
        self.recovery = Recovery(
            config,
            self.stats,
            self.placement,
            self.members,
            on_failed=on_failed,
            on_progress=on_progress,
            emit=self._emit,
            send_probe=self._send_probe,
            dead_nodes=dead_nodes,
        )
        self._next_task_id = 0
        self._remaining = 0  # items of the current run neither finished nor dropped

    @property
    def workers(self) -> list[Member]:
        return self.members.members

    def open_object_refs(self) -> list[ray.ObjectRef]:
        """The RefKVs the driver holds now (one per open reference): what the object store must keep."""
        return self.placement.open_refkvs()

    def release_workers(self, *, publish: bool = True) -> None:
        """Kill the job's workers and the actors still starting (see `PoolMembers.release_all`); `publish=False`
        (the driver lost the output) kills them without asking them to stage what they hold."""
        self.members.release_all(publish=publish)
        if publish:
            self._settle_shards(loop_ended=True)

    # -- the loop -----------------------------------------------------------------------------------------------
    def run(self, work: Sequence[WorkItem] | PlannedWork) -> SchedulerStats:
        """Render `work`: a list of items, or a plan's reference groups (read as references open)."""
        if not isinstance(work, PlannedWork):
            work = PlannedWork([work], len(work))
        self.placement.queue_planned(work)
        # Added to, not set: `run` may be called again on the same pool (a judged job's rounds), and the requeues
        # counted against the budget are the scheduler's over every run.
        self.stats.requeue_budget += self.config.max_requeues_per_item * work.items
        self.members.start_clock()
        try:
            self._loop(work.items)
            self._classify_losses_at_the_end()
        finally:
            self.stats.batch_limits = self.placement.batch_limits()
            self.recovery.settle_losses()
        if self.members.pool:
            self.members.pool.cancel_starting()
        return self.stats

    def drop_reference(self, reference_hash: str) -> int:
        """Take a reference's queued, not yet dispatched items off this run (its quota is met); its items in flight
        still come back. Returns how many were dropped (they are neither done nor failed)."""
        dropped = self.placement.drop_reference(reference_hash)
        self._remaining -= dropped
        return dropped

    def _loop(self, remaining: int) -> None:
        self._remaining = remaining
        while self._remaining > 0:
            self._step()

    def _step(self) -> None:
        """One iteration: scale the pool, settle shards, probes, dispatch, wait, collect, settle, close."""
        self._finished(self.placement.take_dropped())  # items of dropped references skipped as the plan was read
        if self.fence is not None:
            self.fence()
        unassigned = self.placement.unassigned_work()
        for index in self.members.scale(unassigned, self._keeps_worker):
            self.placement.forget_worker(index, drop_refkvs=False)
            self._emit("worker_released", index)
        self._finished(self._settle_shards())  # released workers committed their open shards (or lost them)
        if self._remaining <= 0:
            return
        if not unassigned and self.placement.unassigned_work():
            return  # a released worker's lost shard gave items back: the pool grows again for them
        self.recovery.send_due_probes()
        if self.members.started:
            self._dispatch()
            self._finished(self._take_skipped())  # a full reference's queue, dropped at dispatch (skip_reference)
            if self._remaining <= 0:
                return
        starting = self.members.starting()
        if not self.calls and not starting:
            due = self.recovery.next_probe_due()
            if due is not None:  # only restarting workers left: wait for the next probe
                time.sleep(max(0.0, due - time.monotonic()))
                return
            if all(m.retired for m in self.workers):
                raise RuntimeError(
                    f"every worker died for good ({len(self.workers)} retired); {self._remaining} item(s) not rendered"
                )
            raise RuntimeError("scheduler stalled: items remain but nothing is in flight (no available worker)")
        for future in self.calls.wait(also=starting, timeout=self.config.wait_timeout_s):
            if self.members.is_starting(future):
                self._join(future)
            else:
                self._finished(self._collect(self.calls.collect(future)))
        self._finished(self._settle_shards())
        self.placement.close_finished()

    def _finished(self, items: int) -> None:
        # A separate statement: `self._remaining -= self._collect(...)` would read _remaining before `on_done` runs,
        # and lose a `drop_reference` made from it.
        self._remaining -= items

    def _classify_losses_at_the_end(self) -> None:
        """Give Ray up to `loss_classification_grace_s` after each unclassified loss to declare its node dead,
        answering the lost workers' probes meanwhile (one that comes back was a process loss); then settle the rest."""
        grace = self.config.loss_classification_grace_s
        while (deadline := self.recovery.losses_unsettled_until(grace)) is not None:
            self.recovery.send_due_probes()
            probes = self.calls.futures(CallKind.PROBE)
            timeout = min(0.5, max(0.0, deadline - time.monotonic()))
            if not probes:
                time.sleep(timeout)
                continue
            for future in self.calls.wait(probes, timeout=timeout):
                self._probe_returned(self.calls.collect(future))
        self.recovery.classify_losses(final=True)  # the grace is spent: what Ray has not settled stays worker_lost

    def _send_probe(self, index: int) -> None:
        """Ask a worker that lost a call whether it is back (recovery decides when)."""
        member = self.workers[index]
        member.probe = member.handle.info.remote()
        self.calls.send(member.probe, ProbeCall(index))

    def _probe_returned(self, returned: Returned) -> None:
        error = returned.error
        restarting = isinstance(error, ray.exceptions.ActorUnavailableError)  # coming back: no probe failure
        self.recovery.probe_returned(returned.call.worker, returned.value, error, restarting=restarting)

    def _keeps_worker(self, index: int) -> bool:
        """A worker the pool keeps once no work is unassigned: it renders, or holds a RefKV others may fetch."""
        return self.calls.load(index, CallKind.RENDER) > 0 or self.placement.holds_needed_refkv(index)

    def _join(self, future: ray.ObjectRef) -> None:
        index = self.members.join(future)
        if index is None:
            return
        member = self.workers[index]
        if self.on_worker:
            self.on_worker(member.handle, member.info)
        self._emit("worker_joined", index)

    # -- dispatch -----------------------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        self.calls.fill(
            [i for i in range(len(self.workers)) if self.members.takes_work(i)],
            self.config.max_in_flight_per_worker,
            CallKind.RENDER,
            self._dispatch_one,
        )

    def _dispatch_one(self, index: int) -> bool:
        member = self.workers[index]
        assignment = self.placement.assign(index, member.node_id, self.members.live())
        if assignment is None:
            return False
        ref = assignment.reference
        if self.skip_reference is not None and self.skip_reference(ref.task.reference_hash):
            self._skip_queued(assignment)
            return True  # nothing sent: the worker may take another reference's batch
        if assignment.opens:  # the RefKV is encoded where it will be sampled, and returned to the driver
            refkv, info = member.handle.encode.options(num_returns=2).remote(ref.task)
            self.placement.opened(ref, refkv, index, member.node_id)
            self.calls.send(info, EncodeCall(index, ref, refkv))
            self.stats.encodes_requested += 1
            self._emit("encode_sent", index, ref)
        self._send_render(index, member, assignment)
        return True

    def _send_render(self, index: int, member: Member, assignment: Assignment) -> None:
        ref, batch = assignment.reference, assignment.batch
        attempts = {i.item_id: self.recovery.attempt(i.item_id) for i in batch}
        task = RenderTask(self._next_task_id, ref.task, batch, attempts)
        self._next_task_id += 1
        self._emit("render_sending", index, ref, batch, refkv_node=assignment.fetch_from)
        handle = [assignment.refkv] if assignment.refkv is not None else None
        # No Ray retry of a render on a restarted actor: the driver requeues a lost call's items itself, once.
        future = member.handle.render.options(max_task_retries=0).remote(task, handle)
        self.calls.send(future, RenderCall(index, ref, task, assignment.refkv))
        ref.in_flight += 1
        self.stats.dispatched_batches += 1

    def _skip_queued(self, assignment: Assignment) -> None:
        """Drop the batch and the rest of its reference's queue (not encoded, not sent): see `skip_reference`."""
        ref = assignment.reference
        dropped = len(assignment.batch) + len(ref.pending)
        ref.pending.clear()
        self.skipped_items += dropped
        self._skipped_since += dropped

    def _take_skipped(self) -> int:
        n, self._skipped_since = self._skipped_since, 0
        if n and self.on_progress:
            self.on_progress(n)
        return n

    # -- collect ------------------------------------------------------------------------------------------------
    def _collect(self, returned: Returned) -> int:
        """Take in a call that came back; returns how many items finished (committed or failed for good)."""
        call = returned.call
        if isinstance(call, ProbeCall):
            self._probe_returned(returned)
            return 0
        if isinstance(call, EncodeCall):
            self._encode_returned(call, returned.value, returned.error)
            return 0
        call.reference.in_flight -= 1
        if returned.error is not None:
            return self.recovery.render_raised(call, returned.error, infrastructure_cause(returned.error))
        if returned.value and returned.value[0].shards is not None:  # webdataset: the shards it closed meanwhile
            self.members.shards.report(call.worker, returned.value[0].shards)
        return self._render_returned(call, returned.value)

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

    def _render_returned(self, call: RenderCall, outcomes: list[ItemOutcome]) -> int:
        ref, task = call.reference, call.task
        lost = next((o.refkv_lost for o in outcomes if o.refkv_lost), "")
        if lost:
            self.recovery.refkv_lost(call, lost)
        if outcomes and outcomes[0].refkv_source == "encoded":
            self._count_encode(ref.task.reference_hash)
        if outcomes and outcomes[0].refkv_source == "object_store":
            self.placement.measure_transfer(ref, self.workers[call.worker].node_id, outcomes[0].fetch_seconds)
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
                    self._emit("item_rendered", call.worker, ref, (item,))
                    continue
                self.on_done(outcome, item)
                self.stats.done_items += 1
                finished += 1
                self._emit("item_done", call.worker, ref, (item,))
            else:
                finished += self.recovery.item_failed(ref, item, outcome)
        if self.on_progress and finished:
            self.on_progress(finished)
        return finished

    def _settle_shards(self, *, loop_ended: bool = False) -> int:
        """Count the items whose webdataset shard was committed; render again those whose shard never will be (or,
        once the loop has ended, report them). Returns how many finished."""
        settled = self.members.shards.take()
        for worker, outcome, item, ref in settled.done:
            self.on_done(outcome, item)
            self.stats.done_items += 1
            self._emit("item_done", worker, ref, (item,))
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
        node = self.workers[index].node_id if index is not None else None
        item_ids = tuple(i.item_id for i in items)
        cause = str(cause) if cause else None
        self.on_event(
            SchedulerEvent(kind, index, node, ref.task.reference_hash if ref else None, item_ids, refkv_node, cause)
        )
