"""What the batch schedule counts (`SchedulerStats`, summary.json `scheduler`) and why it requeues (`Cause`), the
key of its requeue counts. No Ray here: cluster/failures.py tells the cause from the exception a call raised.

The policy's parts count into a fresh `SchedulerStats` per step (a delta) and hand it over in the step's outcome;
the engine core's loop keeps the one running sum (`update`). No one else writes the sum.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import StrEnum


class Cause(StrEnum):
    """Why items were requeued without counting an attempt (summary.json `requeues`); cluster/failures.py tells
    which from the exception a call raised."""

    WORKER_LOST = "worker_lost"  # the worker's process died (its node is alive)
    NODE_LOST = "node_lost"  # the worker's whole node died
    OOM_KILLED = "oom_killed"  # Ray's memory monitor killed the worker (ray.exceptions.OutOfMemoryError)
    DEVICE_OOM = "device_oom"  # torch.OutOfMemoryError in the worker's render: the batch was split
    REFKV_LOST = "refkv_lost"  # the batch's RefKV could not be fetched; the worker re-encoded it
    RELEASED = "released"  # the scheduler itself killed the worker (no work left, or given up for dead)
    # Rendered into a webdataset shard that will never be committed (its worker died, was restarted or could not
    # publish it): rendered again in the same run (cluster/shard_ledger.py)
    SHARD_LOST = "shard_lost"


REQUEUE_CAUSES = tuple(c.value for c in Cause)

# The loop's reading of a probe's error that says the actor is being restarted (Ray's ActorUnavailableError): not a
# probe failure. For a render call it is a lost worker (cluster/failures.py gives it WORKER_LOST).
RESTARTING = "restarting"

# Fields a delta carries as the highest value seen (the sum keeps the highest); and fields a delta sets (the latest
# value that is not None wins). Every other number is summed.
_HIGHEST = frozenset({"max_encodes_per_reference", "peak_open_references", "peak_workers"})
_LATEST = frozenset({"measured_transfer_bytes_per_s", "seconds_to_start", "batch_limits"})


@dataclass
class SchedulerStats:
    dispatched_batches: int = 0
    encodes_requested: int = 0  # encode calls that opened a reference
    local_encodes: int = 0  # helpers on another node told to encode instead of fetching (cost model)
    fetches: int = 0  # helpers handed the driver's RefKV from the object store
    same_node_fetches: int = 0  # ... from their own node's object store (shared memory)
    cross_node_fetches: int = 0  # ... from another node's (a network transfer)
    measured_transfer_bytes_per_s: float | None = None  # first cross-node fetch: RefKV bytes / seconds
    reference_encodes: int = 0  # reference-stream runs the workers reported (the real count)
    max_encodes_per_reference: int = 0
    worker_failures: int = 0
    retired_workers: int = 0
    retried_items: int = 0  # items tried again after a failure of their own (an attempt counted)
    attempts_charged: int = 0  # failed attempts counted against max_attempts (the items' own errors)
    failed_items: int = 0
    # Items requeued (or, for refkv_lost, re-encoded for) because of the infrastructure, by Cause: no attempt
    # counted. The budget is max_requeues_per_item x the job's items (refkv_lost is not a requeue).
    requeues: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REQUEUE_CAUSES, 0))
    requeue_budget: int = 0
    batch_splits: int = 0  # out-of-memory batches halved
    isolated_batches: int = 0  # batches whose forward raised, retried one item at a time (no attempt counted)
    refkvs_dropped: int = 0  # RefKV handles forgotten because their creator failed or a fetch found them gone
    # Per (width, height, rows per image) dispatched: the batch cap the job ended with (max_batch unless out of
    # memory halved it) and how many splits led there.
    batch_limits: list[dict] = field(default_factory=list)
    done_items: int = 0
    # Webdataset: items rendered into shards that were never committed once the schedule had ended (a failed or
    # interrupted job's last release); they are not in done_items and render on the next run.
    uncommitted_items: int = 0
    peak_open_references: int = 0
    workers_started: int = 0  # workers that became ready (joined the schedule)
    workers_released: int = 0  # killed because no work was left for them
    worker_start_failures: int = 0
    peak_workers: int = 0  # most workers ready at once
    seconds_to_start: float = 0.0  # from run() until min_workers were ready and rendering began

    def take(self) -> SchedulerStats:
        """This delta as it stands, and this one reset (in place: the policy's parts hold it). Once a step: a swap
        of the fields, not a copy."""
        taken = SchedulerStats.__new__(SchedulerStats)
        taken.__dict__, self.__dict__ = self.__dict__, SchedulerStats().__dict__
        return taken

    def update(self, delta: SchedulerStats) -> None:
        """Add one step's counts (a delta the policy returned) to this sum; fields a step left at their default
        (most, most steps) are passed over."""
        for name, value in delta.__dict__.items():
            if name == "requeues":
                for cause, n in value.items():
                    if n:
                        self.requeues[cause] = self.requeues.get(cause, 0) + n
            elif value == _DEFAULTS[name] or value is None:
                continue
            elif name in _HIGHEST:
                setattr(self, name, max(getattr(self, name), value))
            elif name in _LATEST:
                setattr(self, name, value)
            else:
                setattr(self, name, getattr(self, name) + value)


_DEFAULTS = {f.name: getattr(SchedulerStats(), f.name) for f in fields(SchedulerStats)}
