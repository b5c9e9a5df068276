"""What the batch schedule is told: its limits, timeouts and budgets (`SchedulerConfig`). No Ray here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    max_in_flight_per_worker: int = 2
    max_attempts: int = 3
    max_batch: int = 4
    max_open_references: int | None = None  # default: 2 per worker
    wait_timeout_s: float = 1.0
    # Cross-node transfer rate for the fetch-or-encode decision; None = measure it on the first
    # cross-node fetch (until then, fetching is the choice: it is what gives the measurement).
    transfer_bytes_per_s: float | None = None
    # With a WorkerPool: give up when min_workers are not ready after this long (a cluster that
    # cannot provide the GPUs), and stop relaunching after this many workers failed to start.
    start_timeout_s: float = 900.0
    max_start_failures: int = 3
    # A RefKV's size before one is measured: 1 MP at real size in bf16 (docs/design.md#refkv-and-its-lifetime).
    assumed_refkv_bytes: int = 940_000_000
    # Probes that find the actor dead (not merely restarting) before the worker is given up; a
    # restarting actor (ActorUnavailableError, minutes for a GPU model load) is probed again
    # every `probe_interval_s` for as long as it takes.
    max_probe_failures: int = 3
    probe_interval_s: float = 0.5
    # Requeues for infrastructure failures (no attempt counted) the whole job may take: this x its items.
    max_requeues_per_item: int = 10
    # A lost worker is counted as a node loss once Ray lists its node dead (its health checks take ~15 s);
    # at the end of the job, wait at most this long after the loss for that verdict (cluster/failures.py).
    loss_classification_grace_s: float = 30.0
