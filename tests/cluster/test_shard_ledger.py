"""The driver's bookkeeping of webdataset shards, without Ray: an item is done when the driver has committed its
staged shard, and the items of a shard that never will be are given back to render again.

Workers are indices, writers are process ids as a worker reports them; the items and references are plain
strings (the ledger only carries them). Each expected value is worked out by hand from the module docstring.
"""

from __future__ import annotations

from snapref_ray.cluster.shard_ledger import Rendered, ShardLedger
from snapref_ray.cluster.tasks import ItemOutcome, ShardReport
from snapref_ray.storage.shards import ClosedShard


def row(worker: int, item_id: str, shard: str) -> tuple[str, Rendered]:
    outcome = ItemOutcome(item_id, row={"item_id": item_id, "shard_key": shard})
    return shard, Rendered(worker, outcome, item_id, "reference")


def feed(ledger: ShardLedger, writer: str, worker: int, shard: str, *item_ids: str) -> None:
    for item_id in item_ids:
        ledger.rendered(writer, *row(worker, item_id, shard))


def settled(ledger: ShardLedger) -> tuple[list[str], list[str]]:
    s = ledger.take()
    return [e.item for e in s.done], [e.item for e in s.lost]


def test_rows_wait_for_their_shard_and_are_done_when_it_is_committed():
    ledger = ShardLedger()
    feed(ledger, "w0", 0, "s1", "a", "b", "c")
    assert settled(ledger) == ([], []) and ledger.waiting == 3 and ledger.waiting_on(0) == 3
    ledger.report(0, ShardReport("w0", (ClosedShard("s1", 3, True),)))
    assert settled(ledger) == (["a", "b", "c"], [])
    assert ledger.waiting == 0 and settled(ledger) == ([], [])  # taken once


def test_a_shard_reported_staged_before_all_its_rows_came_back_is_committed_once_they_have():
    # The actor runs two calls at once: the second may fill and stage the shard while the first's answer is out.
    asked: list[str] = []
    ledger = ShardLedger(lambda key: asked.append(key) or True)
    feed(ledger, "w0", 0, "s1", "a")
    ledger.report(0, ShardReport("w0", (ClosedShard("s1", 3, True),)))
    assert settled(ledger) == ([], []) and asked == []  # not whole yet: not committed
    feed(ledger, "w0", 0, "s1", "b", "c")
    assert settled(ledger) == (["a", "b", "c"], []) and asked == ["s1"]
    feed(ledger, "w0", 0, "s2", "d")  # the next shard of the same worker waits again
    assert settled(ledger) == ([], []) and ledger.waiting == 1


def test_a_staged_shard_holding_items_of_a_call_that_never_answers_is_never_committed():
    # Call 1 filled the shard with its item and one of call 2's; call 1 answered and reported it; then the worker
    # died before call 2 answered. Call 2's items render again, so committing the shard would put one in two tars.
    asked: list[str] = []
    ledger = ShardLedger(lambda key: asked.append(key) or True)
    feed(ledger, "w0", 0, "s1", "a")
    ledger.report(0, ShardReport("w0", (ClosedShard("s1", 2, True),)))
    ledger.lose(0)
    assert settled(ledger) == ([], ["a"]) and asked == []
    feed(ledger, "w0", 0, "s1", "b")  # an answer of the dead process collected late: lost too
    assert settled(ledger) == ([], ["b"]) and asked == []


def test_a_shard_whose_publish_failed_gives_its_items_back():
    ledger = ShardLedger()
    feed(ledger, "w0", 0, "s1", "a", "b")
    feed(ledger, "w1", 1, "t1", "x")
    ledger.report(0, ShardReport("w0", (ClosedShard("s1", 2, False, "OSError: disk full"),)))
    assert settled(ledger) == ([], ["a", "b"])
    assert ledger.waiting_on(1) == 1  # the other worker's shard is not touched


def test_a_restarted_worker_loses_its_old_open_shard_and_late_rows_of_it():
    ledger = ShardLedger()
    feed(ledger, "w0", 0, "s1", "a", "b")
    feed(ledger, "w1", 1, "t1", "x")
    ledger.report(0, ShardReport("w0-restarted"))  # Ray restarted the actor and retried a call on it
    assert settled(ledger) == ([], ["a", "b"])
    feed(ledger, "w0", 0, "s1", "c")  # an answer of the dead process collected after it
    feed(ledger, "w0-restarted", 0, "s9", "d")
    assert settled(ledger) == ([], ["c"])
    assert ledger.waiting_on(0) == 1 and ledger.waiting_on(1) == 1


def test_a_probe_that_finds_the_same_process_loses_nothing():
    ledger = ShardLedger()
    feed(ledger, "w0", 0, "s1", "a")
    ledger.writer_seen(0, "w0")
    assert settled(ledger) == ([], []) and ledger.waiting == 1
    ledger.writer_seen(0, "w0-new")
    assert settled(ledger) == ([], ["a"])


def test_a_staged_shard_is_committed_by_the_driver_and_done_only_if_the_commit_says_so():
    asked: list[str] = []

    def commit(key: str) -> bool:
        asked.append(key)
        return key != "voided"  # a driver that took the output over voided this one

    ledger = ShardLedger(commit)
    feed(ledger, "w0", 0, "s1", "a", "b")
    feed(ledger, "w1", 1, "voided", "x")
    ledger.report(0, ShardReport("w0", (ClosedShard("s1", 2, True),)))
    ledger.report(1, ShardReport("w1", (ClosedShard("voided", 1, True), ClosedShard("unstaged", 1, False, "E"))))
    assert asked == ["s1", "voided"]  # a shard that was not staged is not committed
    assert settled(ledger) == (["a", "b"], ["x"])


def test_a_lost_worker_loses_its_open_shard_even_if_it_staged_it_without_saying_so():
    # Its staged shard was never reported, so the driver never commits it (the end of the run voids it): its items
    # render again, and no commit can count them twice.
    asked: list[str] = []
    ledger = ShardLedger(lambda key: asked.append(key) or True)
    feed(ledger, "w0", 0, "s1", "a", "b")
    ledger.report(0, ShardReport("w0"))  # nothing closed as far as the driver heard
    ledger.lose(0)
    assert settled(ledger) == ([], ["a", "b"]) and asked == []
    assert ledger.waiting == 0
    ledger.lose(0)  # lost twice (retired after a failed release): nothing more
    assert settled(ledger) == ([], [])
