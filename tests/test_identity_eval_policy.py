"""The identity evaluation's policy, one step at a time as values: no Ray, no workers (jobs/identity_eval_policy.py)."""

from __future__ import annotations

import pytest

from snapref_ray.cluster.call_records import EvaluateCall
from snapref_ray.cluster.scheduling_policy import FreeWorker, ReturnedCall
from snapref_ray.jobs.identity_eval_policy import IdentityEvalPolicy


def cases(*right_hashes: str) -> list[dict]:
    return [{"case_id": f"c{i}", "right_hash": h} for i, h in enumerate(right_hashes)]


def sent(dispatches) -> list[tuple[int, str, int]]:
    """(worker, the case's right reference, case index) per dispatch."""
    return [(d.call.worker, d.args[0]["right_hash"], d.call.case) for d in dispatches]


def test_a_step_as_values_free_workers_in_dispatches_out_returns_in_finished_out():
    policy = IdentityEvalPolicy(cases("a", "a", "b", "b"), workers=2, max_attempts=2)
    dispatches = policy.schedule([FreeWorker(0, 1), FreeWorker(1, 1)])
    # Each worker takes a reference no other worker has: a's RefKV on worker 0, b's on worker 1.
    assert sent(dispatches) == [(0, "a", 0), (1, "b", 2)]
    assert dispatches[0].method == "evaluate" and dispatches[0].args == (policy.cases[0],)
    outcome = policy.update([ReturnedCall(d.call, {"loss": 1.0}) for d in dispatches])
    assert outcome.finished == (0, 2) and outcome.requeued == ()
    assert outcome.stats == {"cases_done": 2, "cases_failed": 0, "cases_requeued": 0}
    # Affinity: each worker keeps drawing from the reference it had.
    assert sent(policy.schedule([FreeWorker(1, 1), FreeWorker(0, 1)])) == [(1, "b", 3), (0, "a", 1)]
    assert not policy.has_work()


def test_a_call_lost_to_the_cluster_is_queued_again_first_until_its_attempts_are_spent():
    policy = IdentityEvalPolicy(cases("a", "a"), workers=1, max_attempts=2)
    (first,) = policy.schedule([FreeWorker(0, 1)])
    lost = RuntimeError("worker died")
    outcome = policy.update([ReturnedCall(first.call, error=lost, cause="ActorDiedError")])
    assert outcome.requeued == (0,) and outcome.finished == () and outcome.stats["cases_requeued"] == 1
    (again,) = policy.schedule([FreeWorker(0, 1)])
    assert again.call.case == 0  # at the front of its reference's queue
    outcome = policy.update([ReturnedCall(again.call, error=lost, cause="ActorDiedError")])
    assert outcome.finished == (0,) and policy.errors == {0: "RuntimeError: worker died"}
    assert outcome.stats["cases_failed"] == 1


def test_an_error_that_is_not_the_clusters_is_raised():
    policy = IdentityEvalPolicy(cases("a"), workers=1, max_attempts=3)
    (d,) = policy.schedule([FreeWorker(0, 1)])
    with pytest.raises(KeyError):
        policy.update([ReturnedCall(d.call, error=KeyError("bug"), cause=None)])


def test_a_case_the_worker_could_not_evaluate_is_reported_with_its_error():
    policy = IdentityEvalPolicy(cases("a"), workers=1, max_attempts=3)
    (d,) = policy.schedule([FreeWorker(0, 2)])
    policy.update([ReturnedCall(d.call, {"case_id": "c0", "error": "unreadable image"})])
    assert policy.errors == {0: "unreadable image"} and policy.results == {}


def test_schedule_fills_each_workers_free_slots_and_no_more():
    policy = IdentityEvalPolicy(cases("a", "a", "a", "b"), workers=2, max_attempts=1)
    assert [d.call.worker for d in policy.schedule([FreeWorker(0, 2), FreeWorker(1, 1)])] == [0, 0, 1]
    assert isinstance(policy.schedule([FreeWorker(0, 5)])[0].call, EvaluateCall)
    assert not policy.has_work()
