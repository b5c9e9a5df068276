"""Which rendered items wait in a worker's open webdataset shard, and what becomes of them.

With `output.format: webdataset` a row that comes back from a render sits in its worker's open shard, not yet in the
output. A worker stages a shard when it closes it (storage/shards.py) and says so with its next answer
(`ShardReport`, with each render and with `publish_outputs` at release); the driver commits it then (`commit`, the
output's `commit_shard`, under the lease) and counts its items done. A shard that never will be committed (its
worker's process died with it open or staged but unreported, staging failed, or the commit found it voided) gives
its items back to be rendered again in the same run, without charging an attempt (`Cause.SHARD_LOST`); what such a
shard left under ``staging/`` is voided when the run ends, so it can never be committed later.

A worker's process is told by its `writer` id (cluster/tasks.py `ShardReport`): a restarted actor (Ray restarts it
in place) has a fresh, empty ShardWriter, so a new writer for a worker means the old one's open shard is gone. A
shard may be reported closed before every one of its rows has come back (the actor runs two calls at once, and
either may fill the shard): the ledger remembers a closed shard until that many rows came.

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
    """Per worker, the items in its open shards; see the module docstring. `commit(shard_key)` commits a staged
    shard and says whether it is committed (the job output's `commit_shard`; None: a staged shard counts as
    committed, for tests of the ledger alone)."""

    def __init__(self, commit: Callable[[str], bool] | None = None) -> None:
        self.commit = commit
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
            if not shard.staged:
                log.warning("shard %s could not be staged (%s); its items render again", shard.key, shard.error)
            committed = shard.staged and (self.commit is None or self.commit(shard.key))
            self._close(shard.key, committed, shard.items)

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
        """The worker's process is gone (retired, killed at release, restarted): its open shards are never committed
        (one it staged without saying so is voided at the end of the run)."""
        writer = self._writers.pop(worker, None)
        if writer is None:
            return
        self._dead.add(writer)
        for key in [k for k, s in self._open.items() if s.writer == writer]:
            self._close(key, False, None)

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
