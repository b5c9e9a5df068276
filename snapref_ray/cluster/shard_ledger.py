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
shard may be reported staged before every one of its rows has come back (the actor runs two calls at once, and
either may fill the shard): it is committed only once they all have, so a shard holding items of a call that never
answers is never committed (that call's items render again).

What it holds is bounded by the work in flight: at most workers x shard_max_items entries in open shards.
No Ray here: the loop (cluster/scheduler.py) feeds it and takes what `take()` settled.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from snapref_ray.cluster.tasks import ItemOutcome, ShardReport

if TYPE_CHECKING:  # an item is only carried here; its module (the job's planning) imports torch
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
class _Shard:
    """A shard some of whose rows came back: open, or staged and waiting for the rest of its rows."""

    writer: str
    entries: list[Rendered] = field(default_factory=list)
    staged_rows: int | None = None  # the rows it holds, once its worker reported it staged


class ShardLedger:
    """Per worker, the items in its open shards; see the module docstring. `commit(shard_key)` commits a staged
    shard and says whether it is committed (the job output's `commit_shard`; None: a staged shard counts as
    committed, for tests of the ledger alone).

    A staged shard is committed only once every one of its rows has come back in an answer. The actor runs two
    calls at once, and a shard may hold items of a call that has not answered yet: if that call never answers (its
    worker died), its items render again, so the shard must never be committed — it is lost with its worker."""

    def __init__(self, commit: Callable[[str], bool] | None = None) -> None:
        self.commit = commit
        self._writers: dict[int, str] = {}  # worker index -> the writer (process) it answered from last
        self._shards: dict[str, _Shard] = {}  # shard key -> its items that came back, waiting for its commit
        self._lost: set[str] = set()  # shards never to be committed: rows of them that come back late are lost
        self._dead: set[str] = set()  # writers whose process is gone, with their open shards
        self._settled = Settled()

    @property
    def waiting(self) -> int:
        """Items rendered into shards, not committed yet."""
        return sum(len(s.entries) for s in self._shards.values())

    def waiting_on(self, worker: int) -> int:
        writer = self._writers.get(worker)
        return sum(len(s.entries) for s in self._shards.values() if s.writer == writer) if writer else 0

    def rendered(self, writer: str, shard_key: str, entry: Rendered) -> None:
        """A row came back in `shard_key`, written by `writer` (the answer's `ShardReport.writer`)."""
        self.writer_seen(entry.worker, writer)
        if shard_key in self._lost or writer in self._dead:  # a late row of a shard that will never be committed
            self._settled.lost.append(entry)
            return
        self._shards.setdefault(shard_key, _Shard(writer)).entries.append(entry)
        self._commit_when_whole(shard_key)

    def report(self, worker: int, report: ShardReport) -> None:
        """A worker's answer said which shards it closed since its last one."""
        self.writer_seen(worker, report.writer)
        for shard in report.closed:
            if not shard.staged:
                log.warning("shard %s could not be staged (%s); its items render again", shard.key, shard.error)
                self._settle(shard.key, committed=False)
                continue
            self._shards.setdefault(shard.key, _Shard(report.writer)).staged_rows = shard.items
            self._commit_when_whole(shard.key)

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
        """The worker's process is gone (retired, killed at release, restarted): its shards not committed yet never
        will be (one it staged is voided at the end of the run)."""
        writer = self._writers.pop(worker, None)
        if writer is None:
            return
        self._dead.add(writer)
        for key in [k for k, s in self._shards.items() if s.writer == writer]:
            self._settle(key, committed=False)

    def take(self) -> Settled:
        """What was settled since the last call: items to count done, items to render again."""
        settled, self._settled = self._settled, Settled()
        return settled

    def _commit_when_whole(self, key: str) -> None:
        shard = self._shards[key]
        if shard.staged_rows is not None and len(shard.entries) >= shard.staged_rows:
            self._settle(key, committed=self.commit is None or self.commit(key))

    def _settle(self, key: str, *, committed: bool) -> None:
        shard = self._shards.pop(key, None)
        entries = shard.entries if shard else []
        (self._settled.done if committed else self._settled.lost).extend(entries)
        if not committed:
            self._lost.add(key)
