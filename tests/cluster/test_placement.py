"""The placement policy without Ray: which reference and batch a worker takes, and how its RefKV reaches it.

A RefKV handle is any object here (the loop's `ray.ObjectRef`); workers are indices and node ids. Each expected
value is worked out by hand from the rule the module docstring states, not read back from the policy.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from snapref_ray.cluster.placement import Placement, fetch_is_cheaper
from snapref_ray.cluster.scheduler_config import SchedulerConfig
from snapref_ray.cluster.scheduler_stats import SchedulerStats
from snapref_ray.render_service.references import ReferenceInput
from snapref_ray.render_service.work_items import WorkItem
from snapref_ray.requests import RenderSettings

SETTINGS = RenderSettings(width=256, height=256, steps=2)


def items(reference: str, n: int, *, settings: RenderSettings = SETTINGS, start: int = 0) -> list[WorkItem]:
    spec = ReferenceInput((f"/refs/{reference}.png",), "single", ("reference",))
    return [
        WorkItem(f"{reference}-{i}", i + 1, spec, f"hash-{reference}", f"scene {i}", i, settings, 0)
        for i in range(start, start + n)
    ]


def placement(work: list[WorkItem], **config) -> Placement:
    p = Placement(SchedulerConfig(**config), SchedulerStats())
    p.queue(work)
    return p


def ids(assignment) -> list[str]:
    return [i.item_id for i in assignment.batch]


def test_fetch_or_encode_compares_transfer_seconds_with_encode_seconds():
    # 1 GB at 1 GB/s is 1 s on the wire: cheaper than a 2 s encode, dearer than a 0.5 s one.
    assert fetch_is_cheaper(1_000_000_000, 1e9, 2.0) is True
    assert fetch_is_cheaper(1_000_000_000, 1e9, 0.5) is False


def test_a_new_reference_is_opened_where_it_is_sampled_and_its_holder_keeps_it():
    p = placement(items("A", 5) + items("B", 2), max_batch=2)
    first = p.assign(0, "n0", live_workers=2)
    # Worker 0 opens A: it encodes it itself, so its render gets no handle (it must not wait on its own call).
    assert first.opens and first.refkv is None and first.fetch_from is None
    assert first.reference.task.reference_hash == "hash-A" and ids(first) == ["A-0", "A-1"]
    p.opened(first.reference, "refkv-A", 0, "n0")
    second = p.assign(1, "n1", live_workers=2)  # A's RefKV is not ready: worker 1 opens B instead
    assert second.opens and second.reference.task.reference_hash == "hash-B"
    p.opened(second.reference, "refkv-B", 1, "n1")
    # Worker 0 holds A (not ready yet): more of A, still without a handle, still no new encode.
    again = p.assign(0, "n0", live_workers=2)
    assert (again.reference.task.reference_hash, again.opens, again.refkv, ids(again)) == (
        "hash-A",
        False,
        None,
        ["A-2", "A-3"],
    )
    assert p.stats.peak_open_references == 2


def test_a_worker_is_never_handed_a_refkv_that_is_still_being_encoded():
    p = placement(items("A", 4), max_batch=1)
    opened = p.assign(0, "n0", live_workers=2)
    p.opened(opened.reference, "refkv-A", 0, "n0")
    assert p.assign(1, "n0", live_workers=2) is None  # nothing else to open, and A is not ready
    opened.reference.ready = True
    helper = p.assign(1, "n0", live_workers=2)
    assert (helper.refkv, helper.fetch_from, helper.opens) == ("refkv-A", "n0", False)
    assert (p.stats.fetches, p.stats.same_node_fetches, p.stats.cross_node_fetches) == (1, 1, 0)
    # Once it holds A, worker 1 is handed the RefKV again (read only if its LRU evicted it), with no fetch counted.
    held = p.assign(1, "n0", live_workers=2)
    assert (held.refkv, held.fetch_from, p.stats.fetches) == ("refkv-A", None, 1)


def test_across_nodes_a_helper_fetches_until_the_encode_is_cheaper():
    gb = 1_000_000_000
    p = placement(items("A", 6), max_batch=1, max_open_references=1)
    opened = p.assign(0, "n0", live_workers=3)
    ref = opened.reference
    p.opened(ref, "refkv-A", 0, "n0")
    ref.ready, ref.nbytes, ref.encode_seconds = True, gb, 0.5
    # No bandwidth known yet: fetching is what measures it.
    first = p.assign(1, "n1", live_workers=3)
    assert (first.refkv, first.fetch_from, p.stats.cross_node_fetches) == ("refkv-A", "n0", 1)
    p.measure_transfer(ref, "n1", seconds=2.0)  # 1 GB in 2 s: 0.5 GB/s, so a fetch takes 2 s > 0.5 s encode
    assert p.transfer_bytes_per_s == gb / 2.0 == p.stats.measured_transfer_bytes_per_s
    second = p.assign(2, "n2", live_workers=3)
    assert (second.refkv, second.fetch_from, second.opens, p.stats.local_encodes) == (None, None, False, 1)
    # The same node as the RefKV always reads it from shared memory, whatever the bandwidth.
    p.forget_worker(1, drop_refkvs=False)
    same = p.assign(3, "n0", live_workers=3)
    assert (same.refkv, same.fetch_from) == ("refkv-A", "n0")


def test_a_configured_bandwidth_decides_without_measuring():
    p = placement(items("A", 3), max_batch=1, transfer_bytes_per_s=1e9)
    ref = p.assign(0, "n0", live_workers=2).reference
    p.opened(ref, "refkv-A", 0, "n0")
    ref.ready, ref.nbytes, ref.encode_seconds = True, 3_000_000_000, 1.0  # 3 s on the wire vs a 1 s encode
    helper = p.assign(1, "n1", live_workers=2)
    assert (helper.refkv, p.stats.local_encodes, p.stats.fetches) == (None, 1, 0)
    p.measure_transfer(ref, "n1", seconds=10.0)
    assert p.transfer_bytes_per_s == 1e9  # configured: never replaced by a measurement


def test_helpers_go_to_the_open_reference_with_the_most_work_per_holder():
    p = placement(items("A", 6) + items("B", 2), max_batch=1)
    a = p.assign(0, None, live_workers=3)
    p.opened(a.reference, "refkv-A", 0, None)
    b = p.assign(1, None, live_workers=3)
    p.opened(b.reference, "refkv-B", 1, None)
    a.reference.ready = b.reference.ready = True
    # A: 5 pending / 1 holder; B: 1 pending / 1 holder.
    assert p.assign(2, None, live_workers=3).reference is a.reference


def test_no_more_references_open_than_two_per_live_worker_or_the_configured_cap():
    work = [i for ref in "ABCDE" for i in items(ref, 1)]
    p = placement(work)
    assert p.max_open(live_workers=2) == 4 and p.max_open(live_workers=0) == 2
    for worker in range(4):
        p.opened(p.assign(worker, None, live_workers=2).reference, f"refkv-{worker}", worker, None)
    assert p.assign(4, None, live_workers=2) is None  # E waits: 4 references are open
    assert placement(work, max_open_references=1).max_open(live_workers=8) == 1


def test_batches_hold_equal_settings_up_to_the_cap_which_out_of_memory_halves():
    other = SETTINGS.model_copy(update={"steps": 3})
    work = items("A", 3) + items("A", 2, settings=other, start=3) + items("A", 3, start=5)
    p = placement(work, max_batch=4)
    first = p.assign(0, None, live_workers=1)
    assert ids(first) == ["A-0", "A-1", "A-2", "A-5"]  # steps 2 only, 4 at most
    shape, cap = p.cap_shape(first.batch)  # that batch of 4 ran out of memory
    assert (shape, cap) == ((256, 256, 2), 2)
    p.requeue(first.reference, first.batch)
    assert ids(p.assign(0, None, live_workers=1)) == ["A-0", "A-1"]
    assert p.batch_limits() == [
        {"width": 256, "height": 256, "rows_per_image": 2, "batch": 2, "max_batch": 4, "out_of_memory_splits": 1}
    ]


def test_items_of_a_failed_forward_are_rendered_alone():
    p = placement(items("A", 4), max_batch=4)
    batch = p.assign(0, None, live_workers=1)
    p.render_alone(batch.batch[:2])
    p.requeue(batch.reference, batch.batch)
    assert [ids(p.assign(0, None, live_workers=1)) for _ in range(3)] == [["A-0"], ["A-1"], ["A-2", "A-3"]]


def test_a_failed_worker_loses_its_holdings_and_with_them_the_refkvs_it_encoded():
    p = placement(items("A", 4) + items("B", 4), max_batch=1)
    a = p.assign(0, "n0", live_workers=2)
    p.opened(a.reference, "refkv-A", 0, "n0")
    b = p.assign(1, "n1", live_workers=2)
    p.opened(b.reference, "refkv-B", 1, "n1")
    assert p.holds_needed_refkv(0) and p.holds_needed_refkv(1)
    assert p.forget_worker(0, drop_refkvs=False) == [] and 0 not in a.reference.holders
    assert p.forget_worker(0, drop_refkvs=True) == [a.reference]  # the caller drops it (recovery.drop_refkv)
    a.reference.forget_refkv()
    assert not p.holds_needed_refkv(0) and p.open_refkvs() == ["refkv-B"]
    # With no handle left, the next worker that takes A opens it again.
    assert p.assign(0, "n0", live_workers=2).opens


def test_a_reference_closes_when_its_work_is_done_and_its_refkv_is_dropped():
    p = placement(items("A", 1) + items("B", 1), max_batch=1)
    a = p.assign(0, None, live_workers=1)
    p.opened(a.reference, "refkv-A", 0, None)
    a.reference.in_flight = 1
    p.close_finished()
    assert p.open_refkvs() == ["refkv-A"] and p.unassigned_work()  # in flight, and B not opened
    a.reference.in_flight = 0
    p.close_finished()
    assert p.open_refkvs() == [] and a.reference.refkv is None and p.pending_items() == 1


@pytest.mark.slow
def test_the_policy_imports_no_ray():
    # A fresh interpreter: the test session itself has Ray loaded.
    code = "import sys, snapref_ray.cluster.placement; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"


def test_drop_reference_takes_its_queued_items_off_and_skips_those_not_read_yet():
    from snapref_ray.cluster.placement import PlannedWork

    p = Placement(SchedulerConfig(max_batch=2), SchedulerStats())
    read: list[str] = []

    def groups():  # the plan's groups, read only as references open
        for name, n in (("A", 5), ("B", 2), ("C", 3)):
            read.append(name)
            yield items(name, n)

    p.queue_planned(PlannedWork(groups(), 10))
    sent = p.assign(0, "n0", live_workers=1)  # opens A: dispatched
    assert ids(sent) == ["A-0", "A-1"] and read == ["A"]
    assert p.drop_reference("hash-A") == 3  # A-2..A-4 were queued; the two dispatched still come back
    assert p.drop_reference("hash-C") == 0 and p.take_dropped() == 0  # C is not read yet: skipped when it is
    assert ids(p.assign(0, "n0", live_workers=1)) == ["B-0", "B-1"]
    assert p.assign(0, "n0", live_workers=1) is None and read == ["A", "B", "C"]
    assert p.take_dropped() == 3 and p.take_dropped() == 0 and p.pending_items() == 0


def _closed(p: Placement, reference: str) -> None:
    """Open `reference`, render its whole queue (as the policy counts calls in flight) and close it."""
    a = p.assign(0, "n0", live_workers=2)
    assert a.opens and a.reference.task.reference_hash == f"hash-{reference}" and not a.reference.pending
    p.opened(a.reference, f"refkv-{reference}", 0, "n0")
    p.close_finished()
    assert p.open == [] and a.reference.refkv is None


def test_a_re_opened_reference_whose_queue_is_one_batch_is_encoded_by_its_render_alone():
    p = placement(items("A", 2), max_batch=4)
    _closed(p, "A")  # a plan's reference opens with an encode call, however small its queue
    p.add(items("A", 3, start=10))  # re-renders whose verdicts came in after A closed
    first = p.assign(1, "n1", live_workers=2)
    # The whole queue in one batch: no encode call (nobody else reads its RefKV); the render encodes it or reads
    # worker 1's device cache, so it gets no handle.
    assert (first.opens, first.refkv, ids(first)) == (False, None, ["A-10", "A-11", "A-12"])
    ref = first.reference
    assert ref.encoder == 1 and p.open_refkvs() == []
    ref.in_flight = 1
    p.add(items("A", 1, start=20))  # another verdict while that render is out: joins the open reference
    # Worker 0 would encode A a second time beside worker 1's render: it waits; worker 1 takes it, again without an
    # encode call (its device cache has the RefKV by then, or its first render is filling it).
    assert p.assign(0, "n0", live_workers=2) is None
    second = p.assign(1, "n1", live_workers=2)
    assert (second.reference, second.opens, second.refkv, ids(second)) == (ref, False, None, ["A-20"])


def test_a_re_opened_reference_with_more_than_a_batch_queued_is_opened_with_an_encode_call():
    p = placement(items("A", 1), max_batch=2)
    _closed(p, "A")
    p.add(items("A", 3, start=10))
    first = p.assign(1, "n1", live_workers=2)
    # Another batch stays queued: its RefKV goes to the object store, where the other workers read it.
    assert first.opens and ids(first) == ["A-10", "A-11"] and first.reference.encoder is None
    p.opened(first.reference, "refkv-A2", 1, "n1")
    first.reference.ready = True
    helper = p.assign(0, "n0", live_workers=2)
    assert (helper.opens, helper.refkv, ids(helper)) == (False, "refkv-A2", ["A-12"])


def test_a_lost_worker_that_was_encoding_a_reference_in_its_render_frees_it_for_the_others():
    p = placement(items("A", 1), max_batch=1)
    _closed(p, "A")
    p.add(items("A", 1, start=10))
    first = p.assign(1, "n1", live_workers=2)
    first.reference.in_flight = 1
    p.add(items("A", 1, start=11))
    second = p.assign(1, "n1", live_workers=2)  # worker 1's second call: its own cache
    assert (second.reference, second.opens, ids(second)) == (first.reference, False, ["A-11"])
    first.reference.in_flight = 2
    p.add(items("A", 1, start=12))
    assert p.assign(0, "n0", live_workers=2) is None  # worker 1's renders are encoding A
    # Worker 1 is lost: the policy counts back the call that failed first, then tells placement. Its other call
    # is still out, lost with it: worker 0 need not wait for it, and opens A (with an encode call: a render of
    # A is still counted out).
    first.reference.in_flight = 1
    p.forget_worker(1, drop_refkvs=True)
    again = p.assign(0, "n0", live_workers=2)
    assert (again.reference, again.opens, ids(again)) == (first.reference, True, ["A-12"])


def test_added_items_join_the_waiting_reference_of_their_key_else_one_added_reference_in_arrival_order():
    p = placement(items("A", 1) + items("B", 1) + items("C", 1), max_batch=8)
    a = p.assign(0, "n0", live_workers=1)  # A opens; B and C wait, read from the plan
    p.opened(a.reference, "refkv-A", 0, "n0")
    p.add(items("C", 1, start=10) + items("D", 1, start=10) + items("E", 1, start=10) + items("D", 1, start=11))
    a.reference.in_flight = 1
    p.close_finished()
    order = []
    for _ in range(4):
        got = p.assign(0, "n0", live_workers=4)
        order.append((got.reference.task.reference_hash, ids(got), got.reference.added))
    # C's re-render joins C's plan group; D's two make one added reference; none jumps the plan's order.
    assert order == [
        ("hash-B", ["B-0"], False),
        ("hash-C", ["C-0", "C-10"], False),
        ("hash-D", ["D-10", "D-11"], True),
        ("hash-E", ["E-10"], True),
    ]
