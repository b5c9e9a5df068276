"""Which rendered items wait in a worker's open webdataset shard, and what becomes of them.

With `output.format: webdataset` a worker commits its rows itself, with its shard (storage/shards.py): a row
that comes back from a render sits in the worker's open shard, not yet in the output. The driver counts such an
item done only when the worker reports the shard committed (`ShardReport`, with each answer and with
`commit_outputs` at release). A shard that never will be (its worker's process died with it open, its publish
failed, its release commit failed) gives its items back to be rendered again in the same run, without charging
an attempt (`Cause.SHARD_LOST`).

A worker's process is told by its `writer` id (cluster/tasks.py `ShardReport`): a restarted actor (Ray restarts it
in place, and may retry a call on it) has a fresh, empty ShardWriter, so a new writer for a worker means the old
one's open shard is gone. A shard may be reported closed before every one of its rows has come back (the actor runs
two calls at once, and either may fill the shard): the ledger remembers a closed shard until that many rows came.

Not covered here: a worker that dies after a render call filled and published a shard but before that call
answered. The driver requeues (or Ray retries) the call's items, and those of them already in the published shard
are rendered a second time (the shard's other items are found committed, `is_committed`). Closing that window takes
publishing out of the render call (the driver asking for each full shard's commit as a call of its own).

What it holds is bounded by the work in flight: at most workers x shard_max_items entries in open shards.
No Ray here: the loop (cluster/scheduler.py) feeds it and takes what `take()` settled.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from snapref_ray.cluster.tasks import ItemOutcome, ShardReport
from snapref_ray.render_service.work_items import WorkItem

log = logging.getLogger(__name__)


class Rendered(NamedTuple):
    """An item whose row came back in an open shard: what the driver needs once the shard is settled."""

    worker: int
    outcome: ItemOutcome
    item: WorkItem
    reference: object  # its QueuedReference (cluster/placement.py): where a lost item goes back to


@dataclass
class Settled:
    """Items whose shard was settled: `done` (committed) or `lost` (to render again)."""

    done: list[Rendered] = field(default_factory=list)
    lost: list[Rendered] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.done or self.lost)


@dataclass
class _OpenShard:
    writer: str
    entries: list[Rendered] = field(default_factory=list)


@dataclass
class _ClosedShard:
    committed: bool
    rows_left: int | None  # rows of it still to come back; None: not known (found committed in the output)


class ShardLedger:
    """Per worker, the items in its open shards; see the module docstring. `is_committed(shard_key)` looks in the
    output for a shard a lost worker may have committed before it could say so, and clears what of it was published
    if not (storage/shards.py `settle_lost_shard`; None: not looked for)."""

    def __init__(self, is_committed: Callable[[str], bool] | None = None) -> None:
        self.is_committed = is_committed
        self._writers: dict[int, str] = {}  # worker index -> the writer (process) it answered from last
        self._open: dict[str, _OpenShard] = {}  # shard key -> items waiting for its commit
        self._closed: dict[str, _ClosedShard] = {}  # closed shards some of whose rows have not come back yet
        self._dead: set[str] = set()  # writers whose process is gone, with their open shards
        self._settled = Settled()

    @property
    def waiting(self) -> int:
        """Items rendered into open shards, not committed yet."""
        return sum(len(s.entries) for s in self._open.values())

    def waiting_on(self, worker: int) -> int:
        writer = self._writers.get(worker)
        return sum(len(s.entries) for s in self._open.values() if s.writer == writer) if writer else 0

    def rendered(self, writer: str, shard_key: str, entry: Rendered) -> None:
        """A row came back in `shard_key`, written by `writer` (the answer's `ShardReport.writer`)."""
        self.writer_seen(entry.worker, writer)
        closed = self._closed.get(shard_key)
        if closed is not None:  # reported closed before this row came back
            (self._settled.done if closed.committed else self._settled.lost).append(entry)
            if closed.rows_left is not None:
                closed.rows_left -= 1
                if closed.rows_left <= 0:
                    del self._closed[shard_key]
        elif writer in self._dead:  # a late answer of a process that died with this shard open
            self._settled.lost.append(entry)
        else:
            self._open.setdefault(shard_key, _OpenShard(writer)).entries.append(entry)

    def report(self, worker: int, report: ShardReport) -> None:
        """A worker's answer said which shards it closed since its last one."""
        self.writer_seen(worker, report.writer)
        for shard in report.closed:
            if not shard.committed:
                log.warning("shard %s was not committed (%s); its items render again", shard.key, shard.error)
            self._close(shard.key, shard.committed, shard.items)

    def writer_seen(self, worker: int, writer: str) -> None:
        """`worker` answered from `writer` (a render, a commit, a probe): a writer other than its last means its
        actor was restarted, and the old process's open shards are gone."""
        if writer in self._dead:
            return  # a late answer of a process already known gone
        known = self._writers.get(worker)
        if known is not None and known != writer:
            log.warning("worker %d restarted (was %s, now %s): its open shard is lost", worker, known, writer)
            self.lose(worker)
        self._writers[worker] = writer

    def lose(self, worker: int) -> None:
        """The worker's process is gone (retired, killed at release, restarted): its open shards never commit,
        unless it committed one before it could say so (`is_committed`)."""
        writer = self._writers.pop(worker, None)
        if writer is None:
            return
        self._dead.add(writer)
        for key in [k for k, s in self._open.items() if s.writer == writer]:
            self._close(key, self._committed_in_output(key), None)

    def take(self) -> Settled:
        """What was settled since the last call: items to count done, items to render again."""
        settled, self._settled = self._settled, Settled()
        return settled

    def _close(self, key: str, committed: bool, rows: int | None) -> None:
        shard = self._open.pop(key, None)
        entries = shard.entries if shard else []
        (self._settled.done if committed else self._settled.lost).extend(entries)
        rows_left = None if rows is None else rows - len(entries)
        if rows_left is None or rows_left > 0:
            self._closed[key] = _ClosedShard(committed, rows_left)

    def _committed_in_output(self, key: str) -> bool:
        if self.is_committed is None:
            return False
        try:
            return self.is_committed(key)
        except Exception as e:  # cannot tell: render them again, else the job could never count them
            log.warning("could not tell whether shard %s was committed (%s); its items render again", key, e)
            return False
