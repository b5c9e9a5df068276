"""BatchScheduler's decisions, observed through small fake actors on a real local Ray.

The fake workers implement the RenderWorker interface the scheduler uses (`info`, `pid`, `encode`
with two returns, `render`) with sleeps instead of models, and log what they were asked to do. They
are test doubles for the scheduling logic only; test_batch_job.py and test_failures.py run the real
workers.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import ray
import torch

from snapref_ray.adapter.refkv import RefKV
from snapref_ray.cluster.scheduler import BatchScheduler, SchedulerConfig
from snapref_ray.cluster.tasks import EncodeInfo, ItemOutcome, RenderTask, WorkerInfo
from snapref_ray.requests import RenderSettings
from snapref_ray.service.references import ReferenceInput
from snapref_ray.service.refkv_cache import RefKVCache
from snapref_ray.service.work_items import WorkItem

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.timeout(180)]

SETTINGS = RenderSettings(width=256, height=256, steps=2)
MiB = 2**20


@ray.remote
class FakeWorker:
    """Sleeps for the GPU; keeps a device LRU like RenderWorker; logs every call it runs."""

    def __init__(
        self,
        name: str,
        render_s: float = 0.05,
        encode_s: float = 0.02,
        refkv_bytes: int = 64 * 1024,
        die_on_first_render: str | None = None,
    ) -> None:
        self.name, self.render_s, self.encode_s, self.refkv_bytes = name, render_s, encode_s, refkv_bytes
        self.die_marker = die_on_first_render  # a file path: die once, on the first render, then never again
        self.cache = RefKVCache(1 << 40)
        self.log: list[tuple] = []
        self.lock = threading.Lock()
        self.active = 0
        self.peak_active = 0

    def info(self) -> WorkerInfo:
        return WorkerInfo(self.name, ray.get_runtime_context().get_node_id(), "fake", os.getpid(), 0.0)

    def pid(self) -> int:
        return os.getpid()

    def _encode(self, reference_hash: str) -> RefKV:
        time.sleep(self.encode_s)
        with self.lock:
            self.log.append(("stream", reference_hash))
        tokens = self.refkv_bytes // (2 * 64 * 4)
        return RefKV(
            torch.full((1, 2, 1, tokens, 64), float(len(self.log))),
            ((1, 1, 1),),
            ((0, 0, 0),),
            (1, 16, 16),
            "fake-adapter",
            reference_hash,
            self.encode_s,
        )

    def encode(self, task):
        kv, hit = self.cache.get_or_create(task.key, lambda: self._encode(task.reference_hash))
        with self.lock:
            self.log.append(("encode", task.reference_hash))
        return kv, EncodeInfo(task.reference_hash, kv.nbytes, kv.encode_seconds, self.name, encoded=not hit)

    def render(self, task: RenderTask, handle) -> list[ItemOutcome]:
        if self.die_marker and not Path(self.die_marker).exists():
            Path(self.die_marker).touch()
            os._exit(1)
        with self.lock:
            self.active += 1
            self.peak_active = max(self.peak_active, self.active)
        try:
            source = "cache"

            def fetch_or_encode() -> RefKV:
                nonlocal source
                if handle:
                    shared = ray.get(handle[0], timeout=30)
                    assert shared.reference_id == task.reference.reference_hash
                    source = "object_store"
                    # A private copy, as RenderWorker keeps on CPU: the store's copy is not pinned.
                    return RefKV(
                        shared.kv_N2HLD.clone(),
                        shared.grids,
                        shared.offsets,
                        shared.target_grid,
                        shared.adapter_id,
                        shared.reference_id,
                        shared.encode_seconds,
                    )
                source = "encoded"
                return self._encode(task.reference.reference_hash)

            self.cache.get_or_create(task.reference.key, fetch_or_encode)
            time.sleep(self.render_s)
            with self.lock:
                self.log.append(
                    (
                        "render",
                        task.reference.reference_hash,
                        tuple(i.item_id for i in task.items),
                        source,
                        tuple(i.settings.steps for i in task.items),
                    )
                )
            outcomes = []
            for item in task.items:
                if "poison" in item.prompt:
                    attempt = task.attempts[item.item_id]
                    outcomes.append(
                        ItemOutcome(
                            item.item_id,
                            error=f"RuntimeError: poisoned (attempt {attempt})",
                            stage="sample",
                            refkv_source=source,
                        )
                    )
                else:
                    outcomes.append(
                        ItemOutcome(
                            item.item_id, row={"item_id": item.item_id, "worker": self.name}, refkv_source=source
                        )
                    )
            return outcomes
        finally:
            with self.lock:
                self.active -= 1

    def calls(self) -> tuple[list[tuple], int]:
        return list(self.log), self.peak_active


@pytest.fixture
def make_workers():
    """Start fake workers (killed after the test): make_workers(n, **kwargs) -> (handles, infos)."""
    started = []

    def make(n: int, *, options: dict | None = None, per_worker: list[dict] | None = None, **kwargs):
        opts = {"max_concurrency": 4, "max_restarts": -1, "max_task_retries": 0, **(options or {})}
        handles = [
            FakeWorker.options(**opts).remote(f"w{i}", **kwargs, **((per_worker or [{}] * n)[i])) for i in range(n)
        ]
        started.extend(handles)
        return handles, ray.get([h.info.remote() for h in handles], timeout=60)

    yield make
    for h in started:
        ray.kill(h, no_restart=True)


def items(reference: str, n: int, *, settings: RenderSettings = SETTINGS, prompt: str = "scene") -> list[WorkItem]:
    spec = ReferenceInput((f"/refs/{reference}.png",), "single", ("reference",))
    return [
        WorkItem(f"{reference}-{i}", i + 1, spec, f"hash-{reference}", f"{prompt} {i}", i, settings, 0)
        for i in range(n)
    ]


class Recorder:
    """The scheduler's callbacks: committed ids (with repeats) and failures."""

    def __init__(self) -> None:
        self.done: Counter[str] = Counter()
        self.failed: list[tuple[str, str, int]] = []
        self.progress_calls = 0

    def scheduler(self, handles, infos, **config) -> BatchScheduler:
        return BatchScheduler(
            handles,
            infos,
            SchedulerConfig(wait_timeout_s=0.2, **config),
            on_done=lambda outcome, item: self.done.update([item.item_id]),
            on_failed=lambda outcome, item, attempt: self.failed.append((item.item_id, outcome.error, attempt)),
            on_progress=self._progress,
        )

    def _progress(self, n: int) -> None:
        self.progress_calls += 1


