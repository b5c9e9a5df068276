"""The batch schedule's terms: what it is told (`SchedulerConfig`), what it counts (`SchedulerStats`), what it
tells (`SchedulerEvent`) and why it requeues (`Cause`).

Placement, recovery, the pool's membership and the loop (cluster/scheduler.py) share these; none of them is Ray's,
so the placement policy that uses them runs and is tested without Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class Cause(StrEnum):
    """Why items were requeued without counting an attempt (summary.json `requeues`); cluster/failures.py tells
    which from the exception a call raised."""

    WORKER_LOST = "worker_lost"  # the worker's process died (its node is alive)
    NODE_LOST = "node_lost"  # the worker's whole node died
    OOM_KILLED = "oom_killed"  # Ray's memory monitor killed the worker (ray.exceptions.OutOfMemoryError)
    DEVICE_OOM = "device_oom"  # torch.OutOfMemoryError in the worker's render: the batch was split
    REFKV_LOST = "refkv_lost"  # the batch's RefKV could not be fetched; the worker re-encoded it
    RELEASED = "released"  # the scheduler itself killed the worker (no work left, or given up for dead)
    # Rendered into a webdataset shard that will never be committed (its worker died, was restarted or could not
    # publish it): rendered again in the same run (cluster/shard_ledger.py)
    SHARD_LOST = "shard_lost"


REQUEUE_CAUSES = tuple(c.value for c in Cause)


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


EVENT_KINDS = (
    "worker_joined",  # a worker is ready and takes work
    "encode_sent",  # a worker was asked to encode a reference (opening it); node_id: where its RefKV will live
    "refkv_ready",  # that encode came back: the RefKV is in node_id's object store
    # A batch is about to go to a worker (emitted just before the call, so that a test can act before the worker
    # sees it); refkv_node: the node of a RefKV the worker is handed and lacks (it will fetch it from there).
    "render_sending",
    "item_done",  # an item's row was committed
    "item_rendered",  # an item's row came back in its worker's open webdataset shard (item_done when that commits)
    "requeued",  # items went back to the queue without an attempt; cause: a Cause
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
    # Items requeued (or, for refkv_lost, re-encoded for) because of the infrastructure, by Cause: no attempt
    # counted. The budget is max_requeues_per_item x the job's items (refkv_lost is not a requeue).
    requeues: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REQUEUE_CAUSES, 0))
    requeue_budget: int = 0
    batch_splits: int = 0  # out-of-memory batches halved
    isolated_batches: int = 0  # batches whose forward raised, retried one item at a time (no attempt counted)
    refkvs_dropped: int = 0  # RefKV handles forgotten because their creator failed or a fetch found them gone
    # Per (width, height, rows per image) dispatched: the batch cap the job ended with (max_batch unless out of
    # memory halved it) and how many splits led there.
    batch_limits: list[dict] = field(default_factory=list)
    done_items: int = 0
    # Webdataset: items rendered into shards that were never committed once the schedule had ended (a failed or
    # interrupted job's last release); they are not in done_items and render on the next run.
    uncommitted_items: int = 0
    peak_open_references: int = 0
    workers_started: int = 0  # workers that became ready (joined the schedule)
    workers_released: int = 0  # killed because no work was left for them
    worker_start_failures: int = 0
    peak_workers: int = 0  # most workers ready at once
    seconds_to_start: float = 0.0  # from run() until min_workers were ready and rendering began
