"""The driver-side loop: reference affinity, K/V hand-off through the object store, retries.

Ray Data has no key affinity and `ActorPool` neither replaces dead actors nor resubmits their
work (docs/design.md#ray-facts-this-design-relies-on), so the job runs its own loop over `ray.wait`:

- Items are grouped by reference. A reference is *opened* by asking one worker to encode it;
  the RefKV that call returns is owned by the driver and lives in the object store while the
  reference has work left, then the driver drops it (only references in flight are stored).
  The encode call has two returns: the RefKV, which the driver never waits on nor fetches (at
  real size that would pull ~1 GB per reference to the driver's node), and a small `EncodeInfo`
  that the driver waits on to learn that the RefKV is ready, its size and its encode time.
- A free worker takes, in order: more prompts of a reference it already holds on its device;
  a new reference (encoded where it will be sampled); prompts of another open reference whose
  RefKV is *ready*, read from the object store when that is cheaper than encoding (same node:
  shared memory; other node: bytes / bandwidth against the measured encode time), else encoded
  locally. A worker is never handed a RefKV that is still being encoded: it would block one of
  its threads in `ray.get` on a call that may be queued behind it on the same actor.
- Each worker has at most `max_in_flight_per_worker` render calls outstanding, so neither the
  object store nor driver memory grows with the job.
- Attempts count an item's own failures only (an error its render returned or raised: bad input
  that validation could not see, NaN output, an exception in the model); an item that keeps failing
  is reported as an error with its last exception after `max_attempts`. When a batch's forward
  fails, its items are retried one at a time first, so that the batch-mates of the item that raises
  are not charged for it. A call lost to the cluster (its worker's process or node died, Ray's
  memory monitor killed it, the scheduler released it) is requeued without counting an attempt, by
  cause (cluster/failures.py), within a job-wide budget of `max_requeues_per_item` x the job's
  items. The actor restarts by itself and is probed before it gets work again (a worker whose
  probes keep failing is retired).
- A worker that fails drops the RefKVs it encoded from the schedule (their only copy may have gone
  with its node): the next worker that needs one encodes it again. A render whose RefKV could not
  be fetched encodes it itself (worker.py) and the driver forgets that handle the same way.
- Out of device memory (torch's, reported by the worker, or Ray's memory monitor killing it) splits
  the batch in half and requeues it without an attempt; the halved size is remembered per (width,
  height, rows per image) and later batches of that shape are cut to it. One image that does not
  fit is the item's own failure, with its size, device and memory figures in the error.

With a `WorkerPool` the set of workers is elastic (an autoscaling cluster):
- rendering starts as soon as `min_workers` are ready; actors still waiting for a node never
  block, and each one joins the running schedule the moment its `info()` comes back;
- while items are left that no worker has taken, the pool is kept at `max_workers` (a retired
  worker is replaced; a worker whose node died is restarted by Ray, which makes the autoscaler
  add a node);
- once every remaining item is in flight, idle workers and actors still starting are killed, so
  the autoscaler can remove their nodes — except a worker whose RefKV other workers may still fetch:
  its node's object store holds the primary copy, and releasing the worker would let the autoscaler
  take the node (and the copy) away.
The fetch-or-encode choice across nodes uses the configured bandwidth, else the one measured on
the first cross-node fetch; the encode time is the one the workers measured.

`on_event` receives a `SchedulerEvent` at each step the scheduler takes (see `EVENT_KINDS`): for
monitoring, and for tests that must act at an exact moment of a job (kill a node as a worker is
sent to fetch from it) without sleeping. It runs on the scheduler's loop: keep it short.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import ray

from snapref_ray.cluster.failures import REQUEUE_CAUSES, Cause, dead_nodes, infrastructure_cause
from snapref_ray.cluster.pool import WorkerPool, kill
from snapref_ray.cluster.tasks import EncodeInfo, ItemOutcome, ReferenceTask, RenderTask, WorkerInfo, batch_shape
from snapref_ray.service.batching import batch_key, take_batch
from snapref_ray.service.work_items import WorkItem

log = logging.getLogger(__name__)


def fetch_is_cheaper(nbytes: int, transfer_bytes_per_s: float, encode_seconds: float) -> bool:
    """A worker on another node than the RefKV: move its bytes, or run the reference stream again?
    (benchmarks/cross_node_transfer.py measures both sides and where they break even.)"""
    return nbytes / transfer_bytes_per_s < encode_seconds


@dataclass(frozen=True)
class SchedulerConfig:
    max_in_flight_per_worker: int = 2
    max_attempts: int = 3
    max_batch: int = 4
    max_open_references: int | None = None  # default: 2 per worker
    wait_timeout_s: float = 1.0
    # Cross-node transfer rate for the fetch-or-encode decision; None = measure it on the first
    # cross-node fetch (until then, fetching is the choice: it is what gives the measurement).
    transfer_bytes_per_s: float | None = None
    # With a WorkerPool: give up when min_workers are not ready after this long (a cluster that
    # cannot provide the GPUs), and stop relaunching after this many workers failed to start.
    start_timeout_s: float = 900.0
    max_start_failures: int = 3
    # A RefKV's size before one is measured: 1 MP at real size in bf16 (docs/design.md#refkv-and-its-lifetime).
    assumed_refkv_bytes: int = 940_000_000
    # Probes that find the actor dead (not merely restarting) before the worker is given up; a
    # restarting actor (ActorUnavailableError, minutes for a GPU model load) is probed again
    # every `probe_interval_s` for as long as it takes.
    max_probe_failures: int = 3
    probe_interval_s: float = 0.5
    # Requeues for infrastructure failures (no attempt counted) the whole job may take: this x its items.
    max_requeues_per_item: int = 10
    # A lost worker is counted as a node loss once Ray lists its node dead (its health checks take ~15 s);
    # at the end of the job, wait at most this long after the loss for that verdict (cluster/failures.py).
    loss_classification_grace_s: float = 30.0


class RequeueBudgetExceeded(RuntimeError):
    """The cluster lost work more often than `max_requeues_per_item` x the job's items allows."""


