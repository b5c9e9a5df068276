"""The driver-side loop: reference affinity, K/V hand-off through the object store, retries.

Ray Data has no key affinity and `ActorPool` neither replaces dead actors nor resubmits their
work (ray-notes.md), so the job runs its own loop over `ray.wait`:

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
- A call that fails because its worker died is requeued (attempts are counted per item); the
  actor restarts by itself and is probed before it gets work again (a worker whose probes keep
  failing is retired). An item that keeps failing is reported as an error with its last exception.

With a `WorkerPool` the set of workers is elastic (an autoscaling cluster):
- rendering starts as soon as `min_workers` are ready; actors still waiting for a node never
  block, and each one joins the running schedule the moment its `info()` comes back;
- while items are left that no worker has taken, the pool is kept at `max_workers` (a retired
  worker is replaced; a worker whose node died is restarted by Ray, which makes the autoscaler
  add a node);
- once every remaining item is in flight, idle workers and actors still starting are killed, so
  the autoscaler can remove their nodes.
The fetch-or-encode choice across nodes uses the configured bandwidth, else the one measured on
the first cross-node fetch; the encode time is the one the workers measured.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import ray

from snapref_ray.cluster.pool import WorkerPool, kill
from snapref_ray.cluster.tasks import EncodeInfo, ItemOutcome, ReferenceTask, RenderTask, WorkerInfo
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
    # A RefKV's size before one is measured: 1 MP at real size in bf16 (ray-notes.md).
    assumed_refkv_bytes: int = 940_000_000
    # Probes that find the actor dead (not merely restarting) before the worker is given up; a
    # restarting actor (ActorUnavailableError, minutes for a GPU model load) is probed again
    # every `probe_interval_s` for as long as it takes.
    max_probe_failures: int = 3
    probe_interval_s: float = 0.5


@dataclass
class _Reference:
    task: ReferenceTask
    pending: deque[WorkItem]
    in_flight: int = 0
    object_ref: ray.ObjectRef | None = None  # the RefKV, owned by the driver while the reference is open
    ready: bool = False  # its EncodeInfo came back: the RefKV is in the object store
    object_node: str | None = None
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
    retried_items: int = 0
    failed_items: int = 0
    done_items: int = 0
    peak_open_references: int = 0
    workers_started: int = 0  # workers that became ready (joined the schedule)
    workers_released: int = 0  # killed because no work was left for them
    worker_start_failures: int = 0
    peak_workers: int = 0  # most workers ready at once
    seconds_to_start: float = 0.0  # from run() until min_workers were ready and rendering began


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
    ) -> None:
        self.workers = [_Worker(h, i) for h, i in zip(workers, infos)]
        self.config = config
        self.pool = pool
        self.on_worker = on_worker  # called for each worker that joins (monitoring, failure tests)
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

    # -- main loop -------------------------------------------------------------------------------
    def run(self, items: Sequence[WorkItem]) -> SchedulerStats:
        groups: dict[tuple, _Reference] = {}
        for item in items:
            task = ReferenceTask.for_item(item)
            groups.setdefault(task.key, _Reference(task, deque())).pending.append(item)
        self._unopened = deque(groups.values())
        self._open = []
        remaining = len(items)
        self._t_run = time.monotonic()
        self._count_workers()
        if self._started:
            self.stats.seconds_to_start = 0.0
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
        if self.pool:
            self.pool.cancel_starting()
        return self.stats

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
            if worker.live and worker.in_flight == 0:
                kill(worker.handle)
                worker.retired = worker.released = True
                worker.available = False
                worker.probe_due = None
                for r in self._open:
                    r.holders.discard(index)
                self.stats.workers_released += 1
                log.info("released worker %s: no work left for it", worker.info.worker_id if worker.info else index)
        if cancelled:
            log.info("cancelled %d worker(s) still starting: no work left for them", cancelled)

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
        if ref.object_ref is None:
            # Open it here: the RefKV is encoded where it will be sampled, and returned to the driver.
            # This worker's own render reads it from its device cache (filled by whichever of the two
            # calls gets there first), so it gets no handle: it must not wait on its own queued call.
            ref.object_ref, info_ref = worker.handle.encode.options(num_returns=2).remote(ref.task)
            ref.ready = False
            ref.object_node = worker.info.node_id if worker.info else None
            self._futures[info_ref] = ("encode", index, ref)
            self.stats.encodes_requested += 1
        elif ref.ready:
            # A holder gets the handle too: it is only read if its LRU evicted the RefKV meanwhile.
            if index in ref.holders or self._fetch_is_cheaper(ref, worker):
                handle = [ref.object_ref]
                if index not in ref.holders:
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
        future = worker.handle.render.remote(task, handle)
        self._futures[future] = ("render", index, ref, task)
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
        batch, rest = take_batch(
            list(ref.pending), lambda item: batch_key(ref.task.key, item.settings), self.config.max_batch
        )
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
            self._encode_result(future, index, ref)
            return 0
        (task,) = rest
        worker.in_flight -= 1
        ref.in_flight -= 1
        try:
            outcomes: list[ItemOutcome] = ray.get(future, timeout=0)
        except Exception as e:
            return self._worker_failed(index, ref, task, e)
        if outcomes and outcomes[0].refkv_source == "encoded":
            self._count_encode(ref.task.reference_hash)
        if outcomes and outcomes[0].refkv_source == "object_store":
            self._measure_transfer(ref, worker, outcomes[0].fetch_seconds)
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

    def _encode_result(self, future: ray.ObjectRef, index: int, ref: _Reference) -> None:
        try:
            info: EncodeInfo = ray.get(future, timeout=0)  # the small return; the RefKV stays where it is
        except Exception as e:
            log.warning(
                "encode of reference %s on worker %d failed (%s); its renders will encode it themselves",
                ref.task.reference_hash[:12],
                index,
                type(e).__name__,
            )
            ref.object_ref, ref.ready = None, False
            ref.holders.discard(index)
            return
        if info.encoded:
            self._count_encode(ref.task.reference_hash)
        ref.ready = ref.object_ref is not None
        ref.nbytes, ref.encode_seconds = info.nbytes, info.encode_seconds

    def _retry_or_fail(self, ref: _Reference, item: WorkItem, outcome: ItemOutcome) -> int:
        attempt = self._attempts.get(item.item_id, 0) + 1
        self._attempts[item.item_id] = attempt
        if attempt >= self.config.max_attempts:
            self.on_failed(outcome, item, attempt)
            self.stats.failed_items += 1
            return 1
        self.stats.retried_items += 1
        ref.pending.appendleft(item)
        return 0

    def _worker_failed(self, index: int, ref: _Reference, task: RenderTask, error: Exception) -> int:
        worker = self.workers[index]
        self.stats.worker_failures += 1
        log.warning(
            "worker %d failed a batch of %d (%s: %s); requeueing, probing the worker",
            index,
            len(task.items),
            type(error).__name__,
            str(error).splitlines()[0][:200],
        )
        for r in self._open:
            r.holders.discard(index)  # a restarted worker has an empty device cache
        if worker.available and not worker.retired:
            worker.available = False
            self._send_probe(worker, index)
        message = f"{type(error).__name__}: {str(error).splitlines()[0][:500]}"
        finished = 0
        for item in task.items:
            finished += self._retry_or_fail(ref, item, ItemOutcome(item.item_id, error=message, stage="worker"))
        if self.on_progress and finished:
            self.on_progress(finished)
        return finished

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
                    return
            worker.probe_due = time.monotonic() + self.config.probe_interval_s
            return
        worker.available, worker.probe, worker.probe_failures = True, None, 0
        worker.in_flight = max(worker.in_flight, 0)
        log.info("worker %d is back (%s)", index, worker.info.worker_id)

    def _close_finished_references(self) -> None:
        still_open = []
        for ref in self._open:
            if ref.pending or ref.in_flight:
                still_open.append(ref)
            else:
                ref.object_ref = None  # drop the driver's reference: the object store frees the RefKV
                ref.ready = False
        self._open = still_open
