"""The batch policy's step without Ray: `schedule` and `update` on values, as the engine core's loop drives them.

Workers are indices with a node id; a call's return is built here as the worker would send it (an `EncodeInfo`, a
list of `ItemOutcome`s, an exception with the cause the loop read from it). Each expected value is worked out from
the rules in cluster/batch_policy.py, recovery.py and members.py, not read back from the implementation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from snapref_ray.cluster.batch_policy import BatchPolicy
from snapref_ray.cluster.call_records import EncodeCall, ProbeCall, PublishCall, ReleaseCall, RenderCall, StartCall
from snapref_ray.cluster.members import PoolLimits
from snapref_ray.cluster.recovery import RequeueBudgetExceeded
from snapref_ray.cluster.scheduler_config import SchedulerConfig
from snapref_ray.cluster.scheduler_stats import Cause, SchedulerStats
from snapref_ray.cluster.scheduling_policy import Dispatch, FreeWorker, ObjectSlot, ReturnedCall
from snapref_ray.cluster.tasks import EncodeInfo, ItemOutcome, WorkerInfo
from snapref_ray.render_service.references import ReferenceInput
from snapref_ray.render_service.work_items import WorkItem
from snapref_ray.requests import RenderSettings

SETTINGS = RenderSettings(width=256, height=256, steps=2)


def items(reference: str, n: int, *, start: int = 0) -> list[WorkItem]:
    spec = ReferenceInput((f"/refs/{reference}.png",), "single", ("reference",))
    return [
        WorkItem(f"{reference}-{i}", i + 1, spec, f"hash-{reference}", f"scene {i}", i, SETTINGS, 0)
        for i in range(start, start + n)
    ]


def info(i: int) -> WorkerInfo:
    return WorkerInfo(f"w{i}", f"n{i}", "cpu", 1, 0.0)


@dataclass
class Step:
    """A policy with `workers` workers (nodes n0, n1, ...), and what it told the job; `stats` is the loop's sum."""

    workers: int = 2
    config: SchedulerConfig = field(default_factory=SchedulerConfig)
    limits: PoolLimits | None = None
    done: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    now: float = 0.0

    def __post_init__(self) -> None:
        self.policy = BatchPolicy(
            [info(i) for i in range(self.workers)],
            self.config,
            on_done=lambda outcome, item: self.done.append(item.item_id),
            on_failed=lambda outcome, item, attempt: self.failed.append(item.item_id),
            limits=self.limits,
            clock=lambda: self.now,
        )

    def schedule(self, *free: int, slots: int = 1) -> list[Dispatch]:
        return self.policy.schedule([FreeWorker(i, slots) for i in free])

    def update(self, *returned: ReturnedCall):
        outcome = self.policy.update(list(returned))
        self.stats.update(outcome.stats)
        return outcome


def renders(dispatches: list[Dispatch]) -> list[RenderCall]:
    return [d.call for d in dispatches if isinstance(d.call, RenderCall)]


def encodes(dispatches: list[Dispatch]) -> list[EncodeCall]:
    return [d.call for d in dispatches if isinstance(d.call, EncodeCall)]


def rendered(call: RenderCall, source: str = "cache") -> ReturnedCall:
    """The worker rendered every item of the call."""
    outcomes = [ItemOutcome(i.item_id, row={"item_id": i.item_id}, refkv_source=source) for i in call.task.items]
    return ReturnedCall(call, outcomes)


def encoded(call: EncodeCall) -> ReturnedCall:
    return ReturnedCall(call, EncodeInfo(call.reference.task.reference_hash, 1000, 0.1, "w", True))


def ids(call: RenderCall) -> list[str]:
    return [i.item_id for i in call.task.items]