EVENT_KINDS = (
    "worker_joined",  # a worker is ready and takes work
    "encode_sent",  # a worker was asked to encode a reference (opening it); node_id: where its RefKV will live
    "refkv_ready",  # that encode came back: the RefKV is in node_id's object store
    # A batch is about to go to a worker (emitted just before the call, so that a test can act before the worker
    # sees it); refkv_node: the node of a RefKV the worker is handed and lacks (it will fetch it from there).
    "render_sending",
    "item_done",  # an item's row was committed
    "requeued",  # items went back to the queue without an attempt; cause: a failures.Cause
    "batch_split",  # a batch ran out of memory and was halved; cause: device_oom or oom_killed
    "refkv_dropped",  # the driver forgot a RefKV (its creator failed, or a fetch found it gone)
    "worker_released",  # a worker was killed because no work was left for it
)


@dataclass(frozen=True)
class SchedulerEvent:
    """One step of the schedule, for `BatchScheduler(on_event=...)`."""

    kind: str  # one of EVENT_KINDS
    worker: int | None = None  # index into BatchScheduler.workers
    node_id: str | None = None  # that worker's node
    reference_hash: str | None = None
    item_ids: tuple[str, ...] = ()
    refkv_node: str | None = None
    cause: str | None = None


@dataclass
class _Reference:
    task: ReferenceTask
    pending: deque[WorkItem]
    in_flight: int = 0
    object_ref: ray.ObjectRef | None = None  # the RefKV, owned by the driver while the reference is open
    ready: bool = False  # its EncodeInfo came back: the RefKV is in the object store
    object_node: str | None = None
    object_worker: int | None = None  # the worker whose encode made object_ref (lineage rebuilds it there)
    holders: set[int] = field(default_factory=set)
    encode_seconds: float | None = None
    nbytes: int | None = None


@dataclass
class _Worker:
    handle: ray.actor.ActorHandle
    info: WorkerInfo | None
    in_flight: int = 0
    available: bool = True
    probe: ray.ObjectRef | None = None
    probe_due: float | None = None  # time.monotonic() at which to send the next probe
    probe_failures: int = 0
    retired: bool = False  # dead for good, or released: never given work again
    released: bool = False  # killed by the scheduler because no work was left for it

    @property
    def live(self) -> bool:
        return not self.retired


