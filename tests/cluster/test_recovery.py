"""Recovery's decisions without Ray: whose fault a failure was, what it costs, and where the items go.

The loop's part (reading an exception into a `Cause`, a probe's answer, the nodes Ray lists dead) is handed in as
values; workers are indices with a node id (cluster/members.py, itself free of Ray); a probe is asked for by making it
due (`due_probes`). Each expected count is worked out from the rules in
cluster/recovery.py's docstring, not read back from the implementation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from snapref_ray.cluster.call_records import RenderCall
from snapref_ray.cluster.members import Members
from snapref_ray.cluster.placement import Placement
from snapref_ray.cluster.recovery import Recovery, RequeueBudgetExceeded
from snapref_ray.cluster.scheduler_config import SchedulerConfig
from snapref_ray.cluster.scheduler_stats import Cause, SchedulerStats
from snapref_ray.cluster.tasks import RenderTask, WorkerInfo
from snapref_ray.render_service.references import ReferenceInput
from snapref_ray.render_service.work_items import WorkItem
from snapref_ray.requests import RenderSettings

SETTINGS = RenderSettings(width=256, height=256, steps=2)  # cfg on: 2 rows per image


def items(reference: str, n: int) -> list[WorkItem]:
    spec = ReferenceInput((f"/refs/{reference}.png",), "single", ("reference",))
    return [
        WorkItem(f"{reference}-{i}", i + 1, spec, f"hash-{reference}", f"scene {i}", i, SETTINGS, 0) for i in range(n)
    ]


@dataclass
class World:
    """A schedule of `n` items of one reference on two workers (nodes n0, n1), and what recovery told the loop."""

    n: int = 4
    max_batch: int = 4
    max_attempts: int = 2
    max_requeues_per_item: int = 10
    now: float = 0.0
    failed: list[tuple[str, int, str]] = field(default_factory=list)  # (item, attempt, error)
    events: list[tuple[str, str | None]] = field(default_factory=list)  # (kind, cause)

    def __post_init__(self) -> None:
        config = SchedulerConfig(
            max_batch=self.max_batch,
            max_attempts=self.max_attempts,
            max_requeues_per_item=self.max_requeues_per_item,
            probe_interval_s=0.5,
        )
        self.stats = SchedulerStats()
        self.placement = Placement(config, self.stats)
        self.placement.queue(items("A", self.n))
        infos = [WorkerInfo(f"w{i}", f"n{i}", "cpu", 1, 0.0) for i in range(2)]
        self.members = Members(infos, None, config, self.stats, clock=lambda: self.now)
        self.recovery = Recovery(
            config,
            self.stats,
            self.placement,
            self.members,
            on_failed=lambda outcome, item, attempt: self.failed.append((item.item_id, attempt, outcome.error)),
            on_progress=None,
            emit=lambda kind, worker, ref=None, items=(), **kw: self.events.append((kind, kw.get("cause"))),
            clock=lambda: self.now,
        )
        self.recovery.add_budget(self.n)

    def render(self, worker: int = 0) -> RenderCall:
        """The next batch, sent to `worker`, as the loop records it."""
        assignment = self.placement.assign(worker, self.members.members[worker].node_id, live_workers=2)
        task = RenderTask(0, assignment.reference.task, assignment.batch)
        return RenderCall(worker, assignment.reference, task)

    def pending(self) -> list[str]:
        return [i.item_id for r in self.placement.open for i in r.pending]


def test_an_items_own_error_costs_an_attempt_and_fails_it_after_max_attempts():
    w = World(n=1, max_attempts=2)
    call = w.render()
    assert w.recovery.render_raised(call, ValueError("bad input"), cause=None) == 0
    assert (w.stats.attempts_charged, w.stats.retried_items, w.pending()) == (1, 1, ["A-0"])
    assert w.recovery.attempt("A-0") == 2
    again = w.render()
    assert w.recovery.render_raised(again, ValueError("bad input"), cause=None) == 1
    assert w.failed == [("A-0", 2, "ValueError: bad input")] and w.stats.failed_items == 1 and w.pending() == []


def test_a_lost_worker_requeues_its_batch_at_the_front_without_an_attempt_and_is_probed():
    w = World(n=6, max_batch=4)
    call = w.render(worker=0)  # A-0..A-3; stay queued
    assert w.recovery.render_raised(call, RuntimeError("actor died"), Cause.WORKER_LOST) == 0
    assert w.pending() == ["A-0", "A-1", "A-2", "A-3", "A-4", "A-5"]
    assert w.stats.attempts_charged == 0 and w.stats.requeues[Cause.WORKER_LOST] == 4
    assert w.recovery.attempt("A-0") == 1
    assert w.recovery.due_probes() == [0] and w.members.members[0].available is False
    assert w.stats.worker_failures == 1 and w.recovery.due_probes() == []  # asked once: it is out
    assert ("requeued", Cause.WORKER_LOST) in w.events


def test_a_loss_becomes_a_node_loss_once_ray_lists_its_node_dead_else_stays_a_worker_loss():
    w = World(n=8)
    lost_on_n0, lost_on_n1 = w.render(worker=0), w.render(worker=1)
    w.recovery.render_raised(lost_on_n0, RuntimeError("gone"), Cause.WORKER_LOST)
    w.recovery.render_raised(lost_on_n1, RuntimeError("gone"), Cause.WORKER_LOST)
    w.recovery.nodes_dead({"n0"} & w.recovery.suspect_nodes())  # n0's node died; n1's worker process only
    # Worker 0 answers its probe (Ray restarted it elsewhere: after declaring n0 dead); worker 1 is still restarting.
    w.recovery.probe_returned(0, WorkerInfo("w0-again", "n2", "cpu", 1, 0.0), None)
    w.recovery.probe_returned(1, None, RuntimeError("unavailable"), restarting=True)
    assert w.stats.requeues[Cause.NODE_LOST] == 4 and w.stats.requeues[Cause.WORKER_LOST] == 4
    assert w.recovery.losses_unsettled_until(grace_s=30.0) == 30.0  # n1's loss waits for Ray up to its grace
    w.now = 31.0
    assert w.recovery.losses_unsettled_until(grace_s=30.0) is None
    w.recovery.settle_losses()
    assert (w.stats.requeues[Cause.NODE_LOST], w.stats.requeues[Cause.WORKER_LOST]) == (4, 4)


def test_a_probe_that_finds_the_actor_dead_max_probe_failures_times_retires_it_but_a_restarting_one_never():
    w = World()
    w.recovery.render_raised(w.render(worker=0), RuntimeError("gone"), Cause.WORKER_LOST)
    for _ in range(10):  # restarting (ActorUnavailableError, as the loop read it): asked again, never counted
        w.recovery.probe_returned(0, None, RuntimeError("unavailable"), restarting=True)
    assert w.members.take_killed() == () and w.members.members[0].probe_due == 0.5
    for _ in range(3):  # SchedulerConfig.max_probe_failures
        w.recovery.probe_returned(0, None, RuntimeError("dead"))
    assert w.members.take_killed() == (0,) and w.members.members[0].retired


def test_the_requeue_budget_is_the_jobs_items_times_max_requeues_per_item():
    w = World(n=2, max_batch=2, max_requeues_per_item=1)  # budget: 2
    w.recovery.render_raised(w.render(), RuntimeError("gone"), Cause.WORKER_LOST)  # 2 requeues: at the budget
    with pytest.raises(RequeueBudgetExceeded, match="over the budget of 2"):
        w.recovery.render_raised(w.render(worker=1), RuntimeError("gone"), Cause.WORKER_LOST)


def test_out_of_device_memory_halves_the_batch_cap_for_its_shape_and_costs_no_attempt():
    w = World(n=4, max_batch=4)
    call = w.render()
    w.recovery.out_of_memory(call, "CUDA out of memory", Cause.DEVICE_OOM)
    assert (w.stats.batch_splits, w.stats.requeues[Cause.DEVICE_OOM], w.stats.attempts_charged) == (1, 4, 0)
    assert w.stats.worker_failures == 0  # torch's error: the worker itself is fine
    assert [i.item_id for i in w.render().task.items] == ["A-0", "A-1"]  # batches of that shape: 4 -> 2
    limits = w.placement.batch_limits()
    assert limits == [
        {"width": 256, "height": 256, "rows_per_image": 2, "batch": 2, "max_batch": 4, "out_of_memory_splits": 1}
    ]


def test_one_image_that_does_not_fit_is_its_own_failure_with_its_size():
    w = World(n=1, max_attempts=1)
    w.recovery.render_raised(w.render(), RuntimeError("killed by the memory monitor"), Cause.OOM_KILLED)
    ((item, attempt, error),) = w.failed
    assert (item, attempt) == ("A-0", 1) and "one 256x256 image (2 row(s) per image) does not fit" in error
    assert w.stats.batch_splits == 0 and w.stats.attempts_charged == 1


def test_oom_killed_keeps_the_refkvs_the_worker_encoded_a_lost_worker_drops_them():
    for cause, dropped in ((Cause.OOM_KILLED, 0), (Cause.WORKER_LOST, 1)):
        w = World(n=8, max_batch=2)
        call = w.render(worker=0)
        w.placement.opened(call.reference, "refkv-A", 0, "n0")
        w.recovery.render_raised(call, RuntimeError("gone"), cause)
        assert w.stats.refkvs_dropped == dropped, cause
        assert (call.reference.refkv is None) == bool(dropped)


def test_a_batch_whose_forward_failed_is_retried_one_item_at_a_time_without_an_attempt():
    w = World(n=3, max_batch=4)
    call = w.render()
    w.recovery.isolate(call.reference, call.task.items)
    assert w.stats.isolated_batches == 1 and w.stats.attempts_charged == 0
    assert [len(w.render().task.items) for _ in range(3)] == [1, 1, 1]


def test_a_released_worker_requeues_as_released_not_as_a_loss():
    w = World(n=2, max_batch=2)
    call = w.render(worker=1)
    w.members.members[1].released = True
    w.recovery.render_raised(call, RuntimeError("killed"), Cause.WORKER_LOST)
    assert w.stats.requeues[Cause.RELEASED] == 2 and w.stats.requeues[Cause.WORKER_LOST] == 0


def test_items_of_a_shard_that_will_never_be_committed_render_again_in_the_same_run():
    """Shards settled: a worker's process went with its open shard, so the ledger gives its items back and recovery
    requeues them as shard_lost (no attempt), reopening their reference even after it closed."""
    from snapref_ray.cluster.shard_ledger import Rendered, ShardLedger
    from snapref_ray.cluster.tasks import ItemOutcome

    w = World(n=2, max_batch=2)
    call = w.render(worker=0)
    ledger = ShardLedger(commit=lambda key: True)
    for item in call.task.items:
        ledger.rendered("w0-process", "shard-1", Rendered(0, ItemOutcome(item.item_id), item, call.reference))
    w.placement.close_finished()  # nothing pending, nothing counted in flight: A closes
    assert w.placement.open == []
    ledger.lose(0)  # the process died with shard-1 open
    settled = ledger.take()
    assert settled.done == [] and [e.item.item_id for e in settled.lost] == ["A-0", "A-1"]
    w.recovery.requeue_lost_shards(settled.lost)
    assert w.pending() == ["A-0", "A-1"] and w.stats.requeues[Cause.SHARD_LOST] == 2 and w.stats.attempts_charged == 0
