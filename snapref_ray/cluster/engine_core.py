"""The engine core: a short loop over Ray workers that is handed a scheduling policy (cluster/scheduling_policy.py).

One step is vLLM v1's `EngineCore.step()`: `schedule` (the policy: free workers in, dispatches out), execute (send
them, `ray.wait` for one call), `update` (the policy: returned calls in, finished/requeued/stats out). The loop owns
what is Ray's: the actor handles, the futures in flight (cluster/calls.py), the reading of an exception (`classify`:
the exception a call raised -> a cause, or None for the call's own error), the elastic pool's actors (it carries out
the policy's `PoolOrder`; an actor that becomes ready comes back as a `StartCall`), the objects a call leaves in the
object store (`ObjectSlot`) and Ray's list of dead nodes; the policy owns every decision and imports neither Ray nor
torch. The stats each update returns are summed here, in one place (`stats.update`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence, Set
from typing import Any

import ray

from snapref_ray.cluster.call_records import CallKind, ReleaseCall, StartCall
from snapref_ray.cluster.calls import InFlight
from snapref_ray.cluster.pool import WorkerPool, kill, release
from snapref_ray.cluster.scheduling_policy import (
    Dispatch,
    FreeWorker,
    ObjectSlot,
    ReturnedCall,
    SchedulingPolicy,
    StepOutcome,
)
from snapref_ray.cluster.static_heap import static_heap

log = logging.getLogger(__name__)

# An exception a call raised -> the cause the policy reads, or None (the call's own code raised).
Classify = Callable[[Exception], str | None]


class EngineStalled(RuntimeError):
    """The policy has work, but sent nothing and nothing is in flight: no worker can take it."""


class EngineCore:
    """Runs a policy's calls over `workers` (and those `pool` starts), at most `per_worker` calls of `kind` out
    each; `fence` is checked once per step (the output's lease); see the module docstring."""

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
        stats: Any = None,
        pool: WorkerPool | None = None,
        on_worker: Callable[[ray.actor.ActorHandle, object], None] | None = None,
        fence: Callable[[], object] | None = None,
        dead_nodes: Callable[[Set[str]], Set[str]] | None = None,
    ) -> None:
        self.workers, self.policy, self.kind = list(workers), policy, kind
        self.per_worker, self.classify, self.wait_timeout_s = per_worker, classify, wait_timeout_s
        self.on_step = on_step  # each step's outcome, as a value (logging, tests)
        self.pool, self.on_worker, self.fence, self.dead_nodes = pool, on_worker, fence, dead_nodes
        self.calls = InFlight()
        self.stats = Counter() if stats is None else stats  # the sum of the policy's stats (anything with update)

    def run(self) -> Any:
        """Step until the policy has no work and no call of `kind` is out; returns the summed stats."""
        with static_heap():  # the heap the loop starts with is left out of its collections (static_heap.py)
            while self.policy.has_work() or self.calls.count(self.kind):
                self.step()
        return self.stats

    def step(self) -> StepOutcome:
        if self.fence is not None:
            self.fence()
        if self.pool is not None:
            released = self._carry_out_pool_order()
            if released:  # what they held may give work back (a lost shard, a re-render): the pool scales first
                return self._update(released)
        free = [FreeWorker(i, self.per_worker - self.calls.load(i, self.kind)) for i in range(len(self.workers))]
        for dispatch in self.policy.schedule([w for w in free if w.slots > 0]):
            self._send(dispatch)
        starting = self.pool.starting_futures() if self.pool is not None else []
        if not self.calls and not starting:
            pause = self.policy.pause_s()
            if pause is None:
                raise EngineStalled("work is queued but nothing was sent and nothing is in flight")
            time.sleep(pause)  # only workers waiting for their next probe, or losses Ray has yet to settle, are left
            return self._update([])  # ... so ask Ray about the lost workers' nodes each pause too
        ready = self.calls.wait(also=starting, timeout=self.wait_timeout_s)
        joining = set(starting)
        return self._update([self._joined(f) if f in joining else self._returned(f) for f in ready])

    def _update(self, returned: list[ReturnedCall]) -> StepOutcome:
        if self.dead_nodes is not None and (suspects := self.policy.suspect_nodes()):
            self.policy.nodes_dead(self.dead_nodes(set(suspects)))
        if not returned:
            return StepOutcome()
        outcome = self.policy.update(returned)
        for index in outcome.retire:
            kill(self.workers[index])
        self.stats.update(outcome.stats)
        if self.on_step is not None:
            self.on_step(outcome)
        return outcome

    def _send(self, dispatch: Dispatch) -> None:
        method = getattr(self.workers[dispatch.call.worker], dispatch.method)
        args = [[a.value] if isinstance(a, ObjectSlot) else a for a in dispatch.args]  # by reference, not fetched
        future = (method.options(**dispatch.options) if dispatch.options else method).remote(*args)
        if dispatch.fills is not None:
            dispatch.fills.value, future = future  # the object stays in the store; its small return is waited on
        self.calls.send(future, dispatch.call)

    def _returned(self, future: ray.ObjectRef) -> ReturnedCall:
        returned = self.calls.collect(future)
        cause = self.classify(returned.error) if returned.error is not None else None
        return ReturnedCall(returned.call, returned.value, returned.error, cause)

    def _joined(self, future: ray.ObjectRef) -> ReturnedCall:
        handle, info = self.pool.ready(future)
        if info is None:  # failed to start (the pool killed it)
            return ReturnedCall(StartCall(-1), error=RuntimeError(self.pool.start_failures[-1]))
        self.workers.append(handle)
        if self.on_worker is not None:
            self.on_worker(handle, info)
        return ReturnedCall(StartCall(len(self.workers) - 1), info)

    def _carry_out_pool_order(self) -> list[ReturnedCall]:
        order = self.policy.scale(len(self.pool.starting))
        if order.launch:
            self.pool.launch(order.launch)
        if order.cancel_starting and (cancelled := self.pool.cancel_starting()):
            log.info("cancelled %d worker(s) still starting: no work left for them", cancelled)
        reports = release([self.workers[i] for i in order.release], publish=order.publish) if order.release else []
        return [ReturnedCall(ReleaseCall(i), report) for i, report in zip(order.release, reports)]