def calls_of(handle) -> tuple[list[tuple], int]:
    return ray.get(handle.calls.remote(), timeout=30)


@pytest.mark.slow
def test_a_worker_gets_the_prompts_of_the_reference_it_holds(make_workers):
    handles, infos = make_workers(2, render_s=0.1)
    rec = Recorder()
    scheduler = rec.scheduler(handles, infos, max_in_flight_per_worker=1, max_batch=1)
    work = items("A", 6) + items("B", 2)
    stats = scheduler.run(work)
    assert rec.done == Counter(i.item_id for i in work)
    (log0, _), (log1, _) = calls_of(handles[0]), calls_of(handles[1])
    # Each reference was opened (encoded) once, by the worker that samples it first.
    assert [c for c in log0 if c[0] in ("encode", "stream")] == [("stream", "hash-A"), ("encode", "hash-A")]
    assert [c for c in log1 if c[0] in ("encode", "stream")] == [("stream", "hash-B"), ("encode", "hash-B")]
    assert dict(scheduler.encodes_by_reference) == {"hash-A": 1, "hash-B": 1}
    renders0 = [c for c in log0 if c[0] == "render"]
    renders1 = [c for c in log1 if c[0] == "render"]
    # w0 holds A and gets only A; w1 works through B (which it holds) first, then helps with A,
    # reading A's RefKV from the object store once and from its own cache after that.
    assert {c[1] for c in renders0} == {"hash-A"}
    assert [c[1] for c in renders1[:2]] == ["hash-B", "hash-B"]
    assert len(renders1) > 2 and {c[1] for c in renders1[2:]} == {"hash-A"}
    assert [c[3] for c in renders1[2:]] == ["object_store"] + ["cache"] * (len(renders1) - 3)
    assert (stats.encodes_requested, stats.fetches, stats.local_encodes, stats.reference_encodes) == (2, 1, 0, 2)


@pytest.mark.slow
@pytest.mark.parametrize("in_flight", [1, 2, 3])
def test_in_flight_calls_per_worker_are_bounded(make_workers, in_flight):
    handles, infos = make_workers(2, render_s=0.1)
    rec = Recorder()
    stats = rec.scheduler(handles, infos, max_in_flight_per_worker=in_flight, max_batch=1).run(items("A", 16))
    assert stats.done_items == 16
    # The fake actors run up to 4 calls at once, so their peak is what the scheduler sent.
    assert [calls_of(h)[1] for h in handles] == [in_flight, in_flight]


def _store_bytes_used() -> int:
    """Bytes in the local object store (what `ray memory --stats-only` reports as plasma usage)."""
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    reply = get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address))
    return int(reply.store_stats.object_store_bytes_used)


