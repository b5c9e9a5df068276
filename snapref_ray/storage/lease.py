"""One driver per output at a time: a lease held on the output root while a job runs.

Two drivers started on one output (a resubmitted Ray job, an orchestrator's retry while the first
still runs) would otherwise both render every item. The lease is a numbered object,
``lease/<generation>.json``, holding who took it (host, pid, job id, start) and until when. Taking it
means creating the next generation with a conditional create (local: a hard link, which fails when the
name exists; S3: ``If-None-Match: *``), so of two drivers racing for one generation the store lets
exactly one win; every backend already has that one primitive (`Storage.put_if_absent`), nothing else
is needed (no ETag compare-and-swap).

The newest generation is the current lease. It may be taken over when it is released (the driver
finished) or expired (the driver was killed: it stopped renewing). The holder rewrites its own
generation with a later expiry every third of the duration from a background thread, so a killed
driver blocks the next run for at most one duration (60 s by default); a driver on the same machine
(same kernel and PID namespace) whose process is gone blocks nothing: the next one sees that and takes
over at once. Expiry is compared on the wall
clock, so the drivers' hosts must agree on the time to within a few seconds (NTP).

A driver that stalled past its expiry can lose the lease to another one; `check` tells it so, and the
driver calls it once per scheduler step and before each commit (storage/job_output.py: the one fence; a
driver that no longer holds the output commits nothing more to it). A driver whose lease ran out while
nobody took it over (a long store outage, a pause) does not rewrite the old generation: it takes the next
one with the same conditional create a rival would use, so of the two exactly one goes on. Every write
that decides something is a conditional create, and a store that ignores them would let two drivers hold
one output: `check_conditional_create` probes the store once per run and refuses such a store.

Time comes from an injectable clock (`clock=`), so the tests move it instead of sleeping.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from .backends import Storage, StorageError

log = logging.getLogger(__name__)

LEASE_PREFIX = "lease"
LEASE_FORMAT = "snapref-ray/lease/1"
DEFAULT_LEASE_SECONDS = 60.0
# How long a driver whose lease ran out waits for an unanswering store before it gives up (no rival can take the
# lease over while the store does not answer either); the storage layer's own outage tolerance is the same.
DEFAULT_OUTAGE_SECONDS = 120.0


class LeaseHeldError(OSError):
    """Another driver holds the output's lease (the message is one line naming it and its expiry).

    An OSError (like EBUSY), so the CLI tells it as a one-line usage error, not a traceback."""


class LeaseLostError(OSError):
    """This driver's lease was taken over (it stopped renewing for longer than the lease lasts): it stops and writes
    nothing more. An OSError, so the CLI tells it in one line."""


@dataclass(frozen=True)
class LeaseRecord:
    """The content of one ``lease/<generation>.json``."""

    generation: int
    holder_id: str  # unique per acquisition: two drivers in one process are told apart
    host: str
    pid: int
    job_id: str
    started_at: float
    expires_at: float
    released: bool = False
    # Which kernel and PID namespace `pid` belongs to: only there can another driver see that it is gone.
    process_scope: str = ""
    format: str = LEASE_FORMAT

    def free_at(self, now: float) -> bool:
        """Whether another driver may take the output over at `now`: released, expired, or its driver is
        a process of this machine (same kernel, same PID namespace) that no longer exists."""
        return self.released or now >= self.expires_at or self.holder_gone()

    def holder_gone(self) -> bool:
        """True only when the holder ran here and its pid is gone (a reused pid reads as alive: the safe way)."""
        if not self.process_scope or self.process_scope != process_scope() or self.pid == os.getpid():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def describe(self) -> str:
        """`job J (host H, pid P, since T)`, for messages."""
        return f"job {self.job_id} (host {self.host}, pid {self.pid}, since {_clock(self.started_at)})"


def process_scope() -> str:
    """This process's kernel boot and PID namespace: two records with the same scope name pids of one table."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""  # not Linux: never judge another process by its pid
    return f"{socket.gethostname()}/{boot}/{namespace}"


