"""The engine core: a short loop over Ray workers that is handed a scheduling policy (cluster/scheduling_policy.py).

One step is vLLM v1's `EngineCore.step()`: `schedule` (the policy: free workers in, dispatches out), execute (send
them, `ray.wait` for one call), `update` (the policy: returned calls in, finished/requeued/stats out). The loop owns
what is Ray's: the actor handles, the futures in flight (cluster/calls.py) and the reading of an exception
(`classify`: the exception a call raised -> a cause, or None for the call's own error); the policy owns every
decision and imports neither Ray nor torch. The stats each update returns are summed here, in one place.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence

import ray

from snapref_ray.cluster.call_records import CallKind
from snapref_ray.cluster.calls import InFlight
from snapref_ray.cluster.scheduling_policy import FreeWorker, ReturnedCall, SchedulingPolicy, StepOutcome

log = logging.getLogger(__name__)

# An exception a call raised -> the cause the policy reads, or None (the call's own code raised).
Classify = Callable[[Exception], str | None]


class EngineStalled(RuntimeError):
    """The policy has work, but sent nothing and nothing is in flight: no worker can take it."""


class EngineCore:
    """Runs a policy's calls of one kind over `workers`, at most `per_worker` out each; see the module docstring."""

    def __init__(
        self,
        workers: Sequence[ray.actor.ActorHandle],
        policy: SchedulingPolicy,
        *,
        kind: CallKind,
        per_worker: int,
        classify: Classify,
        wait_timeout_s: float = 1.0,
        on_step: Callable[[StepOutcome], None] | None = None,
    ) -> None:
        self.workers, self.policy, self.kind = list(workers), policy, kind
        self.per_worker, self.classify, self.wait_timeout_s = per_worker, classify, wait_timeout_s
        self.on_step = on_step  # each step's outcome, as a value (logging, tests)
        self.calls = InFlight()
        self.stats: Counter[str] = Counter()

    def run(self) -> Counter[str]:
        """Step until the policy has no work and no call is out; returns the summed stats."""
        while self.policy.has_work() or self.calls:
            self.step()
        return self.stats

    def step(self) -> StepOutcome:
        free = [FreeWorker(i, self.per_worker - self.calls.load(i, self.kind)) for i in range(len(self.workers))]
        for dispatch in self.policy.schedule([w for w in free if w.slots > 0]):
            handle = self.workers[dispatch.call.worker]
            self.calls.send(getattr(handle, dispatch.method).remote(*dispatch.args), dispatch.call)
        if not self.calls:
            raise EngineStalled("work is queued but nothing was sent and nothing is in flight")
        returned = [self._returned(future) for future in self.calls.wait(timeout=self.wait_timeout_s)]
        outcome = self.policy.update(returned) if returned else StepOutcome()
        self.stats.update(outcome.stats)
        if self.on_step is not None:
            self.on_step(outcome)
        return outcome

    def _returned(self, future: ray.ObjectRef) -> ReturnedCall:
        returned = self.calls.collect(future)
        cause = self.classify(returned.error) if returned.error is not None else None
        return ReturnedCall(returned.call, returned.value, returned.error, cause)
