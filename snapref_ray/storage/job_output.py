"""A job's output, as one driver run holds it: the one place that writes what readers read.

Workers publish, the driver commits (the shape of Ray Data's Datasink): a worker stores its images (``images/``)
or stages its closed webdataset shard (``staging/``) and returns what it wrote; only the driver that holds the
output's lease commits — metadata rows, shards, errors, the summary — and every commit goes through `fence` first.
`JobOutput.open` takes the output in this order:

1. the store is probed for conditional creates (storage/lease.py `check_conditional_create`), and the lease taken:
   from here on this driver alone writes what readers read;
2. what earlier drivers left half done is settled: staged shards decided "committed" are moved into place, those
   nobody decided are voided (storage/shards.py `settle_staged_shards`); what the output holds is read as one
   value (its claim, the committed item ids this run skips, their contents: storage/item_contents.py
   `CommittedState`), and the caller's `admit` checks the job against it (explicit ids with other content);
3. the claim (``job.json``: the same job resumes, `append` adds another job's images; under the lease, so two
   appending drivers cannot lose each other's fingerprint, and after `admit`, so a refused job claims nothing);
4. the parts are compacted (best effort).

A commit is made only while the lease is good, and bounded by the time it is good for (`bounded_by`): a write
that cannot land before the lease runs out fails instead of landing after another driver took the output over.
A driver whose lease was taken over raises `LeaseLostError` at its next step and writes nothing more — no rows,
no errors, no summary, no compaction.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .backends import Storage, bounded_by
from .item_contents import CommittedState, read_committed_state
from .lease import DEFAULT_LEASE_SECONDS, LeaseLostError, OutputLease
from .ledger import CommittedIds, claim_output
from .metadata import (
    ErrorWriter,
    MetadataWriter,
    compact_output_parts,
    read_errors_table,
    read_summary,
    write_summary,
)
from .shards import commit_shard, settle_staged_shards

log = logging.getLogger(__name__)

# A commit needs at least this share of the lease left: the rest is the time its write may take to land.
COMMIT_MARGIN = 1 / 6


@dataclass(frozen=True)
class OutputSettings:
    """What a job says about its output (the job spec's `output:` section, as storage/ needs it)."""

    fingerprint: str  # this job's (storage/ledger.py `job_fingerprint`)
    spec: dict  # recorded in job.json
    append: bool = False
    webdataset: bool = False
    embed_images: bool = False
    flush_seconds: float = 30.0
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    lease_wait_seconds: float = 0.0


class JobOutput:
    """The output this driver run holds: see the module docstring. Open with `JobOutput.open`; `finish` (or
    `abandon`, when the run failed before it rendered) ends it."""

    def __init__(self, storage: Storage, settings: OutputSettings, lease: OutputLease) -> None:
        self.storage = storage
        self.settings = settings
        self.lease = lease
        self.done_before: CommittedIds | None = None  # read by `open`, once the earlier runs are settled
        self.earlier_summary: dict | None = None
        self.metadata = MetadataWriter(
            storage, embed_images=settings.embed_images, flush_seconds=settings.flush_seconds, guard=self.fence
        )
        self.errors = ErrorWriter(storage, guard=self.fence)
        self._ended = False

    @classmethod
    def open(
        cls, storage: Storage, settings: OutputSettings, *, admit: Callable[[CommittedState], None] | None = None
    ) -> JobOutput:
        """Take the output (steps 1-4 of the module docstring); raises LeaseHeldError, OutputConflictError,
        ConditionalCreateIgnored in one line. `admit(committed)` is called with what the output holds (its claim,
        committed ids and their contents: storage/item_contents.py `CommittedState`) once it is read and before the
        claim writes: a job it refuses (it raises) leaves the output as it found it, but for what earlier runs left
        half done."""
        lease = OutputLease.acquire(
            storage, duration_s=settings.lease_seconds, wait_s=settings.lease_wait_seconds, probe=True
        )
        try:
            output = cls(storage, settings, lease)
            output._settle()
            committed = read_committed_state(storage, settings.fingerprint)
            output.done_before = committed.ids  # the contents are the check's alone: not held through the run
            if admit is not None:
                admit(committed)
            claim_output(storage, settings.fingerprint, settings.spec, append=settings.append)
            output._compact("before rendering")
            output.earlier_summary = output._read_earlier_summary()
        except BaseException:
            lease.release()
            raise
        return output

    @property
    def holder(self) -> str:
        """This run's lease holder id (recorded with each shard decision)."""
        return self.lease.record.holder_id

    def fence(self) -> float:
        """Raise LeaseLostError unless this run still holds the output; the seconds the lease is good for."""
        return self.lease.check()

    @contextlib.contextmanager
    def _commit_window(self):
        """A commit's writes must land before the lease they were checked against runs out."""
        left = self.fence()
        with bounded_by(left - self.lease.duration_s * COMMIT_MARGIN):
            yield

    # -- commits ----------------------------------------------------------------------------------------------
    def commit_row(self, row: dict) -> None:
        """An item whose image a worker stored (``files``): its metadata row, written with the next part (with the
        image's bytes too under ``embed_images``, read back from where the worker stored it)."""
        # A judged job's rejected render whose image was not kept has no image_key: its row goes in without bytes.
        image_bytes = (
            self.storage.get_bytes(row["image_key"]) if self.settings.embed_images and row["image_key"] else None
        )
        self.metadata.add(row, image_bytes)

    def commit_shard(self, shard_key: str) -> bool:
        """A shard a worker staged (``webdataset``): decided and moved into place; False when it was voided (its
        items render again)."""
        with self._commit_window():
            return commit_shard(self.storage, shard_key, by=self.holder)

    def record_error(self, error: str, stage: str, **where: Any) -> None:
        self.errors.record(error, stage, **where)

    def recorded_validation_errors(self) -> set[tuple]:
        """(manifest_row, item_id, error) of the invalid rows earlier runs recorded: each is recorded once per
        output, however often the job is resumed."""
        table = read_errors_table(self.storage, exclude_ids=set())
        rows = table.select(["manifest_row", "item_id", "error", "stage"]).to_pylist()
        return {(r["manifest_row"], r["item_id"], r["error"]) for r in rows if r["stage"] == "validate"}

    # -- the end ----------------------------------------------------------------------------------------------
    def finish(self, summary: dict, *, compact: bool = True) -> None:
        """Flush the rows and errors, settle what the run's workers staged and never reported, write summary.json,
        compact (unless interrupted: the next run does), release the lease. A run that lost the lease writes none
        of it (LeaseLostError)."""
        if self._ended:
            return
        try:
            self.fence()
            self.metadata.close()
            self.errors.close()
            self._settle()
            with self._commit_window():
                write_summary(self.storage, summary)
            if compact:
                self._compact("at the end")
        finally:
            self._end()

    def abandon(self) -> None:
        """End without a summary (the run failed before rendering): flush what was recorded, release the lease."""
        if self._ended:
            return
        try:
            with contextlib.suppress(Exception):
                self.fence()
                self.metadata.close()
                self.errors.close()
        finally:
            self._end()

    def _end(self) -> None:
        self._ended = True
        self.lease.release()

    def _settle(self) -> None:
        if not self.settings.webdataset:
            return
        with self._commit_window():
            settled = settle_staged_shards(self.storage, by=self.holder)
        if settled.committed or settled.voided:
            log.info(
                "settled staged shards on %s: %d committed shard(s) moved into place, %d voided",
                self.storage.uri,
                len(settled.committed),
                len(settled.voided),
            )

    def _compact(self, when: str) -> None:
        try:
            with self._commit_window():
                compact_output_parts(self.storage)
        except LeaseLostError:
            raise
        except Exception as e:  # the parts stay as they are, and the next run compacts them
            log.warning("could not compact the output's parts %s: %s", when, e)

    def _read_earlier_summary(self) -> dict | None:
        """What an earlier run's summary.json says; None when there is none or it cannot be read (a driver killed
        while writing it: the job's figures then start again from this run, and nothing else is lost)."""
        try:
            return read_summary(self.storage)
        except (ValueError, TypeError) as e:
            log.warning(
                "%s cannot be read (%s); its earlier runs are not counted", self.storage.uri_for("summary.json"), e
            )
            return None


__all__ = ["COMMIT_MARGIN", "JobOutput", "OutputSettings"]
