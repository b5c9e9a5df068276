"""The driver's start-up heap is left out of the GC's collections while a job and its loop run, and only then."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Sequence

import pytest

from snapref_ray.cluster.call_records import CallKind
from snapref_ray.cluster.engine_core import EngineCore
from snapref_ray.cluster.scheduling_policy import Dispatch, FreeWorker, ReturnedCall, StepOutcome
from snapref_ray.cluster.static_heap import static_heap


class _Cycle:
    def __init__(self) -> None:
        self.me = self  # only the cyclic collector frees it


def _cycle() -> weakref.ref:
    """A weak reference to an unreachable reference cycle."""
    return weakref.ref(_Cycle())


class _StepsThenDone:
    """A policy with work for `steps` steps and nothing to send: what the loop's GC state is while it runs."""

    def __init__(self, steps: int) -> None:
        self.left = steps
        self.frozen_while_running: list[int] = []
        self.made_in_loop: weakref.ref | None = None
        self.made_before: weakref.ref | None = None
        self.before_alive_in_loop: bool | None = None

    def has_work(self) -> bool:
        self.frozen_while_running.append(gc.get_freeze_count())
        if self.left == 1:  # the last step: a collection now frees the loop's own garbage, not the older one
            self.made_in_loop = _cycle()
            gc.collect()
            self.before_alive_in_loop = self.made_before() is not None
        self.left -= 1
        return self.left >= 0

    def schedule(self, free: Sequence[FreeWorker]) -> list[Dispatch]:
        return []

    def update(self, returned: Sequence[ReturnedCall]) -> StepOutcome:
        return StepOutcome()

    def pause_s(self) -> float | None:
        return 0.0

    def suspect_nodes(self) -> frozenset[str]:
        return frozenset()


def test_the_loop_freezes_the_heap_it_starts_with_and_unfreezes_it_at_its_end():
    gc.collect()
    assert gc.get_freeze_count() == 0
    policy = _StepsThenDone(3)
    policy.made_before = _cycle()  # garbage of before the loop
    core = EngineCore([], policy, kind=CallKind.RENDER, per_worker=1, classify=lambda e: None)
    core.run()
    assert len(policy.frozen_while_running) == 4
    assert min(policy.frozen_while_running) > 1_000  # the process's modules and their objects, at least
    assert policy.made_in_loop() is None  # the loop's own cycles are collected while it runs
    assert policy.before_alive_in_loop is True  # ... the start-up heap's are not looked at
    assert gc.get_freeze_count() == 0  # and after the loop they are
    gc.collect()
    assert policy.made_before() is None


def test_static_heap_nests_and_unfreezes_when_the_outermost_ends_however_it_ends():
    gc.collect()
    with pytest.raises(RuntimeError, match="a job failed"):
        with static_heap():
            frozen = gc.get_freeze_count()
            assert frozen > 1_000
            with static_heap():  # a job's loop inside the job: still frozen after it
                pass
            assert gc.get_freeze_count() >= frozen
            raise RuntimeError("a job failed")
    assert gc.get_freeze_count() == 0

    @static_heap()
    def job() -> int:
        return gc.get_freeze_count()

    assert job() > 1_000 and gc.get_freeze_count() == 0