@pytest.mark.slow
def test_object_store_holds_only_the_open_references(make_workers):
    size = 4 * MiB
    handles, infos = make_workers(2, render_s=0.25, refkv_bytes=size)
    rec = Recorder()
    scheduler = rec.scheduler(handles, infos, max_in_flight_per_worker=1, max_batch=1, max_open_references=2)
    assert _store_bytes_used() < MiB
    peak = {"store": 0, "open": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak["store"] = max(peak["store"], _store_bytes_used())
            peak["open"] = max(peak["open"], len(scheduler.open_object_refs()))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        stats = scheduler.run([i for ref in "ABCDEF" for i in items(ref, 8)])
    finally:
        stop.set()
        sampler.join(timeout=10)
    assert stats.done_items == 48 and stats.encodes_requested == 6
    # The driver never held more than two RefKVs...
    assert stats.peak_open_references == peak["open"] == 2
    assert scheduler.open_object_refs() == []
    # ...and the store held the open two, plus at most the two closed before them: the raylet frees
    # released objects in batches, up to a second later (each pair of references here lasts ~2 s).
    # Keeping every RefKV until the end would reach 6 x 4 MiB.
    assert 2 * size <= peak["store"] <= 4 * size + MiB
    deadline = time.monotonic() + 20
    while _store_bytes_used() >= MiB and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _store_bytes_used() < MiB  # every RefKV was dropped once its prompts were done


def test_batches_hold_only_items_with_equal_settings(make_workers):
    handles, infos = make_workers(1)
    other = SETTINGS.model_copy(update={"steps": 3})
    work = [item for pair in zip(items("A", 4), items("A", 3, settings=other, prompt="other")) for item in pair]
    work.append(items("A", 4)[3])  # 7 items: steps 2, 3, 2, 3, 2, 3, 2
    work = [
        WorkItem(f"i{n}", n, w.reference, w.reference_hash, w.prompt, w.seed, w.settings, 0) for n, w in enumerate(work)
    ]
    rec = Recorder()
    rec.scheduler(handles, infos, max_in_flight_per_worker=1, max_batch=3).run(work)
    renders = [c for c in calls_of(handles[0])[0] if c[0] == "render"]
    assert [(c[2], c[4]) for c in renders] == [
        (("i0", "i2", "i4"), (2, 2, 2)),
        (("i1", "i3", "i5"), (3, 3, 3)),
        (("i6",), (2,)),
    ]


def test_a_poison_item_fails_after_max_attempts_with_its_last_error(make_workers):
    handles, infos = make_workers(2)
    rec = Recorder()
    good = items("A", 3)
    work = good + [WorkItem("poisoned", 9, good[0].reference, good[0].reference_hash, "poison", 1, SETTINGS, 0)]
    stats = rec.scheduler(handles, infos, max_attempts=3, max_batch=1).run(work)
    assert rec.done == Counter({"A-0": 1, "A-1": 1, "A-2": 1})
    assert rec.failed == [("poisoned", "RuntimeError: poisoned (attempt 3)", 3)]
    assert (stats.failed_items, stats.retried_items, stats.done_items) == (1, 2, 3)


@pytest.mark.slow
def test_a_dead_workers_batch_is_requeued_and_the_worker_probed(make_workers, tmp_path):
    # max_task_retries=0: Ray does not re-run the call, the scheduler sees the death itself.
    handles, infos = make_workers(2, render_s=0.1, per_worker=[{}, {"die_on_first_render": str(tmp_path / "w1-died")}])
    rec = Recorder()
    scheduler = rec.scheduler(handles, infos, max_in_flight_per_worker=1, max_batch=1)
    work = items("A", 12)
    stats = scheduler.run(work)
    assert (tmp_path / "w1-died").exists()
    assert rec.done == Counter(i.item_id for i in work)  # every item once, none lost
    assert rec.failed == [] and stats.worker_failures == 1 and stats.retried_items == 1
    assert _pid_once_back(handles[1]) != infos[1].pid  # Ray restarted it
    # The reference was encoded once: the batch was requeued, not the RefKV lost (driver-owned).
    assert dict(scheduler.encodes_by_reference) == {"hash-A": 1}


def _pid_once_back(handle, timeout_s: float = 60.0) -> int:
    """The actor's pid, waiting while it restarts (without task retries a call fails meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(handle.pid.remote(), timeout=timeout_s)
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.mark.slow
def test_a_worker_that_never_comes_back_is_retired(make_workers, tmp_path):
    handles, infos = make_workers(
        2,
        render_s=0.3,
        options={"max_restarts": 0},
        per_worker=[{}, {"die_on_first_render": str(tmp_path / "w1-died")}],
    )
    rec = Recorder()
    work = items("A", 10)  # ~3 s on the surviving worker: time for the probes to find w1 dead
    stats = rec.scheduler(handles, infos, max_in_flight_per_worker=1, max_batch=1, max_probe_failures=2).run(work)
    assert rec.done == Counter(i.item_id for i in work)
    assert (stats.worker_failures, stats.retired_workers) == (1, 1)


def test_the_job_stops_when_every_worker_is_gone(make_workers, tmp_path):
    handles, infos = make_workers(1, options={"max_restarts": 0}, die_on_first_render=str(tmp_path / "died"))
    rec = Recorder()
    with pytest.raises(RuntimeError, match=r"every worker died for good \(1 retired\); 3 item\(s\) not rendered"):
        rec.scheduler(handles, infos, max_probe_failures=2, max_batch=1, max_attempts=5).run(items("A", 3))
