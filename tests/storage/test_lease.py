"""One driver per output: the lease on a local folder and on S3 (a real SeaweedFS on 127.0.0.1).

Drivers are played by threads and, where a driver must die or stall for real, by a subprocess that
holds a lease and is SIGKILLed or SIGSTOPped.
"""

from __future__ import annotations

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
    assert time.time() >= released_at[0]  # it waited for the release, not for the 30 s expiry
    assert waiter.record.started_at >= released_at[0]
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
