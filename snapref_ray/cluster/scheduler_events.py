"""What the batch schedule tells as it goes (`SchedulerEvent`, one of `EVENT_KINDS`): for monitoring, and for tests
that must act at an exact moment of a job. No Ray here."""

from __future__ import annotations

from dataclasses import dataclass

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