def test_a_new_reference_is_an_encode_whose_refkv_the_loop_fills_and_then_a_render_of_its_first_batch():
    s = Step(config=SchedulerConfig(max_batch=2))
    s.policy.start(items("A", 3))
    dispatches = s.schedule(0)
    encode, render = dispatches
    assert (encode.method, encode.options, encode.args) == ("encode", {"num_returns": 2}, (encode.call.reference.task,))
    assert isinstance(encode.fills, ObjectSlot) and encode.call.refkv is encode.fills
    # The encoding worker's own render gets no handle: it reads its device cache and must not wait on its own call.
    assert (render.method, render.options, ids(render.call), render.args[1]) == (
        "render",
        {"max_task_retries": 0},
        ["A-0", "A-1"],
        None,
    )
    encode.fills.value = "the RefKV's ObjectRef"  # what the loop does when it sends the encode
    assert s.policy.open_refkvs() == ["the RefKV's ObjectRef"]
    s.update(encoded(encode.call), rendered(render.call, "encoded"))
    assert s.done == ["A-0", "A-1"] and s.policy.remaining == 1
    assert (s.stats.encodes_requested, s.stats.reference_encodes, s.stats.dispatched_batches) == (1, 2, 1)


def test_an_out_of_memory_batch_is_split_and_requeued_without_an_attempt():
    s = Step(workers=1, config=SchedulerConfig(max_batch=4))
    s.policy.start(items("A", 4))
    (render,) = renders(s.schedule(0))
    oom = [ItemOutcome(i.item_id, error="CUDA out of memory", out_of_memory=True) for i in render.task.items]
    outcome = s.update(ReturnedCall(render, oom))
    assert outcome.requeued == ("A-0", "A-1", "A-2", "A-3") and outcome.finished == ()
    assert (s.stats.batch_splits, s.stats.requeues[Cause.DEVICE_OOM], s.stats.attempts_charged) == (1, 4, 0)
    assert [ids(c) for c in renders(s.schedule(0, slots=2))] == [["A-0", "A-1"], ["A-2", "A-3"]]  # 4 -> 2


def test_a_lost_workers_batch_is_requeued_at_the_front_and_the_worker_probed_before_it_gets_work_again():
    s = Step(config=SchedulerConfig(max_batch=2))
    s.policy.start(items("A", 6))
    first = s.schedule(0)
    (render,) = renders(first)
    s.update(encoded(encodes(first)[0]))
    lost = s.update(ReturnedCall(render, error=RuntimeError("actor died"), cause=Cause.WORKER_LOST))
    assert lost.requeued == ("A-0", "A-1") and s.stats.requeues[Cause.WORKER_LOST] == 2
    assert s.stats.worker_failures == 1 and s.stats.attempts_charged == 0
    # Worker 0 encoded A: its RefKV went with it (its node may be gone). The probe is the next dispatch; worker 0
    # gets no render until it answers, and worker 1 takes the requeued items first, encoding A itself.
    dispatches = s.schedule(0, 1)
    assert [(type(d.call), d.call.worker, d.method) for d in dispatches] == [
        (ProbeCall, 0, "info"),
        (EncodeCall, 1, "encode"),
        (RenderCall, 1, "render"),
    ]
    assert ids(dispatches[2].call) == ["A-0", "A-1"]
    s.update(ReturnedCall(dispatches[0].call, info(0)), encoded(dispatches[1].call))  # back; A's RefKV is ready
    (helper,) = s.schedule(0)
    assert (helper.call.worker, ids(helper.call), helper.args[1]) == (0, ["A-2", "A-3"], dispatches[1].fills)


def test_a_loss_on_a_node_ray_lists_dead_is_counted_as_a_node_loss():
    s = Step(workers=1)
    s.policy.start(items("A", 1))
    (render,) = renders(s.schedule(0))
    s.update(ReturnedCall(render, error=RuntimeError("gone"), cause=Cause.WORKER_LOST))
    assert s.policy.suspect_nodes() == {"n0"}  # the loop asks Ray about it ...
    s.policy.nodes_dead({"n0"})  # ... and answers
    s.stats.update(s.policy.finish().stats)
    assert (s.stats.requeues[Cause.NODE_LOST], s.stats.requeues[Cause.WORKER_LOST]) == (1, 0)


