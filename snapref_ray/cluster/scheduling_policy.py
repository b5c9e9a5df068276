"""The interface between the engine core's loop (cluster/engine_core.py) and a scheduling policy, in values.

vLLM v1's split: the loop sends, waits and collects; the policy decides. One step is
`schedule(free workers) -> dispatches`, the loop sends them and waits, then `update(returned calls) -> StepOutcome`
(finished, requeued, stats). Everything that crosses is a frozen value, so one step can be logged and a policy tested
without Ray: a worker is its index, a call's record is its kind's own type (cluster/call_records.py), and an
exception a call raised comes with the loop's reading of it (`ReturnedCall.cause`), never for the policy to parse.

What else is Ray's reaches the policy as values too: an object a call puts in the object store is an `ObjectSlot`
the loop fills (the policy only names it), workers that join or are given back come back as calls
(call_records.py `StartCall`, `ReleaseCall`), the nodes Ray lists dead are handed in (`nodes_dead`), and the elastic
pool is told what to do by a `PoolOrder`. A policy without a pool or probes leaves those methods as they are here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any, Protocol

from snapref_ray.cluster.call_records import Call


@dataclass(frozen=True)
class FreeWorker:
    """A worker that may take `slots` more calls now (the loop's bound per worker, less its calls out)."""

    index: int
    slots: int


class ObjectSlot:
    """An object in Ray's object store that the policy names but never holds (a RefKV): the loop puts the first
    return of the call that makes it here (`Dispatch.fills`), and passes it by reference (in a one-element list, so
    Ray does not fetch it for the call) wherever a dispatch's args name the slot."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: Any = None


@dataclass(frozen=True)
class Dispatch:
    """A call the policy decided: its record, and what the loop calls on the worker (`method(*args)`, with Ray's
    call `options`). `fills`: the call has two returns; the first goes into this slot, the loop waits on the second."""

    call: Call
    method: str
    args: tuple[object, ...] = ()
    options: Mapping[str, object] = field(default_factory=dict)
    fills: ObjectSlot | None = None


@dataclass(frozen=True)
class PoolOrder:
    """What the elastic pool does now: start `launch` more actors; kill those still starting (`cancel_starting`);
    give back workers `release` (each stages what it holds first when `publish`; each comes back as a ReleaseCall)."""

    launch: int = 0
    cancel_starting: bool = False
    release: tuple[int, ...] = ()
    publish: bool = True


@dataclass(frozen=True)
class ReturnedCall:
    """A call that came back: its record, its value or the exception it raised, and `cause`: the loop's reading of
    that exception (None when it succeeded, or when the loop's classifier says it is the call's own error)."""

    call: Call
    value: object = None
    error: Exception | None = None
    cause: str | None = None


@dataclass(frozen=True)
class StepOutcome:
    """What one update decided: work finished for good (done or failed), work queued again, and the counts it adds
    to the run's stats (the loop sums them; no one else writes them)."""

    finished: tuple[object, ...] = ()
    requeued: tuple[object, ...] = ()
    stats: Any = field(default_factory=dict)  # a mapping of counts, or the policy's own stats type (a delta)
    retire: tuple[int, ...] = ()  # workers given up for dead: the loop kills their actors


class SchedulingPolicy(Protocol):
    """What the engine core is handed: see the module docstring."""

    def has_work(self) -> bool:
        """Whether work is queued that is not finished (the loop also runs while calls are out)."""
        ...

    def schedule(self, free: Sequence[FreeWorker]) -> list[Dispatch]:
        """The calls to send now, at most `slots` per free worker."""
        ...

    def update(self, returned: Sequence[ReturnedCall]) -> StepOutcome:
        """Take in the calls that came back."""
        ...

    def scale(self, starting: int) -> PoolOrder:
        """What the elastic pool does before this step's dispatch (`starting`: actors not ready yet)."""
        return PoolOrder()

    def pause_s(self) -> float | None:
        """Nothing is out and nothing sent: how long to wait before stepping again (a probe due later), or None
        (the loop is stalled)."""
        return None

    def suspect_nodes(self) -> Set[str]:
        """Nodes whose death the policy waits to learn of (the loop asks Ray and answers with `nodes_dead`)."""
        return frozenset()

    def nodes_dead(self, dead: Set[str]) -> None:
        """Of `suspect_nodes`, those Ray lists dead."""
