"""What each call in flight carries: one frozen record type per kind of call, so the code that collects a call reads
named fields of the right type instead of a field whose meaning changes with the kind. No Ray here: a RefKV is an
opaque handle (the loop's `ray.ObjectRef`)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from snapref_ray.cluster.placement import QueuedReference
    from snapref_ray.cluster.tasks import RenderTask


class CallKind(StrEnum):
    """What a worker is asked; a worker's load is counted per kind (`InFlight.load`)."""

    ENCODE = "encode"  # RenderWorker.encode's small return (EncodeInfo): a reference was opened
    RENDER = "render"  # RenderWorker.render: a batch's outcomes
    PROBE = "probe"  # RenderWorker.info on a worker that lost a call: is it back?
    EVALUATE = "evaluate"  # RenderWorker.evaluate: one identity-evaluation case
    START = "start"  # RenderWorker.info on an actor the elastic pool started: it joins (or failed to start)
    RELEASE = "release"  # a worker the policy gave back: its shard report (RenderWorker.publish_outputs)
    PUBLISH = "publish"  # RenderWorker.publish_outputs on a worker that stays: it stages its open shard


@dataclass(frozen=True)
class CallRecord:
    """What every call's record says: the worker it went to (an index into the loop's workers)."""

    kind: ClassVar[CallKind]
    worker: int


@dataclass(frozen=True)
class EncodeCall(CallRecord):
    """An encode that opens `reference` on the worker. Its RefKV (`refkv`, the handle) stays in the object store and
    is never waited on: the call's small `EncodeInfo` return is what comes back here."""

    kind: ClassVar[CallKind] = CallKind.ENCODE
    reference: QueuedReference
    refkv: object


@dataclass(frozen=True)
class RenderCall(CallRecord):
    """A batch of `reference`'s items; `refkv` is the handle it was given (None: its device cache, or it encodes)."""

    kind: ClassVar[CallKind] = CallKind.RENDER
    reference: QueuedReference
    task: RenderTask
    refkv: object | None = None


@dataclass(frozen=True)
class ProbeCall(CallRecord):
    """`info()` on a worker that lost a call: is it back?"""

    kind: ClassVar[CallKind] = CallKind.PROBE


@dataclass(frozen=True)
class EvaluateCall(CallRecord):
    """One identity-evaluation case, by its index in the evaluation's cases."""

    kind: ClassVar[CallKind] = CallKind.EVALUATE
    case: int


@dataclass(frozen=True)
class StartCall(CallRecord):
    """An actor of the elastic pool that became ready (`worker`: its index now) or failed to start (`worker` -1)."""

    kind: ClassVar[CallKind] = CallKind.START


@dataclass(frozen=True)
class ReleaseCall(CallRecord):
    """A worker the policy gave back (no work left for it), killed by the loop: its value is the `ShardReport` of
    what it staged on the way out, or None."""

    kind: ClassVar[CallKind] = CallKind.RELEASE


@dataclass(frozen=True)
class PublishCall(CallRecord):
    """An idle worker kept by a run that may still grow, asked to stage its open webdataset shard now (so the
    verdicts on its renders, and the re-renders they ask for, need not wait for its release)."""

    kind: ClassVar[CallKind] = CallKind.PUBLISH


Call = EncodeCall | RenderCall | ProbeCall | EvaluateCall | StartCall | ReleaseCall | PublishCall
