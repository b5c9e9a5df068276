"""Small typed messages between the driver and the workers (they cross process boundaries)."""

from __future__ import annotations

from dataclasses import dataclass, field

from snapref_ray.storage.work_items import WorkItem


@dataclass(frozen=True)
class ReferenceTask:
    """One reference to encode: its images and everything the reference stream depends on."""

    reference_hash: str
    uris: tuple[str, ...]
    layout: str  # "single" | "pair" | "multi"
    ref_caption: str
    ref_megapixels: float
    width: int
    height: int

    @property
    def key(self) -> tuple:
        """What a cached RefKV is valid for: the same images, caption, size and target grid."""
        return (self.reference_hash, self.ref_caption, self.ref_megapixels, self.width // 16, self.height // 16)

    @staticmethod
    def for_item(item: WorkItem) -> ReferenceTask:
        s = item.settings
        return ReferenceTask(
            item.reference_hash,
            tuple(item.reference.uris),
            item.reference.layout,
            s.ref_caption,
            s.ref_megapixels,
            s.width,
            s.height,
        )


def batch_shape(settings) -> tuple[int, int, int]:
    """(width, height, rows per image) of a forward: what its memory grows with. The rows are the conditional
    one, the unconditional one under CFG and the reference-guidance one (as the worker's batch fitter counts)."""
    rows = 1 + (settings.cfg != 1.0) + (settings.ref_guidance != 1.0 and settings.ref_weight > 0)
    return settings.width, settings.height, rows


@dataclass(frozen=True)
class RenderTask:
    """A batch of items that share a reference and batch-compatible settings."""

    task_id: int
    reference: ReferenceTask
    items: tuple[WorkItem, ...]
    attempts: dict[str, int] = field(default_factory=dict)  # item_id -> attempt number (1-based)


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
    # The error class when the driver's RefKV could not be fetched (lost, its creator dead, timed
    # out; cluster/failures.py) and this call encoded the reference instead; "" otherwise.
    refkv_lost: str = ""
    # The batch ran out of device memory (torch.OutOfMemoryError; `error` has the figures): the
    # driver splits it rather than charging an attempt to its items.
    out_of_memory: bool = False


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