def _clock(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _key(generation: int) -> str:
    return f"{LEASE_PREFIX}/{generation:012d}.json"


def _generation(key: str) -> int | None:
    name = key.rsplit("/", 1)[-1]
    stem = name.removesuffix(".json")
    return int(stem) if name.endswith(".json") and stem.isdigit() else None


_READ_TRIES = 5  # listings a reader repeats when the newest record vanishes between the listing and the read


def current_lease(storage: Storage) -> LeaseRecord | None:
    """The newest lease record of the output, or None if no driver ever held it."""
    for attempt in range(_READ_TRIES):
        keys = [(g, k) for k in storage.list(LEASE_PREFIX + "/") if (g := _generation(k)) is not None]
        if not keys:
            return None
        generation, key = max(keys)
        try:
            fields = json.loads(storage.get_bytes(key))
            return LeaseRecord(**{**fields, "generation": generation})
        except StorageError:
            if attempt == _READ_TRIES - 1:
                raise
            # Cleaned up between the listing and the read (a newer generation exists): look again.
        except (ValueError, TypeError) as e:
            raise StorageError(f"lease {storage.uri_for(key)} is not a {LEASE_FORMAT} record: {e}") from e
    raise AssertionError("unreachable")


def default_job_id() -> str:
    """The Ray job id when running under `ray job submit`, else host:pid."""
    env = os.environ
    return env.get("RAY_JOB_ID") or env.get("RAY_JOB_SUBMISSION_ID") or f"{socket.gethostname()}:{os.getpid()}"


class ConditionalCreateIgnored(OSError):
    """The store wrote a second conditional create of one key: it ignores ``If-None-Match``, and two drivers
    could both hold the output. An OSError, so the CLI tells it in one line."""


PROBE_PREFIX = f"{LEASE_PREFIX}/probe-"


def check_conditional_create(storage: Storage) -> None:
    """Create one probe key twice with a conditional create; raise ConditionalCreateIgnored when the second one
    is written too (the store ignores ``If-None-Match``: MinIO before RELEASE.2024-05-07, GCS's S3 interface).
    The lease, the claim and every shard's commit decision rely on the store refusing the second create."""
    key = f"{PROBE_PREFIX}{uuid.uuid4().hex}.json"
    try:
        if not storage.put_if_absent(key, b'{"probe": 1}'):
            raise StorageError(f"cannot create the probe {storage.uri_for(key)}: it exists already")
        if storage.put_if_absent(key, b'{"probe": 2}'):
            raise ConditionalCreateIgnored(
                f"the store behind {storage.uri} ignores conditional creates (If-None-Match: *): it wrote "
                f"{storage.uri_for(key)} twice, so two drivers could both hold this output; use a store that "
                f"honours them (AWS S3, Cloudflare R2, SeaweedFS, MinIO RELEASE.2024-05-07 or later)"
            )
    finally:
        try:
            storage.delete(key)
        except StorageError:
            pass  # a probe left behind costs one listing entry


class OutputLease:
    """A held lease: renewed by a background thread until `release` (also a context manager).

    Acquire with `OutputLease.acquire`. If the object is dropped without `release` (an exception between
    acquire and the caller's finally), the renewal stops with it and the lease is released. `check` is
    what the driver calls before it commits; it costs no I/O while the lease is fresh.
    """

    def __init__(
        self,
        storage: Storage,
        record: LeaseRecord,
        duration_s: float,
        *,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        renew: bool = True,
        outage_s: float = DEFAULT_OUTAGE_SECONDS,
    ):
        self.storage = storage
        self.duration_s = duration_s
        self.clock = clock
        self._sleep = sleep  # `check`'s wait for a store that does not answer (the clock's companion in tests)
        self.outage_s = outage_s  # how long `check` waits out a store that does not answer, with no rival seen
        self._record = record
        self._lock = threading.RLock()
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_renew_loop,
            args=(weakref.ref(self), self._stop, duration_s / 3),
            name=f"lease-{record.generation}",
            daemon=True,
        )
        self._finalizer = weakref.finalize(self, _release, storage, record, self._stop, clock)
        if renew:
            self._thread.start()

    @classmethod
    def acquire(
        cls,
        storage: Storage,
        *,
        duration_s: float = DEFAULT_LEASE_SECONDS,
        wait_s: float = 0.0,
        job_id: str | None = None,
        poll_s: float | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        renew: bool = True,
        probe: bool = True,
    ) -> OutputLease:
        """Take the output's lease, or raise LeaseHeldError naming its holder.

        With `wait_s` > 0, wait up to that long for the holder to finish or its lease to expire. A lease
        whose driver was killed expires `duration_s` (its own) after its last renewal. `probe` first checks
        that the store honours conditional creates (`check_conditional_create`); `renew=False` leaves the
        renewal to the caller (tests that move `clock`).
        """
        if duration_s <= 0:
            raise ValueError(f"lease duration must be > 0 s, got {duration_s}")
        if probe:
            check_conditional_create(storage)
        deadline = clock() + max(wait_s, 0.0)
        poll_s = poll_s if poll_s is not None else min(1.0, duration_s / 6)
        job_id = job_id or default_job_id()
        waited = False
        while True:
            current = current_lease(storage)
            now = clock()
            if current is None or current.free_at(now):
                record = _new_record(
                    current.generation + 1 if current else 0, uuid.uuid4().hex, job_id, clock, duration_s
                )
                if storage.put_if_absent(_key(record.generation), _encode(record)) and _still_newest(storage, record):
                    if current is not None and not current.released:
                        why = "its process is gone" if current.holder_gone() else "it expired"
                        log.warning("took over the lease of %s on %s: %s", current.describe(), storage.uri, why)
                    _forget_older(storage, record.generation)
                    return cls(storage, record, duration_s, clock=clock, sleep=sleep, renew=renew)
                continue  # another driver took this generation first (or the store said 409): read who, decide again
            if now >= deadline:
                raise LeaseHeldError(_held_message(storage, current, waited, now))
            if not waited:
                log.info("output %s is held by %s; waiting up to %.0f s", storage.uri, current.describe(), wait_s)
                waited = True
            sleep(max(0.0, min(poll_s, deadline - now, current.expires_at - now + 0.05)))

    @property
    def record(self) -> LeaseRecord:
        """The latest record this driver wrote."""
        with self._lock:
            return self._record

    def renew(self) -> None:
        """Push the expiry one duration ahead (the background thread does this); LeaseLostError if lost.

        The newest record must still be this holder's. A lease that already ran out is not rewritten (a rival
        may be taking it at this moment): the next generation is taken with a conditional create instead, so
        exactly one of the two goes on. The new expiry counts only once its write has landed."""
        with self._lock:
            self._check_locked()
            newest = current_lease(self.storage)
            if newest is None or newest.holder_id != self._record.holder_id:
                self._lost = f"taken over by {newest.describe() if newest else 'nobody (lease deleted)'}"
                self._check_locked()
            now = self.clock()
            if now < self._record.expires_at:
                renewed = dataclasses.replace(
                    self._record, generation=newest.generation, expires_at=now + self.duration_s
                )
                self.storage.put_bytes(_key(renewed.generation), _encode(renewed), "application/json")
            else:
                renewed = _new_record(
                    newest.generation + 1, self._record.holder_id, self._record.job_id, self.clock, self.duration_s
                )
                renewed = dataclasses.replace(renewed, started_at=self._record.started_at)
                if not (
                    self.storage.put_if_absent(_key(renewed.generation), _encode(renewed))
                    and _still_newest(self.storage, renewed)
                ):
                    taken = current_lease(self.storage)
                    self._lost = f"taken over by {taken.describe() if taken else 'another driver'} after it expired"
                    self._check_locked()
                log.warning(
                    "the lease on %s ran out with no other driver taking it; went on as generation %d",
                    self.storage.uri,
                    renewed.generation,
                )
            self._record = renewed

    def check(self) -> float:
        """Raise LeaseLostError unless this driver still holds the lease; the seconds it is good for.

        Called once per scheduler step and before each commit: no I/O while the lease is fresh. A lease that ran
        out (the renewals failed: a store outage, a pause) is renewed here, waiting out an unanswering store for
        up to `outage_s` as long as no other driver is seen holding the output."""
        with self._lock:
            self._check_locked()
            left = self._record.expires_at - self.clock()
            if left > 0:
                return left
            started = self.clock()
            while True:
                try:
                    self.renew()
                    return self._record.expires_at - self.clock()
                except LeaseLostError:
                    raise
                except Exception as e:  # the store does not answer: nobody can take the lease over either
                    if self.clock() - started >= self.outage_s:
                        self._lost = f"not renewed since {_clock(self._record.expires_at - self.duration_s)} ({e})"
                        self._check_locked()
                    log.warning("the lease on %s could not be renewed (%s); waiting for the store", self.storage.uri, e)
                    self._sleep(min(1.0, self.duration_s / 6))

    def _check_locked(self) -> None:
        if self._lost is not None:
            raise LeaseLostError(
                f"lost the lease on {self.storage.uri} (generation {self._record.generation}): {self._lost}; "
                f"stopping rather than committing alongside another driver"
            )
        if self._stop.is_set():
            raise LeaseLostError(f"the lease on {self.storage.uri} was released")

    def _renew_failed(self, error: BaseException) -> None:
        if isinstance(error, LeaseLostError):
            return
        log.warning("could not renew the lease on %s: %s (retrying)", self.storage.uri, error)

    def release(self) -> None:
        """Mark the lease released (the next driver takes it at once) and stop renewing. Idempotent."""
        with self._lock:
            record, lost = self._record, self._lost
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        self._finalizer.detach()
        if lost is None:
            _release(self.storage, record, self._stop, self.clock)

    def __enter__(self) -> OutputLease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _new_record(
    generation: int, holder_id: str, job_id: str, clock: Callable[[], float], duration_s: float
) -> LeaseRecord:
    started = clock()
    return LeaseRecord(
        generation=generation,
        holder_id=holder_id,
        host=socket.gethostname(),
        pid=os.getpid(),
        job_id=job_id,
        started_at=started,
        expires_at=started + duration_s,
        process_scope=process_scope(),
    )