@dataclass
class SchedulerStats:
    dispatched_batches: int = 0
    encodes_requested: int = 0  # encode calls that opened a reference
    local_encodes: int = 0  # helpers on another node told to encode instead of fetching (cost model)
    fetches: int = 0  # helpers handed the driver's RefKV from the object store
    same_node_fetches: int = 0  # ... from their own node's object store (shared memory)
    cross_node_fetches: int = 0  # ... from another node's (a network transfer)
    measured_transfer_bytes_per_s: float | None = None  # first cross-node fetch: RefKV bytes / seconds
    reference_encodes: int = 0  # reference-stream runs the workers reported (the real count)
    max_encodes_per_reference: int = 0
    worker_failures: int = 0
    retired_workers: int = 0
    retried_items: int = 0  # items tried again after a failure of their own (an attempt counted)
    attempts_charged: int = 0  # failed attempts counted against max_attempts (the items' own errors)
    failed_items: int = 0
    # Items requeued (or, for refkv_lost, re-encoded for) because of the infrastructure, by failures.Cause:
    # no attempt counted. The budget is max_requeues_per_item x the job's items (refkv_lost is not a requeue).
    requeues: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REQUEUE_CAUSES, 0))
    requeue_budget: int = 0
    batch_splits: int = 0  # out-of-memory batches halved
    isolated_batches: int = 0  # batches whose forward raised, retried one item at a time (no attempt counted)
    refkvs_dropped: int = 0  # RefKV handles forgotten because their creator failed or a fetch found them gone
    # Per (width, height, rows per image) dispatched: the batch cap the job ended with (max_batch unless out of
    # memory halved it) and how many splits led there.
    batch_limits: list[dict] = field(default_factory=list)
    done_items: int = 0
    peak_open_references: int = 0
    workers_started: int = 0  # workers that became ready (joined the schedule)
    workers_released: int = 0  # killed because no work was left for them
    worker_start_failures: int = 0
    peak_workers: int = 0  # most workers ready at once
    seconds_to_start: float = 0.0  # from run() until min_workers were ready and rendering began


@dataclass
class _Loss:
    """Items requeued because a worker was lost, counted as worker_lost until its node is known dead."""

    worker: int
    node_id: str | None
    items: int
    at: float  # time.monotonic() of the failure


