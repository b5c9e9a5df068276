"""The driver-side loop: reference affinity, K/V hand-off through the object store, retries.

Ray Data has no key affinity and `ActorPool` neither replaces dead actors nor resubmits their
work (ray-notes.md), so the job runs its own loop over `ray.wait`:

- Items are grouped by reference. A reference is *opened* by asking one worker to encode it;
  the RefKV that call returns is owned by the driver and lives in the object store while the
  reference has work left, then the driver drops it (only references in flight are stored).
- A free worker takes, in order: more prompts of a reference it already holds on its device;
  a new reference (encoded where it will be sampled); prompts of another open reference, read
  from the object store when that is cheaper than encoding (same node: shared memory; other
  node: bytes / bandwidth against the measured encode time), else encoded locally.
- Each worker has at most `max_in_flight_per_worker` calls outstanding, so neither the object
  store nor driver memory grows with the job.
- A call that fails because its worker died is requeued (attempts are counted per item); the
  actor restarts by itself and is probed before it gets work again. An item that keeps failing
  is reported as an error with its last exception.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import ray

from snapref_ray.cluster.tasks import ItemOutcome, ReferenceTask, RenderTask, WorkerInfo
from snapref_ray.storage.work_items import WorkItem

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    max_in_flight_per_worker: int = 2
    max_attempts: int = 3
    max_batch: int = 4
    max_open_references: int | None = None  # default: 2 per worker
    wait_timeout_s: float = 1.0
    # Cross-node transfer rate for the fetch-or-encode decision (10 GbE ~ 1.25 GB/s).
    transfer_bytes_per_s: float = 1.25e9
    # A RefKV's size before one is measured: 1 MP at real size in bf16 (ray-notes.md).
    assumed_refkv_bytes: int = 940_000_000


@dataclass
class _Reference:
    task: ReferenceTask
    pending: deque[WorkItem]
    in_flight: int = 0
    object_ref: ray.ObjectRef | None = None
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


@dataclass
class SchedulerStats:
    dispatched_batches: int = 0
    encodes_requested: int = 0
    local_encodes: int = 0
    fetches: int = 0
    worker_failures: int = 0
    retried_items: int = 0
    failed_items: int = 0
    done_items: int = 0
    peak_open_references: int = 0


class BatchScheduler:
    """Runs work items over a fixed set of RenderWorker actors; see the module docstring."""

    def __init__(self, workers: Sequence[ray.actor.ActorHandle], infos: Sequence[WorkerInfo | None],
                 config: SchedulerConfig, *, on_done: Callable[[ItemOutcome, WorkItem], None],
                 on_failed: Callable[[ItemOutcome, WorkItem, int], None],
                 on_progress: Callable[[int], None] | None = None) -> None:
        self.workers = [_Worker(h, i) for h, i in zip(workers, infos)]
        self.config = config
        self.max_open = config.max_open_references or 2 * len(self.workers)
        self.on_done, self.on_failed, self.on_progress = on_done, on_failed, on_progress
        self.stats = SchedulerStats()
        self._attempts: dict[str, int] = {}
        self._futures: dict[ray.ObjectRef, tuple] = {}
        self._next_task_id = 0

    # -- main loop -------------------------------------------------------------------------------
    def run(self, items: Sequence[WorkItem]) -> SchedulerStats:
        groups: dict[tuple, _Reference] = {}
        for item in items:
            task = ReferenceTask.for_item(item)
            groups.setdefault(task.key, _Reference(task, deque())).pending.append(item)
        self._unopened: deque[_Reference] = deque(groups.values())
        self._open: list[_Reference] = []
        remaining = len(items)
        while remaining > 0:
            self._dispatch()
            if not self._futures:
                raise RuntimeError("scheduler stalled: items remain but nothing is in flight (no available worker)")
            ready, _ = ray.wait(list(self._futures), num_returns=1, timeout=self.config.wait_timeout_s)
            for ref in ready:
                remaining -= self._collect(ref)
            self._close_finished_references()
        return self.stats

    def _dispatch(self) -> None:
        for index, worker in enumerate(self.workers):
            while worker.available and worker.in_flight < self.config.max_in_flight_per_worker:
                if not self._dispatch_one(index, worker):
                    break

    def _dispatch_one(self, index: int, worker: _Worker) -> bool:
        ref = self._pick_reference(index)
        if ref is None:
            return False
        batch = self._take_batch(ref)
        handle = None
        if index not in ref.holders:
            if ref.object_ref is None:
                # Open it here: the RefKV is encoded where it will be sampled, and returned to the driver.
                ref.object_ref = worker.handle.encode.remote(ref.task)
                ref.object_node = worker.info.node_id if worker.info else None
                self._futures[ref.object_ref] = ("encode", index, ref)
                self.stats.encodes_requested += 1
                handle = [ref.object_ref]
            elif self._fetch_is_cheaper(ref, worker):
                handle = [ref.object_ref]
                self.stats.fetches += 1
            else:
                self.stats.local_encodes += 1
            ref.holders.add(index)
        task = RenderTask(self._next_task_id, ref.task, tuple(batch),
                          {i.item_id: self._attempts.get(i.item_id, 0) + 1 for i in batch})
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
        # Help with the open reference that has the most work per holder.
        candidates = [r for r in self._open if r.pending]
        if not candidates:
            return None
        return max(candidates, key=lambda r: len(r.pending) / max(1, len(r.holders)))

    def _take_batch(self, ref: _Reference) -> list[WorkItem]:
        first = ref.pending.popleft()
        batch, key, keep = [first], first.settings.batch_key(), deque()
        while ref.pending and len(batch) < self.config.max_batch:
            item = ref.pending.popleft()
            (batch if item.settings.batch_key() == key else keep).append(item)
        ref.pending.extendleft(reversed(keep))
        return batch

    def _fetch_is_cheaper(self, ref: _Reference, worker: _Worker) -> bool:
        if worker.info is None or ref.object_node is None or worker.info.node_id == ref.object_node:
            return True  # same node: shared memory, no copy over the network
        if ref.encode_seconds is None:
            return True  # no measurement yet: moving bytes is the safe default
        nbytes = ref.nbytes or self.config.assumed_refkv_bytes
        return nbytes / self.config.transfer_bytes_per_s < ref.encode_seconds

    # -- results -------------------------------------------------------------------------------
    def _collect(self, future: ray.ObjectRef) -> int:
        kind, index, ref, *rest = self._futures.pop(future)
        worker = self.workers[index]
        if kind == "probe":
            self._probe_result(future, worker, index)
            return 0
        if kind == "encode":
            try:
                ray.get(future, timeout=0)  # only to surface failures; the object stays in the store
            except Exception as e:
                log.warning("encode of reference %s failed (%s); its renders will encode it themselves",
                            ref.task.reference_hash[:12], type(e).__name__)
                ref.object_ref = None
                ref.holders.discard(index)
            else:
                # Keep the (finished) ref in `ref.object_ref`; nothing else to do.
                pass
            return 0
        (task,) = rest
        worker.in_flight -= 1
        ref.in_flight -= 1
        try:
            outcomes: list[ItemOutcome] = ray.get(future, timeout=0)
        except Exception as e:
            return self._worker_failed(index, ref, task, e)
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
        log.warning("worker %d failed a batch of %d (%s: %s); requeueing, probing the worker", index,
                    len(task.items), type(error).__name__, str(error).splitlines()[0][:200])
        for r in self._open:
            r.holders.discard(index)  # a restarted worker has an empty device cache
        if worker.available:
            worker.available = False
            worker.probe = worker.handle.info.remote()
            self._futures[worker.probe] = ("probe", index, None)
        message = f"{type(error).__name__}: {str(error).splitlines()[0][:500]}"
        finished = 0
        for item in task.items:
            finished += self._retry_or_fail(ref, item, ItemOutcome(item.item_id, error=message, stage="worker"))
        if self.on_progress and finished:
            self.on_progress(finished)
        return finished

    def _probe_result(self, future: ray.ObjectRef, worker: _Worker, index: int) -> None:
        try:
            worker.info = ray.get(future, timeout=0)
            worker.available = True
            worker.in_flight = 0 if worker.in_flight < 0 else worker.in_flight
            log.info("worker %d is back (%s)", index, worker.info.worker_id)
        except Exception:
            time.sleep(0.5)
            worker.probe = worker.handle.info.remote()
            self._futures[worker.probe] = ("probe", index, None)

    def _close_finished_references(self) -> None:
        still_open = []
        for ref in self._open:
            if ref.pending or ref.in_flight:
                still_open.append(ref)
            else:
                ref.object_ref = None  # drop the driver's reference: the object store frees the RefKV
        self._open = still_open