def _still_newest(storage: Storage, record: LeaseRecord) -> bool:
    """Read the lease back after creating it: the record must be there, ours, and the newest."""
    newest = current_lease(storage)
    return newest is not None and newest.holder_id == record.holder_id and newest.generation == record.generation


def _encode(record: LeaseRecord) -> bytes:
    return json.dumps(asdict(record), indent=2, sort_keys=True).encode()


def _renew_loop(ref: weakref.ref, stop: threading.Event, every_s: float) -> None:
    # A weak reference: the thread must not keep a dropped lease alive (its finalizer releases it).
    while not stop.wait(every_s):
        lease = ref()
        if lease is None:
            return
        try:
            lease.renew()
        except LeaseLostError:
            return
        except Exception as e:  # a storage blip: the next round retries, well before expiry
            lease._renew_failed(e)
        del lease


def _release(storage: Storage, record: LeaseRecord, stop: threading.Event, clock: Callable[[], float]) -> None:
    stop.set()
    try:
        newest = current_lease(storage)
    except StorageError as e:
        log.warning("could not release the lease on %s (it expires on its own): %s", storage.uri, e)
        return
    if newest is None or newest.holder_id != record.holder_id or newest.generation != record.generation:
        return  # taken over meanwhile: that generation is someone else's now
    released = LeaseRecord(**{**asdict(record), "expires_at": clock(), "released": True})
    try:
        storage.put_bytes(_key(record.generation), _encode(released), "application/json")
    except StorageError as e:
        log.warning("could not release the lease on %s (it expires on its own): %s", storage.uri, e)


def _forget_older(storage: Storage, generation: int) -> None:
    """Delete generations older than the previous one (best effort: they only cost a listing)."""
    for key in storage.list(LEASE_PREFIX + "/"):
        g = _generation(key)
        if g is not None and g < generation - 1:
            try:
                storage.delete(key)
            except StorageError:
                pass


def _held_message(storage: Storage, current: LeaseRecord, waited: bool, now: float) -> str:
    left = max(0.0, current.expires_at - now)
    advice = "; wait for it with --wait-for-lease (output.lease_wait_seconds), or choose another output"
    advice = "" if waited else advice
    return (
        f"output {storage.uri} is in use by {current.describe()}; its lease expires at "
        f"{_clock(current.expires_at)} (in {left:.0f} s) unless renewed{advice}"
    )


__all__ = [
    "DEFAULT_LEASE_SECONDS",
    "LEASE_PREFIX",
    "LeaseHeldError",
    "LeaseLostError",
    "LeaseRecord",
    "OutputLease",
    "ConditionalCreateIgnored",
    "check_conditional_create",
    "current_lease",
]