class BatchScheduler:
    """Runs work items over RenderWorker actors: a fixed set, or an elastic `WorkerPool`; see the
    module docstring."""

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
    ) -> None:
        self.workers = [_Worker(h, i) for h, i in zip(workers, infos)]
        self.config = config
        self.pool = pool
        self.on_worker = on_worker  # called for each worker that joins (monitoring, failure tests)
        self.on_event = on_event
        self._started = pool is None or pool.plan.min_workers <= len(self.workers)
        self.transfer_bytes_per_s = config.transfer_bytes_per_s
        self.on_done, self.on_failed, self.on_progress = on_done, on_failed, on_progress
        self.stats = SchedulerStats()
        # Reference-stream runs per reference hash, as reported by the workers.
        self.encodes_by_reference: Counter[str] = Counter()
        self._attempts: dict[str, int] = {}
        self._futures: dict[ray.ObjectRef, tuple] = {}
        self._next_task_id = 0
        self._unopened: deque[_Reference] = deque()
        self._open: list[_Reference] = []
        self._unclassified: list[_Loss] = []
        self._batch_caps: dict[tuple[int, int, int], int] = {}  # shapes that ran out of memory -> halved cap
        self._oom_splits: Counter[tuple[int, int, int]] = Counter()
        self._shapes: set[tuple[int, int, int]] = set()
        self._solo: set[str] = set()  # items of a batch whose forward failed: rendered one at a time from then on

    # -- main loop -------------------------------------------------------------------------------
    def run(self, items: Sequence[WorkItem]) -> SchedulerStats:
        groups: dict[tuple, _Reference] = {}
        for item in items:
            task = ReferenceTask.for_item(item)
            groups.setdefault(task.key, _Reference(task, deque())).pending.append(item)
        self._unopened = deque(groups.values())
        self._open = []
        self.stats.requeue_budget = self.config.max_requeues_per_item * len(items)
        self._t_run = time.monotonic()
        self._count_workers()
        if self._started:
            self.stats.seconds_to_start = 0.0
        try:
            self._loop(len(items))
            self._classify_losses_at_the_end(self.config.loss_classification_grace_s)
        finally:
            self.stats.batch_limits = self._batch_limit_report()
            try:  # settle what is left without waiting (a failed or interrupted job)
                self._classify_losses_at_the_end(0.0)
            except Exception as e:  # never mask the error that ended the job
                log.warning("could not classify %d lost worker call(s): %s", len(self._unclassified), e)
        if self.pool:
            self.pool.cancel_starting()
        return self.stats

    def _loop(self, remaining: int) -> None:
        while remaining > 0:
            self._scale()
            self._send_due_probes()
            if self._started:
                self._dispatch()
            starting = self.pool.starting_futures() if self.pool else []
            if not self._futures and not starting:
                due = [w.probe_due for w in self.workers if w.probe_due is not None]
                if due:  # only restarting workers left: wait for the next probe
                    time.sleep(max(0.0, min(due) - time.monotonic()))
                    continue
                if all(w.retired for w in self.workers):
                    raise RuntimeError(
                        f"every worker died for good ({len(self.workers)} retired); {remaining} item(s) not rendered"
                    )
                raise RuntimeError("scheduler stalled: items remain but nothing is in flight (no available worker)")
            ready, _ = ray.wait(list(self._futures) + starting, num_returns=1, timeout=self.config.wait_timeout_s)
            for ref in ready:
                if self.pool and ref in self.pool.starting:
                    self._join(ref)
                else:
                    remaining -= self._collect(ref)
            self._close_finished_references()

    # -- the elastic pool -------------------------------------------------------------------------
    @property
    def max_open(self) -> int:
        if self.config.max_open_references:
            return self.config.max_open_references
        return 2 * max(1, sum(1 for w in self.workers if w.live))

    def _unassigned_work(self) -> bool:
        return bool(self._unopened) or any(r.pending for r in self._open)

    def _scale(self) -> None:
        """Keep the pool at max_workers while unassigned work exists; release it when none does."""
        if self.pool is None:
            return
        plan = self.pool.plan
        if not self._started:
            if time.monotonic() - self._t_run > self.config.start_timeout_s:
                raise TimeoutError(
                    f"only {sum(1 for w in self.workers if w.live and w.info)} of min_workers={plan.min_workers} "
                    f"{'GPU' if plan.use_gpu else 'CPU'} worker(s) ready after {self.config.start_timeout_s:.0f} s; "
                    f"can the cluster provide {'a GPU' if plan.use_gpu else 'a CPU slot'} per worker? "
                    f"(start failures: {self.pool.start_failures[-1:] or 'none'})"
                )
        if self._unassigned_work():
            live = sum(1 for w in self.workers if w.live)
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
            return
        # Every remaining item is in flight: let the autoscaler take back what is idle.
        cancelled = self.pool.cancel_starting()
        for index, worker in enumerate(self.workers):
            if worker.live and worker.in_flight == 0 and not self._holds_needed_refkv(index):
                kill(worker.handle)
                worker.retired = worker.released = True
                worker.available = False
                worker.probe_due = None
                for r in self._open:
                    r.holders.discard(index)
                self.stats.workers_released += 1
                log.info("released worker %s: no work left for it", worker.info.worker_id if worker.info else index)
                self._emit("worker_released", index)
        if cancelled:
            log.info("cancelled %d worker(s) still starting: no work left for them", cancelled)

    def _holds_needed_refkv(self, index: int) -> bool:
        """Whether the worker encoded a RefKV the schedule still hands out (an open reference keeps it only
        while it has work): its node's object store holds the primary copy, which goes with the node."""
        return any(r.object_ref is not None and r.object_worker == index for r in self._open)

    def _join(self, future: ray.ObjectRef) -> None:
        handle, info = self.pool.ready(future)
        if info is None:
            self.stats.worker_start_failures += 1
            return
        self.workers.append(_Worker(handle, info))
        self._count_workers()
        if not self._started and sum(1 for w in self.workers if w.live) >= self.pool.plan.min_workers:
            self._started = True
            self.stats.seconds_to_start = time.monotonic() - self._t_run
            log.info(
                "%d worker(s) ready after %.1f s: rendering starts",
                self.pool.plan.min_workers,
                self.stats.seconds_to_start,
            )
        if self.on_worker:
            self.on_worker(handle, info)
        self._emit("worker_joined", len(self.workers) - 1)

    def _count_workers(self) -> None:
        live = sum(1 for w in self.workers if w.live and w.info is not None)
        self.stats.workers_started = sum(1 for w in self.workers if w.info is not None)
        self.stats.peak_workers = max(self.stats.peak_workers, live)

    def open_object_refs(self) -> list[ray.ObjectRef]:
        """The RefKVs the driver holds now (one per open reference): what the object store must keep."""
        return [r.object_ref for r in self._open if r.object_ref is not None]

    def _dispatch(self) -> None:
        for index, worker in enumerate(self.workers):
            while worker.available and worker.live and worker.in_flight < self.config.max_in_flight_per_worker:
                if not self._dispatch_one(index, worker):
                    break

    def _dispatch_one(self, index: int, worker: _Worker) -> bool:
        ref = self._pick_reference(index)
        if ref is None:
            return False
        batch = self._take_batch(ref)
        handle = None
        fetch_from = None
        if ref.object_ref is None:
            # Open it here: the RefKV is encoded where it will be sampled, and returned to the driver.
            # This worker's own render reads it from its device cache (filled by whichever of the two
            # calls gets there first), so it gets no handle: it must not wait on its own queued call.
            ref.object_ref, info_ref = worker.handle.encode.options(num_returns=2).remote(ref.task)
            ref.ready = False
            ref.object_node = worker.info.node_id if worker.info else None
            ref.object_worker = index
            self._futures[info_ref] = ("encode", index, ref, ref.object_ref)
            self.stats.encodes_requested += 1
            self._emit("encode_sent", index, ref)
        elif ref.ready:
            # A holder gets the handle too: it is only read if its LRU evicted the RefKV meanwhile.
            if index in ref.holders or self._fetch_is_cheaper(ref, worker):
                handle = [ref.object_ref]
                if index not in ref.holders:
                    fetch_from = ref.object_node
                    self.stats.fetches += 1
                    if self._same_node(ref, worker):
                        self.stats.same_node_fetches += 1
                    else:
                        self.stats.cross_node_fetches += 1
            else:
                self.stats.local_encodes += 1
        ref.holders.add(index)
        task = RenderTask(
            self._next_task_id, ref.task, tuple(batch), {i.item_id: self._attempts.get(i.item_id, 0) + 1 for i in batch}
        )
        self._next_task_id += 1
        self._emit("render_sending", index, ref, batch, refkv_node=fetch_from)
        future = worker.handle.render.remote(task, handle)
        self._futures[future] = ("render", index, ref, task, handle[0] if handle else None)
        worker.in_flight += 1
        ref.in_flight += 1
        self.stats.dispatched_batches += 1
        return True

    def _pick_reference(self, index: int) -> _Reference | None:
        held = [r for r in self._open if r.pending and index in r.holders]
        if held:
            return max(held, key=lambda r: len(r.pending))
        if self._unopened and len(self._open) < self.max_open:
            ref = self._unopened.popleft()
            self._open.append(ref)
            self.stats.peak_open_references = max(self.stats.peak_open_references, len(self._open))
            return ref
        # Help with the open reference that has the most work per holder, once its RefKV is ready
        # (or re-open one whose encode failed).
        candidates = [r for r in self._open if r.pending and (r.ready or r.object_ref is None)]
        if not candidates:
            return None
        return max(candidates, key=lambda r: len(r.pending) / max(1, len(r.holders)))

    def _take_batch(self, ref: _Reference) -> list[WorkItem]:
        first = ref.pending[0]
        shape = batch_shape(first.settings)  # equal batch keys mean equal shapes
        self._shapes.add(shape)
        cap = 1 if first.item_id in self._solo else self._batch_caps.get(shape, self.config.max_batch)

        def key(item: WorkItem) -> tuple:  # an item retried alone (its batch failed) shares no forward
            return (batch_key(ref.task.key, item.settings), item.item_id if item.item_id in self._solo else None)

        batch, rest = take_batch(list(ref.pending), key, cap)
        ref.pending = deque(rest)
        return batch

    @staticmethod
    def _same_node(ref: _Reference, worker: _Worker) -> bool:
        return worker.info is None or ref.object_node is None or worker.info.node_id == ref.object_node

    def _fetch_is_cheaper(self, ref: _Reference, worker: _Worker) -> bool:
        if self._same_node(ref, worker):
            return True  # same node: shared memory, no copy over the network
        if ref.encode_seconds is None or self.transfer_bytes_per_s is None:
            return True  # nothing measured yet: fetching is what measures the bandwidth
        return fetch_is_cheaper(
            ref.nbytes or self.config.assumed_refkv_bytes, self.transfer_bytes_per_s, ref.encode_seconds
        )

    def _count_encode(self, reference_hash: str) -> None:
        self.encodes_by_reference[reference_hash] += 1
        self.stats.reference_encodes += 1
        self.stats.max_encodes_per_reference = max(
            self.stats.max_encodes_per_reference, self.encodes_by_reference[reference_hash]
        )

    # -- results -------------------------------------------------------------------------------
    def _collect(self, future: ray.ObjectRef) -> int:
        kind, index, ref, *rest = self._futures.pop(future)
        worker = self.workers[index]
        if kind == "probe":
            self._probe_result(future, worker, index)
            return 0
        if kind == "encode":
            self._encode_result(future, index, ref, *rest)
            return 0
        task, handed = rest
        worker.in_flight -= 1
        ref.in_flight -= 1
        try:
            outcomes: list[ItemOutcome] = ray.get(future, timeout=0)
        except Exception as e:
            return self._call_failed(index, ref, task, e)
        lost = next((o.refkv_lost for o in outcomes if o.refkv_lost), "")
        if lost:
            self.stats.requeues[Cause.REFKV_LOST] += len(task.items)
            if handed is not None and ref.object_ref is handed:
                self._drop_refkv(ref, f"worker {index} could not fetch it ({lost})")
        if outcomes and outcomes[0].refkv_source == "encoded":
            self._count_encode(ref.task.reference_hash)
        if outcomes and outcomes[0].refkv_source == "object_store":
            self._measure_transfer(ref, worker, outcomes[0].fetch_seconds)
        if outcomes and all(o.out_of_memory for o in outcomes):
            return self._out_of_memory(index, ref, task, outcomes[0].error or "", Cause.DEVICE_OOM)
        if len(task.items) > 1 and all(o.row is None and o.stage == "sample" for o in outcomes):
            # One forward failed for all: retry each item alone, so that only the one that raises is charged.
            self._solo.update(i.item_id for i in task.items)
            self.stats.isolated_batches += 1
            ref.pending.extendleft(reversed(task.items))
            return 0
        by_id = {i.item_id: i for i in task.items}
        finished = 0
        for outcome in outcomes:
            item = by_id[outcome.item_id]
            if outcome.row is not None:
                if ref.encode_seconds is None and outcome.row.get("encode_s"):
                    ref.encode_seconds = float(outcome.row["encode_s"])
                self.on_done(outcome, item)
                self.stats.done_items += 1
                finished += 1
                self._emit("item_done", index, ref, (item,))
            else:
                finished += self._retry_or_fail(ref, item, outcome)
        if self.on_progress and finished:
            self.on_progress(finished)
        return finished

    def _measure_transfer(self, ref: _Reference, worker: _Worker, seconds: float) -> None:
        """The first cross-node fetch sets the bandwidth when none is configured."""
        if self.transfer_bytes_per_s is not None or self._same_node(ref, worker) or seconds <= 0 or not ref.nbytes:
            return
        self.transfer_bytes_per_s = ref.nbytes / seconds
        self.stats.measured_transfer_bytes_per_s = self.transfer_bytes_per_s
        log.info(
            "cross-node RefKV fetch: %.1f MB in %.3f s = %.2f Gbit/s; re-encoding on another node is "
            "chosen when its encode is faster",
            ref.nbytes / 1e6,
            seconds,
            8 * self.transfer_bytes_per_s / 1e9,
        )

    def _encode_result(self, future: ray.ObjectRef, index: int, ref: _Reference, object_ref: ray.ObjectRef) -> None:
        current = ref.object_ref is object_ref  # else the RefKV was dropped (and maybe re-opened) meanwhile
        try:
            info: EncodeInfo = ray.get(future, timeout=0)  # the small return; the RefKV stays where it is
        except Exception as e:
            log.warning(
                "encode of reference %s on worker %d failed (%s); its renders will encode it themselves",
                ref.task.reference_hash[:12],
                index,
                type(e).__name__,
            )
            if current:
                ref.object_ref, ref.ready, ref.object_worker = None, False, None
            ref.holders.discard(index)
            return
        if info.encoded:
            self._count_encode(ref.task.reference_hash)
        if current:
            ref.ready = True
            ref.nbytes, ref.encode_seconds = info.nbytes, info.encode_seconds
            self._emit("refkv_ready", index, ref)

    def _retry_or_fail(self, ref: _Reference, item: WorkItem, outcome: ItemOutcome) -> int:
        """The item failed by its own fault: count the attempt, then retry it or report it failed."""
        attempt = self._attempts.get(item.item_id, 0) + 1
        self._attempts[item.item_id] = attempt
        self.stats.attempts_charged += 1
        if attempt >= self.config.max_attempts:
            self.on_failed(outcome, item, attempt)
            self.stats.failed_items += 1
            return 1
        self.stats.retried_items += 1
        ref.pending.appendleft(item)
        return 0

    def _requeue(self, ref: _Reference, items: Sequence[WorkItem], cause: Cause, index: int | None = None) -> int:
        """Put items back at the front of their reference's queue without counting an attempt; returns 0 (none
        finished). Raises RequeueBudgetExceeded past the job's budget."""
        self.stats.requeues[cause] += len(items)
        spent = sum(n for c, n in self.stats.requeues.items() if c != Cause.REFKV_LOST)
        if spent > self.stats.requeue_budget:
            counts = ", ".join(f"{c}={n}" for c, n in self.stats.requeues.items() if n)
            left = sum(len(r.pending) for r in self._unopened) + sum(len(r.pending) for r in self._open) + len(items)
            raise RequeueBudgetExceeded(
                f"the cluster lost work {spent} times ({counts}), over the budget of {self.stats.requeue_budget} "
                f"(max_requeues_per_item={self.config.max_requeues_per_item} x the job's items); about {left} "
                "item(s) not rendered. Committed items are kept: run the same spec again once the cluster is healthy."
            )
        ref.pending.extendleft(reversed(items))
        self._emit("requeued", index, ref, items, cause=cause)
        return 0

    def _call_failed(self, index: int, ref: _Reference, task: RenderTask, error: Exception) -> int:
        """A render call raised at the driver: the cluster's failure (requeue) or the items' own (an attempt)."""
        cause = infrastructure_cause(error)
        if cause is None:  # the call's own code raised (RayTaskError)
            message = f"{type(error).__name__}: {str(error).splitlines()[0][:500]}"
            finished = sum(
                self._retry_or_fail(ref, item, ItemOutcome(item.item_id, error=message, stage="worker"))
                for item in task.items
            )
            if self.on_progress and finished:
                self.on_progress(finished)
            return finished
        if cause != Cause.DEVICE_OOM:  # torch's error raised through: the worker itself is fine
            # Ray's memory monitor is its node's raylet: the node, and the RefKVs in its store, are alive.
            self._worker_failed(index, error, drop_refkvs=cause != Cause.OOM_KILLED)
        if cause in (Cause.OOM_KILLED, Cause.DEVICE_OOM):
            return self._out_of_memory(index, ref, task, " ".join(str(error).split())[:600], cause)
        worker = self.workers[index]
        if worker.released:
            cause = Cause.RELEASED
        elif cause == Cause.WORKER_LOST:
            node = worker.info.node_id if worker.info else None
            self._unclassified.append(_Loss(index, node, len(task.items), time.monotonic()))
        return self._requeue(ref, task.items, cause, index)

    def _worker_failed(self, index: int, error: Exception, *, drop_refkvs: bool) -> None:
        """A worker lost a call: it is probed until it answers again; its device cache is gone, and with
        `drop_refkvs` the RefKVs it encoded are forgotten too (their node may be gone)."""
        worker = self.workers[index]
        self.stats.worker_failures += 1
        log.warning(
            "worker %d lost a call (%s: %s); requeueing its batch, probing the worker",
            index,
            type(error).__name__,
            str(error).splitlines()[0][:200] if str(error) else "",
        )
        for r in self._open:
            r.holders.discard(index)  # a restarted worker has an empty device cache
            if drop_refkvs and r.object_worker == index and r.object_ref is not None:
                self._drop_refkv(r, f"worker {index}, which encoded it, failed")  # it may be gone with the node
        if worker.available and not worker.retired:
            worker.available = False
            self._send_probe(worker, index)

    def _drop_refkv(self, ref: _Reference, why: str) -> None:
        """Forget a RefKV handle: no worker is sent to fetch it again; the next one without it encodes it."""
        log.warning("dropping the RefKV of reference %s: %s", ref.task.reference_hash[:12], why)
        node = ref.object_node
        ref.object_ref, ref.ready, ref.object_worker, ref.object_node = None, False, None, None
        self.stats.refkvs_dropped += 1
        self._emit("refkv_dropped", None, ref, refkv_node=node)

    def _out_of_memory(self, index: int, ref: _Reference, task: RenderTask, message: str, cause: Cause) -> int:
        """Halve a batch that ran out of memory (remembering the cap for its shape) and requeue it without an
        attempt; one image that does not fit fails as its own error, with the figures known."""
        width, height, rows = shape = batch_shape(task.items[0].settings)
        n = len(task.items)
        worker = self.workers[index]
        where = f"worker {worker.info.worker_id} ({worker.info.device})" if worker.info else f"worker {index}"
        if n > 1:
            cap = min(self._batch_caps.get(shape, self.config.max_batch), (n + 1) // 2)
            self._batch_caps[shape] = cap
            self._oom_splits[shape] += 1
            self.stats.batch_splits += 1
            log.warning(
                "a batch of %d at %dx%d (%d row(s) per image) ran out of memory on %s; split, and batches of that "
                "shape are cut to %d: %s",
                n,
                width,
                height,
                rows,
                where,
                cap,
                message[:300],
            )
            self._emit("batch_split", index, ref, task.items, cause=cause)
            return self._requeue(ref, task.items, cause, index)
        (item,) = task.items
        if cause == Cause.OOM_KILLED:  # Ray's memory monitor killed the worker: say what it was rendering
            message = f"one {width}x{height} image ({rows} row(s) per image) does not fit: {message}"
        error = f"out of memory on {where}: {message}"
        finished = self._retry_or_fail(ref, item, ItemOutcome(item.item_id, error=error, stage="sample"))
        if self.on_progress and finished:
            self.on_progress(finished)
        return finished

    def _batch_limit_report(self) -> list[dict]:
        return [
            {
                "width": w,
                "height": h,
                "rows_per_image": rows,
                "batch": self._batch_caps.get((w, h, rows), self.config.max_batch),
                "max_batch": self.config.max_batch,
                "out_of_memory_splits": self._oom_splits[(w, h, rows)],
            }
            for w, h, rows in sorted(self._shapes)
        ]

    # -- telling a lost node from a lost worker process (cluster/failures.py) -----------------------------------
    def _classify_losses(self, settled: int | None = None, final: bool = False) -> None:
        """Move losses whose node Ray now lists dead to node_lost. Those of the worker whose fate Ray has settled
        (`settled`: it answered its probe, or Ray declared it dead; either comes after Ray declared its node dead,
        had the node died), and all that are left when `final`, stay worker_lost."""
        if not self._unclassified:
            return
        dead = dead_nodes({loss.node_id for loss in self._unclassified if loss.node_id})
        left = []
        for loss in self._unclassified:
            if loss.node_id in dead:
                self.stats.requeues[Cause.WORKER_LOST] -= loss.items
                self.stats.requeues[Cause.NODE_LOST] += loss.items
            elif not (final or loss.worker == settled):
                left.append(loss)
        self._unclassified = left

    def _classify_losses_at_the_end(self, grace_s: float) -> None:
        """Give Ray up to `grace_s` after each unclassified loss to declare its node dead (answering the lost
        workers' probes meanwhile: one that comes back was a process loss), then settle the rest."""
        while self._unclassified:
            self._classify_losses()
            deadline = max(loss.at for loss in self._unclassified) + grace_s if self._unclassified else 0.0
            if not self._unclassified or time.monotonic() >= deadline:
                break
            self._send_due_probes()
            probes = [f for f, (kind, *_) in self._futures.items() if kind == "probe"]
            if not probes:
                time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
                continue
            ready, _ = ray.wait(probes, num_returns=1, timeout=min(0.5, max(0.0, deadline - time.monotonic())))
            for future in ready:
                self._collect(future)
        self._classify_losses(final=True)

    def _send_probe(self, worker: _Worker, index: int) -> None:
        worker.probe, worker.probe_due = worker.handle.info.remote(), None
        self._futures[worker.probe] = ("probe", index, None)

    def _send_due_probes(self) -> None:
        now = time.monotonic()
        for index, worker in enumerate(self.workers):
            if worker.probe_due is not None and worker.probe_due <= now and not worker.retired:
                self._send_probe(worker, index)

    def _probe_result(self, future: ray.ObjectRef, worker: _Worker, index: int) -> None:
        if worker.retired:
            return  # released (no work left) while its probe was out
        try:
            worker.info = ray.get(future, timeout=0)
        except Exception as e:
            worker.probe = None
            # Restarting (not dead): ask again later, without blocking the loop for the others.
            if not isinstance(e, ray.exceptions.ActorUnavailableError):
                worker.probe_failures += 1
                if worker.probe_failures >= self.config.max_probe_failures:
                    worker.retired = True
                    self.stats.retired_workers += 1
                    self._count_workers()
                    log.error(
                        "worker %d is dead (%s after %d probes); retiring it",
                        index,
                        type(e).__name__,
                        worker.probe_failures,
                    )
                    kill(worker.handle)
                    self._classify_losses(settled=index)  # Ray declared it dead: after its node, if that died
                    return
            worker.probe_due = time.monotonic() + self.config.probe_interval_s
            return
        worker.available, worker.probe, worker.probe_failures = True, None, 0
        worker.in_flight = max(worker.in_flight, 0)
        log.info("worker %d is back (%s)", index, worker.info.worker_id)
        self._classify_losses(settled=index)

    def _close_finished_references(self) -> None:
        still_open = []
        for ref in self._open:
            if ref.pending or ref.in_flight:
                still_open.append(ref)
            else:
                ref.object_ref = None  # drop the driver's reference: the object store frees the RefKV
                ref.ready = False
                ref.object_worker = None
        self._open = still_open

    def _emit(
        self,
        kind: str,
        index: int | None,
        ref: _Reference | None = None,
        items: Sequence[WorkItem] = (),
        *,
        refkv_node: str | None = None,
        cause: str | None = None,
    ) -> None:
        if self.on_event is None:
            return
        info = self.workers[index].info if index is not None else None
        self.on_event(
            SchedulerEvent(
                kind,
                index,
                info.node_id if info else None,
                ref.task.reference_hash if ref else None,
                tuple(i.item_id for i in items),
                refkv_node,
                str(cause) if cause else None,
            )
        )