def test_the_requeue_budget_is_max_requeues_per_item_times_the_runs_items_added_ones_included():
    s = Step(config=SchedulerConfig(max_batch=2, max_requeues_per_item=1))
    s.policy.start(items("A", 1))
    s.policy.add(items("A", 1, start=1))  # budget: 1 x 2 items
    (render,) = renders(s.schedule(0))
    assert ids(render) == ["A-0", "A-1"]
    s.update(ReturnedCall(render, error=RuntimeError("gone"), cause=Cause.WORKER_LOST))  # 2 requeues: the budget
    (again,) = renders(s.schedule(1))
    with pytest.raises(RequeueBudgetExceeded, match="over the budget of 2"):
        s.update(ReturnedCall(again, error=RuntimeError("gone"), cause=Cause.NODE_LOST))


def test_a_re_render_added_while_its_reference_is_open_joins_it_without_another_encode():
    s = Step(workers=1, config=SchedulerConfig(max_batch=1))
    s.policy.start(items("A", 2) + items("B", 1))
    first = s.schedule(0)
    assert [ids(c) for c in renders(first)] == [["A-0"]] and len(encodes(first)) == 1
    s.update(encoded(encodes(first)[0]), rendered(renders(first)[0]))
    s.policy.add(items("A", 1, start=10))  # A-0's verdict asked for a next render: A is still open
    later = [c for _ in range(2) for c in renders(s.schedule(0))]
    for call in later:
        s.update(rendered(call))
    # The worker holds A: its remaining item and the re-render, from its device cache; no encode was dispatched.
    assert [ids(c) for c in later] == [["A-1"], ["A-10"]] and s.stats.encodes_requested == 1
    assert s.done == ["A-0", "A-1", "A-10"] and s.policy.remaining == 1  # B's item is left


def test_a_re_render_added_after_its_reference_closed_opens_it_again_in_one_render_call():
    s = Step(workers=1, config=SchedulerConfig(max_batch=1))
    s.policy.start(items("A", 1))
    first = s.schedule(0)
    s.update(encoded(encodes(first)[0]), rendered(renders(first)[0]))
    assert s.policy.remaining == 0 and s.policy.placement.open == []  # A closed: its RefKV was dropped
    s.policy.add(items("A", 1, start=10))
    again = s.schedule(0)
    # Its queue is one batch: no encode call; the render reads the worker's device cache or encodes A itself.
    assert encodes(again) == [] and [(ids(c), c.refkv, c.task.items[0].item_id) for c in renders(again)] == [
        (["A-10"], None, "A-10")
    ]
    assert again[0].args[1] is None  # no handle: there is no RefKV in the object store to read
    s.update(rendered(renders(again)[0], "encoded"))
    assert s.done == ["A-0", "A-10"] and s.policy.remaining == 0 and s.policy.placement.open == []
    assert (s.stats.encodes_requested, s.stats.reference_encodes, s.policy.encodes_by_reference["hash-A"]) == (1, 2, 2)


def test_re_renders_added_after_their_reference_closed_that_fill_two_batches_open_it_with_an_encode_call():
    s = Step(workers=2, config=SchedulerConfig(max_batch=1))
    s.policy.start(items("A", 1))
    first = s.schedule(0)
    s.update(encoded(encodes(first)[0]), rendered(renders(first)[0]))
    s.policy.add(items("A", 2, start=10))
    again = s.schedule(0)
    # A second batch stays queued: A's RefKV goes to the object store, where worker 1 reads it once it is ready.
    assert len(encodes(again)) == 1 and [ids(c) for c in renders(again)] == [["A-10"]]
    assert renders(s.schedule(1)) == []  # not ready yet
    s.update(encoded(encodes(again)[0]))
    (helper,) = renders(s.schedule(1))
    assert ids(helper) == ["A-11"] and helper.refkv is encodes(again)[0].refkv


