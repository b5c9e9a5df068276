"""The interface between the engine core's loop (cluster/engine_core.py) and a scheduling policy, in values.

vLLM v1's split: the loop sends, waits and collects; the policy decides. One step is
`schedule(free workers) -> dispatches`, the loop sends them and waits, then `update(returned calls) -> StepOutcome`
(finished, requeued, stats). Everything that crosses is a frozen value, so one step can be logged and a policy tested
without Ray: a worker is its index, a call's record is its kind's own type (cluster/call_records.py), and an
exception a call raised comes with the loop's reading of it (`ReturnedCall.cause`), never for the policy to parse.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from snapref_ray.cluster.call_records import Call


@dataclass(frozen=True)
class FreeWorker:
    """A worker that may take `slots` more calls now (the loop's bound per worker, less its calls out)."""

    index: int
    slots: int


@dataclass(frozen=True)
class Dispatch:
    """A call the policy decided: its record, and what the loop calls on the worker (`method(*args)`)."""

    call: Call
    method: str
    args: tuple[object, ...] = ()


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
    stats: Mapping[str, int] = field(default_factory=dict)


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
