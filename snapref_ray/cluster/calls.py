"""The driver's calls in flight, each with a typed record, and the one `ray.wait` over them.

The batch schedule (cluster/scheduler.py) and the identity evaluation (snapref_ray/jobs/identity_eval.py) both keep a
bounded number of calls out per worker, wait for any to return and collect it: `InFlight` is that core. A call's
record is of its kind's own type (cluster/call_records.py), so the code that collects it never unpacks a tuple tag
nor reads a field whose meaning changes with the kind.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from snapref_ray.cluster.call_records import Call, CallKind


@dataclass(frozen=True)
class Returned:
    """A call that came back: its record, and its value or the exception `ray.get` raised for it."""

    call: Call
    value: Any = None
    error: Exception | None = None


class InFlight:
    """The calls out, by their futures; how many of each kind each worker has; one wait over them all."""

    def __init__(self) -> None:
        self._calls: dict[ray.ObjectRef, Call] = {}
        self._load: Counter[tuple[CallKind, int]] = Counter()
        self._by_kind: Counter[CallKind] = Counter()

    def __len__(self) -> int:
        return len(self._calls)

    def send(self, future: ray.ObjectRef, call: Call) -> None:
        self._calls[future] = call
        self._load[call.kind, call.worker] += 1
        self._by_kind[call.kind] += 1

    def load(self, worker: int, kind: CallKind) -> int:
        """Calls of `kind` the worker has out."""
        return self._load[kind, worker]

    def count(self, kind: CallKind) -> int:
        """Calls of `kind` out, over every worker."""
        return self._by_kind[kind]

    def futures(self, kind: CallKind | None = None) -> list[ray.ObjectRef]:
        return [f for f, call in self._calls.items() if kind is None or call.kind == kind]

    def fill(self, workers: Iterable[int], per_worker: int, kind: CallKind, send_one: Callable[[int], bool]) -> None:
        """Give each worker calls of `kind` until it has `per_worker` out or `send_one(worker)` sends none."""
        for worker in workers:
            while self.load(worker, kind) < per_worker and send_one(worker):
                pass

    def wait(
        self, futures: Sequence[ray.ObjectRef] | None = None, *, also: Sequence[ray.ObjectRef] = (), timeout: float
    ) -> list[ray.ObjectRef]:
        """Wait until one of `futures` (default: every call out) or of `also` (the caller's own futures, such as
        workers starting) is ready, or `timeout` passes; returns those ready."""
        waiting = (self.futures() if futures is None else list(futures)) + list(also)
        ready, _ = ray.wait(waiting, num_returns=1, timeout=timeout)
        return ready

    def collect(self, future: ray.ObjectRef) -> Returned:
        """Take a ready call out of flight with what it returned (never blocks: the future is ready)."""
        call = self._calls.pop(future)
        self._load[call.kind, call.worker] -= 1
        self._by_kind[call.kind] -= 1
        try:
            return Returned(call, ray.get(future, timeout=0))
        except Exception as e:
            return Returned(call, error=e)