def test_the_quota_seam_skips_a_references_queue_at_dispatch():
    full: set[str] = set()
    s = Step(workers=1, config=SchedulerConfig(max_batch=1))
    s.policy.skip_reference = lambda reference_hash: reference_hash in full
    s.policy.start(items("A", 3) + items("B", 1))
    first = renders(s.schedule(0))
    full.add("hash-A")  # A's quota is met
    s.update(rendered(first[0]))
    # A's two queued items are skipped (counted finished, never sent); the worker takes B instead.
    assert [ids(c) for c in renders(s.schedule(0))] == [["B-0"]]
    assert s.policy.skipped_items == 2 and s.policy.remaining == 1


def test_a_run_whose_last_queue_is_skipped_at_dispatch_ends_without_anything_in_flight():
    s = Step(workers=1, config=SchedulerConfig(max_batch=1))
    s.policy.skip_reference = lambda reference_hash: True  # the quota was met before anything was sent
    s.policy.start(items("A", 2))
    assert s.schedule(0) == [] and s.policy.skipped_items == 2
    # Nothing was sent and nothing is out: not a stall, the loop steps again and finds the work done.
    assert s.policy.pause_s() == 0.0 and not s.policy.has_work()


def test_the_elastic_pool_grows_while_work_is_unassigned_and_gives_back_idle_workers_after():
    s = Step(workers=0, config=SchedulerConfig(max_batch=4), limits=PoolLimits(1, 2, publishes_outputs=False))
    s.policy.start(items("A", 4) + items("B", 1))
    assert s.policy.scale(starting=0).launch == 2
    assert s.policy.scale(starting=2).launch == 0  # both are on their way
    assert s.schedule() == []  # no worker yet: rendering has not started
    s.update(ReturnedCall(StartCall(0), info(0)))
    assert s.policy.members.started and s.stats.workers_started == 1
    dispatched = renders(s.schedule(0))
    assert [ids(c) for c in dispatched] == [["A-0", "A-1", "A-2", "A-3"]]
    s.update(ReturnedCall(StartCall(1), info(1)))
    b = renders(s.schedule(1))
    # Every item is in flight: the actors still starting are cancelled, and no worker is idle (both render).
    order = s.policy.scale(starting=1)
    assert (order.launch, order.cancel_starting, order.release) == (0, True, ())
    s.update(rendered(b[0]))
    order = s.policy.scale(starting=0)
    assert order.release == (1,) and order.publish is False  # worker 1 is idle and holds no RefKV others need
    s.update(ReturnedCall(ReleaseCall(1), None))
    assert s.stats.workers_released == 1 and s.policy.members.members[1].released
    s.update(rendered(dispatched[0]))
    assert s.policy.remaining == 0 and s.stats.peak_workers == 2


def test_the_loops_sum_of_the_returned_stats_is_the_runs_count():
    s = Step(workers=2, config=SchedulerConfig(max_batch=1))
    s.policy.start(items("A", 3))
    calls = renders(s.schedule(0, slots=3))
    for call in calls:
        s.update(rendered(call))
    assert (s.stats.done_items, s.stats.dispatched_batches, s.stats.peak_open_references) == (3, 3, 1)
    assert s.policy.stats == SchedulerStats()  # every count was handed over: the policy keeps none


def test_a_run_that_adds_work_keeps_its_idle_workers_and_has_them_stage_their_open_shard():
    limits = PoolLimits(1, 2, publishes_outputs=True)
    s = Step(workers=2, config=SchedulerConfig(max_batch=1), limits=limits)
    s.policy.adds_work = True
    s.policy.start(items("A", 1) + items("B", 1))
    first = renders(s.schedule(0, 1))
    sharded = [
        ItemOutcome(i.item_id, row={"item_id": i.item_id, "shard_key": "w1-000001", "worker_id": "w1"})
        for i in first[1].task.items
    ]
    s.update(ReturnedCall(first[1], sharded))  # worker 1's item waits in its open shard for a commit
    assert s.policy.scale(starting=0).release == ()  # idle, but the run may still grow: kept
    assert [(type(d.call), d.call.worker) for d in s.schedule(1)] == [(PublishCall, 1)]
    assert s.schedule(1) == []  # asked once, until it renders into a shard again
