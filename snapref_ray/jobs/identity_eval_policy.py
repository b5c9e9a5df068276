"""The identity evaluation's scheduling policy, on the engine core's loop (cluster/engine_core.py).

Cases are queued per right reference and a worker keeps drawing from the reference it last had (else one no other
worker has), so each reference's RefKV is encoded on as few workers as possible. A call lost to the cluster (the
loop's `classify` names a cause: a worker died, Ray already retried once) is queued again at the front of its
reference, up to `max_attempts` sends of the case; an exception that is not the cluster's is raised. A case whose
worker returned {"error": ...} is reported as that error (one bad image must not stop the evaluation).

Values in and out (cluster/scheduling_policy.py): no Ray, no torch, tested without either.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from snapref_ray.cluster.call_records import EvaluateCall
from snapref_ray.cluster.scheduling_policy import Dispatch, FreeWorker, ReturnedCall, SchedulingPolicy, StepOutcome


class IdentityEvalPolicy(SchedulingPolicy):
    """Affinity per right reference, retries of lost calls; `results` and `errors` by case index."""

    def __init__(self, cases: Sequence[dict], workers: int, max_attempts: int) -> None:
        self.cases, self.max_attempts = list(cases), max_attempts
        self.queues: OrderedDict[str, list[int]] = OrderedDict()
        for i, case in enumerate(self.cases):
            self.queues.setdefault(case["right_hash"], []).append(i)
        self.current: list[str | None] = [None] * workers  # the reference each worker had last
        self.attempts = [0] * len(self.cases)
        self.results: dict[int, dict] = {}
        self.errors: dict[int, str] = {}

    def has_work(self) -> bool:
        return bool(self.queues)

    def schedule(self, free: Sequence[FreeWorker]) -> list[Dispatch]:
        dispatches = []
        for worker in free:
            for _ in range(worker.slots):
                if not self.queues:
                    return dispatches
                dispatches.append(self._next_case(worker.index))
        return dispatches

    def _next_case(self, worker: int) -> Dispatch:
        """A case of the reference `worker` last had, else of one no other worker has (else the oldest)."""
        key = self.current[worker]
        if key not in self.queues:
            busy = {k for k in self.current if k is not None}
            key = next((k for k in self.queues if k not in busy), next(iter(self.queues)))
            self.current[worker] = key
        i = self.queues[key].pop(0)
        if not self.queues[key]:
            del self.queues[key]
        self.attempts[i] += 1
        return Dispatch(EvaluateCall(worker, i), "evaluate", (self.cases[i],))

    def update(self, returned: Sequence[ReturnedCall]) -> StepOutcome:
        finished, requeued = [], []
        for r in returned:
            assert isinstance(r.call, EvaluateCall)
            i = r.call.case
            if r.error is not None:
                if r.cause is None:
                    raise r.error
                if self.attempts[i] < self.max_attempts:
                    self.queues.setdefault(self.cases[i]["right_hash"], []).insert(0, i)
                    requeued.append(i)
                    continue
                self.errors[i] = f"{type(r.error).__name__}: {r.error}"
            elif "error" in r.value:
                self.errors[i] = r.value["error"]
            else:
                self.results[i] = r.value
            finished.append(i)
        failed = sum(1 for i in finished if i in self.errors)
        stats = {"cases_done": len(finished) - failed, "cases_failed": failed, "cases_requeued": len(requeued)}
        return StepOutcome(tuple(finished), tuple(requeued), stats)
