"""Small typed messages between the driver and the workers (they cross process boundaries)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from snapref_ray.render_service.references import RefKVKey
from snapref_ray.storage.shards import ClosedShard

if TYPE_CHECKING:  # a job's item is only carried here; its module (the job's planning) imports torch
    from snapref_ray.render_service.work_items import WorkItem


@dataclass(frozen=True)
class ReferenceTask:
    """One reference to encode: its images, how they are read together, and the RefKV key it fills."""

    reference_hash: str
    uris: tuple[str, ...]
    layout: str  # "single" | "pair" | "multi"
    key: RefKVKey  # what the RefKV is valid for: the images, caption, size and target grid

    @staticmethod
    def for_item(item: WorkItem) -> ReferenceTask:
        return ReferenceTask(
            item.reference_hash,
            tuple(item.reference.uris),
            item.reference.layout,
            RefKVKey.for_settings(item.reference_hash, item.settings),
        )


@dataclass(frozen=True)
class RenderTask:
    """A batch of items that share a reference and batch-compatible settings."""

    task_id: int
    reference: ReferenceTask
    items: tuple[WorkItem, ...]
    attempts: dict[str, int] = field(default_factory=dict)  # item_id -> attempt number (1-based)


@dataclass(frozen=True)
class ShardReport:
    """What a webdataset worker's shards did since its last answer (storage/shards.py `ShardWriter.drain`).

    The driver counts an item done only once its shard is committed (cluster/shard_ledger.py); `writer` names the
    worker's process, so a restarted actor, whose open shard died with the old process, is told apart.
    """

    writer: str
    closed: tuple[ClosedShard, ...] = ()


@dataclass(frozen=True)
class ItemOutcome:
    """What happened to one item: a metadata row when its image is stored, else the error."""

    item_id: str
    row: dict | None = None
    error: str | None = None
    stage: str = "sample"
    # Where the batch's RefKV came from: "cache" (the worker's device LRU), "object_store" (the
    # driver-owned copy), "encoded" (this call ran the reference stream); "" when it failed first.
    # The driver counts real encodes from it (a holder that evicted a RefKV re-encodes silently).
    refkv_source: str = ""
    # Seconds `ray.get` took for the RefKV when it came from the object store (the driver turns
    # the first cross-node one into a bandwidth for its fetch-or-encode decisions).
    fetch_seconds: float = 0.0
    # The worker's memory fit after this batch (render_service/memory.py), on the first outcome of a batch.
    memory: list[dict] | None = None
    # The error class when the driver's RefKV could not be fetched (lost, its creator dead, timed
    # out; cluster/failures.py) and this call encoded the reference instead; "" otherwise.
    refkv_lost: str = ""
    # The batch ran out of device memory (torch.OutOfMemoryError; `error` has the figures): the
    # driver splits it rather than charging an attempt to its items.
    out_of_memory: bool = False
    # Webdataset workers, on the first outcome of each answer: the shards closed since the last one. A row with a
    # `shard_key` is committed only with that shard.
    shards: ShardReport | None = None


@dataclass(frozen=True)
class EncodeInfo:
    """The small second return of `RenderWorker.encode`: the driver waits on this, never on the RefKV.

    Waiting on (or getting) the RefKV itself would pull ~1 GB to the driver's node for every
    reference; this object is a few hundred bytes and still fails when the encode failed.
    """

    reference_hash: str
    nbytes: int
    encode_seconds: float
    worker_id: str
    encoded: bool  # False when the worker's cache already held it (a render on it encoded first)


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    node_id: str
    device: str
    pid: int
    load_seconds: float
    memory_budget_bytes: int | None = None  # the host memory this worker asked Ray for (None: none asked)
    # ColdStart.as_dict() (render_service/cold_start.py): model load, compile built/loaded, warm-up, first image s.
    # The driver puts it, per worker, into the job summary's "cold_start" list.
    cold_start: dict | None = None
