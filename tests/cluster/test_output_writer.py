"""OutputWriter: stores run on its threads (overlapping the caller) or inline, results and errors alike."""

from __future__ import annotations

import threading

import pytest

from snapref_ray.cluster.output_writer import OutputWriter


def test_pool_runs_stores_off_the_calling_thread_and_at_once():
    writer = OutputWriter(3)
    started, release = threading.Barrier(3, timeout=10), threading.Event()
    caller = threading.get_ident()

    def store(i):
        started.wait()  # all three must be running together to pass the barrier
        release.wait(10)
        return i, threading.get_ident()

    futures = writer.submit_all([lambda i=i: store(i) for i in range(3)])
    assert not any(f.done() for f in futures)  # submit_all returned while the stores still run
    release.set()
    results = [f.result(timeout=10) for f in futures]
    assert [i for i, _ in results] == [0, 1, 2]
    assert all(ident != caller for _, ident in results)
    writer.close()


def test_inline_runs_in_the_caller_and_delivers_errors_through_the_future():
    writer = OutputWriter(0)
    caller = threading.get_ident()

    def fail():
        raise OSError("upload refused")

    ok, bad = writer.submit_all([threading.get_ident, fail])
    assert ok.done() and ok.result() == caller and not writer.overlaps
    with pytest.raises(OSError, match="upload refused"):
        bad.result()
    with pytest.raises(ValueError, match="output_threads must be >= 0"):
        OutputWriter(-1)
