"""One driver per output: the lease on a local folder and on S3 (a real SeaweedFS on 127.0.0.1).

Drivers are played by threads and, where a driver must die or stall for real, by a subprocess that
holds a lease and is SIGKILLed or SIGSTOPped.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from snapref_ray.storage.backends import Storage, open_storage
from snapref_ray.storage.lease import LeaseHeldError, LeaseLostError, OutputLease, current_lease
from snapref_ray.storage.metadata import METADATA_SCHEMA, MetadataWriter, read_item_ids

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["local", "s3"])
def where(request, tmp_path) -> tuple[str, dict[str, str]]:
    """(output URI, environment a subprocess needs to reach it)."""
    if request.param == "local":
        return str(tmp_path / "out"), {}
    server = request.getfixturevalue("s3_server")
    return f"s3://{server.bucket}/lease-{uuid.uuid4().hex[:8]}", server.aws_environment()


def _open(uri: str, env: dict[str, str]) -> Storage:
    if not env:
        return open_storage(uri)
    from snapref_ray.storage.backends import S3Options

    return open_storage(
        uri,
        S3Options(
            endpoint_url=env["AWS_ENDPOINT_URL"],
            region="us-east-1",
            access_key=env["AWS_ACCESS_KEY_ID"],
            secret_key=env["AWS_SECRET_ACCESS_KEY"],
        ),
    )


def test_second_driver_refuses_with_one_line_naming_the_holder(where):
    storage = _open(*where)
    first = OutputLease.acquire(storage, job_id="job-first", duration_s=30)
    try:
        with pytest.raises(LeaseHeldError) as e:
            OutputLease.acquire(storage, job_id="job-second", duration_s=30)
        message = str(e.value)
        assert "\n" not in message
        record = first.record
        assert f"in use by job job-first (host {socket.gethostname()}, pid {os.getpid()}, since " in message
        assert "its lease expires at " in message and "--wait-for-lease" in message
        assert current_lease(storage).holder_id == record.holder_id
    finally:
        first.release()
    # Released: the next driver takes it at once, as the next generation.
    second = OutputLease.acquire(storage, job_id="job-second", duration_s=30)
    assert (second.record.generation, second.record.job_id) == (first.record.generation + 1, "job-second")
    second.release()
    assert current_lease(storage).released


def test_drivers_racing_for_a_fresh_output_one_wins(where):
    storage = _open(*where)
    barrier = threading.Barrier(4)
    won: list[OutputLease] = []
    refused: list[str] = []

    def driver(i: int) -> None:
        barrier.wait()
        try:
            won.append(OutputLease.acquire(storage, job_id=f"job-{i}", duration_s=30))
        except LeaseHeldError as e:
            refused.append(str(e))

    threads = [threading.Thread(target=driver, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert (len(won), len(refused)) == (1, 3)
        assert current_lease(storage).holder_id == won[0].record.holder_id
        assert all(f"in use by job {won[0].record.job_id} " in m for m in refused)
    finally:
        for lease in won:
            lease.release()


class _LookedBeforeTheOtherWrote:
    """A storage whose first listing of ``lease/`` is the one taken before another driver wrote its lease:
    the interleaving in which both drivers believe the output free and both try to take it."""

    def __init__(self, storage: Storage):
        self._storage = storage
        self._snapshot: list[str] | None = storage.list("lease/")

    def list(self, prefix: str) -> list[str]:
        if prefix == "lease/" and self._snapshot is not None:
            snapshot, self._snapshot = self._snapshot, None
            return snapshot
        return self._storage.list(prefix)

    def __getattr__(self, name):
        return getattr(self._storage, name)


def test_of_two_drivers_that_both_saw_the_output_free_only_one_takes_it(where):
    storage = _open(*where)
    late = _LookedBeforeTheOtherWrote(storage)  # looked: nothing there
    first = OutputLease.acquire(storage, job_id="job-first", duration_s=30)  # then the other one wrote
    try:
        with pytest.raises(LeaseHeldError, match="in use by job job-first "):
            OutputLease.acquire(late, job_id="job-late", duration_s=30)
        assert current_lease(storage).holder_id == first.record.holder_id
    finally:
        first.release()


def test_a_held_lease_is_renewed_while_its_driver_runs(tmp_path):
    storage = open_storage(str(tmp_path / "out"))
    lease = OutputLease.acquire(storage, duration_s=0.6)
    first_expiry = lease.record.expires_at
    time.sleep(1.5)  # past the first expiry: only renewals keep it
    try:
        assert current_lease(storage).expires_at > first_expiry
        with pytest.raises(LeaseHeldError):
            OutputLease.acquire(storage, duration_s=0.6)
        lease.check()
    finally:
        lease.release()


def test_a_waiting_driver_gets_the_lease_when_the_holder_releases(tmp_path):
    storage = open_storage(str(tmp_path / "out"))
    holder = OutputLease.acquire(storage, job_id="holder", duration_s=30)
    released_at: list[float] = []

    def finish() -> None:
        time.sleep(0.5)
        released_at.append(time.time())
        holder.release()

    t = threading.Thread(target=finish)
    t.start()
    waiter = OutputLease.acquire(storage, job_id="waiter", duration_s=30, wait_s=60)
    t.join()
    # It took the output after the release, and long before the holder's 30 s expiry: it waited for the release.
    assert released_at[0] <= waiter.record.started_at < holder.record.expires_at
    waiter.release()


_HOLDER = textwrap.dedent(
    """
    import sys, time
    from snapref_ray.storage import lease as lease_module
    from snapref_ray.storage.backends import open_storage
    from snapref_ray.storage.lease import OutputLease
    from snapref_ray.storage.metadata import METADATA_SCHEMA, MetadataWriter

    if sys.argv[3] == "elsewhere":  # a driver on another machine: its pid means nothing here
        lease_module.process_scope = lambda: "another-machine"

    lease = OutputLease.acquire(open_storage(sys.argv[1]), job_id="doomed", duration_s=float(sys.argv[2]))
    print("held", flush=True)
    sys.stdin.readline()  # the test SIGKILLs or SIGSTOPs/SIGCONTs us here
    writer = MetadataWriter(open_storage(sys.argv[1]), guard=lease.check, flush_seconds=0)
    writer.add({name: None for name in METADATA_SCHEMA.names} | {"item_id": "from-the-stalled-driver"})
    try:
        writer.close()
        print("committed", flush=True)
    except Exception as e:
        print(type(e).__name__, str(e), flush=True)
    """
)


def _start_holder(uri: str, env: dict[str, str], duration_s: float, where: str = "here") -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, uri, str(duration_s), where],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.slow  # waits out a 2 s lease
def test_a_driver_killed_on_another_machine_blocks_the_next_one_no_longer_than_its_lease(where):
    uri, env = where
    storage = _open(uri, env)
    duration = 2.0
    proc = _start_holder(uri, env, duration, "elsewhere")
    time.sleep(0.8)  # it renewed at least once
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    dead = current_lease(storage)
    assert (dead.job_id, dead.released) == ("doomed", False)
    # The next driver, started at once, waits for the dead one's expiry and takes over; its wait is bounded
    # by one lease duration after the kill (the last renewal came before it), so twice that never runs out.
    lease = OutputLease.acquire(storage, job_id="next", duration_s=duration, wait_s=2 * duration)
    try:
        assert lease.record.started_at >= dead.expires_at
        assert lease.record.generation == dead.generation + 1
    finally:
        lease.release()


def test_a_stalled_driver_that_lost_its_lease_does_not_commit(tmp_path):
    uri = str(tmp_path / "out")
    storage = open_storage(uri)
    proc = _start_holder(uri, {}, 1.0)
    proc.send_signal(signal.SIGSTOP)  # a driver paused (GC, swapped out, a suspended VM) past its expiry
    try:
        lease = OutputLease.acquire(storage, job_id="next", duration_s=30, wait_s=10)
        proc.send_signal(signal.SIGCONT)
        out, _ = proc.communicate("go\n", timeout=60)
    finally:
        proc.kill()
    assert out.startswith("LeaseLostError lost the lease on ")
    assert "taken over by job next" in out or "not renewed since" in out
    assert read_item_ids(storage) == []  # its row never reached metadata/
    # The new holder commits as usual.
    with MetadataWriter(storage, guard=lease.check, flush_seconds=0) as writer:
        writer.add({name: None for name in METADATA_SCHEMA.names} | {"item_id": "from-the-holder"})
    assert read_item_ids(storage) == ["from-the-holder"]
    lease.release()
    with pytest.raises(LeaseLostError, match="was released"):
        lease.check()


def test_a_driver_killed_on_this_machine_blocks_nothing(tmp_path):
    uri = str(tmp_path / "out")
    storage = open_storage(uri)
    proc = _start_holder(uri, {}, 60.0)
    proc.send_signal(signal.SIGKILL)  # kill -9: no handler runs, the lease is not released
    proc.wait()
    dead = current_lease(storage)
    assert (dead.released, dead.pid) == (False, proc.pid) and dead.holder_gone()
    # The same command run again at once takes the output over without waiting (wait_s=0).
    lease = OutputLease.acquire(storage, job_id="again", duration_s=60)
    assert lease.record.started_at < dead.expires_at and lease.record.generation == dead.generation + 1
    lease.release()
    # A live holder of this machine is not taken for gone.
    held = OutputLease.acquire(storage, job_id="live", duration_s=60)
    assert not current_lease(storage).holder_gone()
    held.release()


# -- a lease that cannot be held twice (a clock the test moves; no sleeping) ---------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class IgnoresConditionalCreates:
    """A store that drops If-None-Match (MinIO before 2024-05-07, GCS's S3 interface): every create is written."""

    def __init__(self, storage: Storage):
        self._storage = storage

    def put_if_absent(self, key: str, data: bytes) -> bool:
        self._storage.put_bytes(key, data)
        return True

    def __getattr__(self, name):
        return getattr(self._storage, name)


def test_a_store_that_ignores_conditional_creates_is_refused_in_one_line(where):
    from snapref_ray.storage.lease import ConditionalCreateIgnored

    storage = IgnoresConditionalCreates(_open(*where))
    with pytest.raises(ConditionalCreateIgnored) as e:
        OutputLease.acquire(storage, job_id="job", duration_s=30)
    message = str(e.value)
    assert "\n" not in message and "ignores conditional creates (If-None-Match: *)" in message
    assert "MinIO RELEASE.2024-05-07 or later" in message
    assert current_lease(storage) is None and storage.list("lease/") == []  # nothing taken, the probe removed


def test_two_drivers_on_a_store_that_ignores_conditional_creates_never_both_hold_it(tmp_path):
    # Without the probe (say it was skipped), the read-back after the create still leaves one holder: both write
    # generation 0, the later write wins, and the driver that reads back another holder's record gives way.
    inner = open_storage(str(tmp_path / "out"))
    both_looked, both_wrote = threading.Barrier(2), threading.Barrier(2)
    looked: set[int] = set()

    class Racing(IgnoresConditionalCreates):
        def list(self, prefix: str) -> list[str]:
            keys = inner.list(prefix)
            if threading.current_thread().name.startswith("driver-") and threading.get_ident() not in looked:
                # each driver's first look finds the output free
                looked.add(threading.get_ident())
                both_looked.wait(timeout=10)
            return keys

        def put_if_absent(self, key: str, data: bytes) -> bool:
            written = super().put_if_absent(key, data)
            if key.startswith("lease/0"):
                both_wrote.wait(timeout=10)  # neither reads back before both have written
            return written

    storage = Racing(inner)
    held, refused = [], []

    def driver(i: int) -> None:
        try:
            held.append(OutputLease.acquire(storage, job_id=f"job-{i}", duration_s=30, probe=False, renew=False))
        except LeaseHeldError as e:
            refused.append(str(e))

    threads = [threading.Thread(target=driver, args=(i,), name=f"driver-{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (len(held), len(refused)) == (1, 1)
    assert current_lease(inner).holder_id == held[0].record.holder_id
    held[0].release()


def test_renewal_compares_the_holder_and_a_record_overwritten_by_another_driver_is_lost(tmp_path):
    storage = open_storage(str(tmp_path / "out"))
    clock = Clock()
    mine = OutputLease.acquire(storage, job_id="mine", duration_s=30, clock=clock, renew=False)
    # Another driver rewrote the same generation (a store that ignored its conditional create).
    other = json.loads(storage.get_bytes("lease/000000000000.json")) | {"holder_id": "other", "job_id": "other"}
    storage.put_bytes("lease/000000000000.json", json.dumps(other).encode())
    with pytest.raises(LeaseLostError, match="taken over by job other"):
        mine.renew()
    with pytest.raises(LeaseLostError):
        mine.check()


def test_a_lease_that_ran_out_with_no_rival_goes_on_as_the_next_generation(tmp_path):
    storage = open_storage(str(tmp_path / "out"))
    clock = Clock()
    lease = OutputLease.acquire(storage, job_id="paused", duration_s=30, clock=clock, renew=False)
    clock.now += 45  # paused past its expiry; nobody took the output
    assert lease.check() == pytest.approx(30)  # renewed here, before any commit
    assert (lease.record.generation, current_lease(storage).holder_id) == (1, lease.record.holder_id)
    lease.release()


def test_a_lease_that_ran_out_and_was_taken_over_is_lost_at_the_next_check(tmp_path):
    storage = open_storage(str(tmp_path / "out"))
    clock = Clock()
    paused = OutputLease.acquire(storage, job_id="paused", duration_s=30, clock=clock, renew=False)
    clock.now += 45
    successor = OutputLease.acquire(storage, job_id="successor", duration_s=30, clock=clock, renew=False)
    with pytest.raises(LeaseLostError, match="taken over by job successor"):
        paused.check()
    assert current_lease(storage).holder_id == successor.record.holder_id
    successor.release()


def test_an_expiry_counts_only_once_its_renewal_has_landed(tmp_path):
    from snapref_ray.storage.backends import StorageError

    clock = Clock()
    failing = [False]
    inner = open_storage(str(tmp_path / "out"))

    class Flaky(IgnoresConditionalCreates):
        def put_if_absent(self, key, data):
            return inner.put_if_absent(key, data)

        def put_bytes(self, key, data, content_type=None):
            if failing[0]:
                raise StorageError("the store is down")
            inner.put_bytes(key, data, content_type)

    lease = OutputLease.acquire(Flaky(inner), job_id="j", duration_s=30, clock=clock, renew=False)
    before = lease.record.expires_at
    clock.now += 10
    failing[0] = True
    with pytest.raises(StorageError):
        lease.renew()
    assert lease.record.expires_at == before  # not pushed ahead: the write never landed
    failing[0] = False
    lease.renew()
    assert lease.record.expires_at == clock.now + 30 == current_lease(inner).expires_at
    lease.release()


def test_a_store_outage_with_no_rival_is_waited_out_not_failed(tmp_path):
    from snapref_ray.storage.backends import StorageError

    clock = Clock()
    inner = open_storage(str(tmp_path / "out"))
    down_for = [3]  # listings that fail before the store answers again

    class Outage(IgnoresConditionalCreates):
        def put_if_absent(self, key, data):
            return inner.put_if_absent(key, data)

        def list(self, prefix):
            if down_for[0] > 0:
                down_for[0] -= 1
                clock.now += 20  # each failed try takes a while
                raise StorageError("connection refused")
            return inner.list(prefix)

    lease = OutputLease.acquire(inner, job_id="j", duration_s=6, clock=clock, renew=False, probe=False)
    lease = OutputLease(Outage(inner), lease.record, 6, clock=clock, sleep=lambda s: None, renew=False)
    clock.now += 10  # past its expiry, during the outage
    assert lease.check() > 0 and down_for[0] == 0  # it waited the store out and holds the output still
    assert current_lease(inner).holder_id == lease.record.holder_id


def test_a_conflict_answer_to_a_conditional_create_means_look_again(monkeypatch):
    from botocore.exceptions import ClientError

    from snapref_ray.storage.backends import S3Options, S3Storage

    class Client:
        def put_object(self, **kwargs):
            raise ClientError(
                {"Error": {"Code": "ConditionalRequestConflict"}, "ResponseMetadata": {"HTTPStatusCode": 409}},
                "PutObject",
            )

    monkeypatch.setattr(S3Storage, "client", property(lambda self: Client()))
    storage = S3Storage("s3://bucket/out", S3Options(endpoint_url="http://127.0.0.1:9"))
    assert storage.put_if_absent("lease/000000000001.json", b"{}") is False  # not an error: the caller reads again
