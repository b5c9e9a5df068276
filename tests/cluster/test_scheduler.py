"""BatchScheduler's decisions, observed through small fake actors on a real local Ray.

The fake workers implement the RenderWorker interface the scheduler uses (`info`, `pid`, `encode`
with two returns, `render`) with sleeps instead of models, and log what they were asked to do. They
are test doubles for the scheduling logic only; test_batch_job.py and test_failures.py run the real
workers, and the RefKV fetch tests below run a real RenderWorker (tiny models) against real
`ray.exceptions` instances.

Failures are injected the way they reach the code under test: a fake's method that *returns* a Ray
exception makes `ray.get` raise exactly that exception at the driver (as Ray's memory monitor's
`OutOfMemoryError` arrives), and a RefKV handle whose object is a Ray exception makes the fetching
worker's `ray.get` raise it.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray
import torch

from snapref_ray.adapter.refkv import RefKV
from snapref_ray.cluster.failures import LOST_REFKV_ERRORS
from snapref_ray.cluster.pool import PoolPlan
from snapref_ray.cluster.scheduler import BatchScheduler, RequeueBudgetExceeded, SchedulerConfig, SchedulerEvent
from snapref_ray.cluster.tasks import EncodeInfo, ItemOutcome, ReferenceTask, RenderTask, WorkerInfo
from snapref_ray.model_spec import ModelSpec
from snapref_ray.render_service.references import ReferenceInput
from snapref_ray.render_service.refkv_cache import RefKVCache
from snapref_ray.render_service.work_items import WorkItem
from snapref_ray.requests import RenderSettings

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.timeout(180)]

SETTINGS = RenderSettings(width=256, height=256, steps=2)
MiB = 2**20
# What Ray's memory monitor reports when it kills a worker (the figures are the node's memory).
RAY_OOM_MESSAGE = (
    "Task was killed due to the node running low on memory.\nMemory on the node (IP: 10.0.3.7, ID: 5e1c) where the "
    "task (actor ID: 9a1f, name=RenderWorker.__init__, pid=4242, memory used=61.2GB) was running was 118.9GB / "
    "124.8GB (0.952), which exceeds the memory usage threshold of 0.95."
)


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
        die_on_every_render: bool = False,
        ray_oom_above: int | None = None,
        lose_first_refkv: bool = False,
        poison_fails_the_batch: bool = False,
        slow_reference: tuple[str, float] | None = None,
    ) -> None:
        self.name, self.render_s, self.encode_s, self.refkv_bytes = name, render_s, encode_s, refkv_bytes
        self.die_marker = die_on_first_render  # a file path: die once, on the first render, then never again
        self.die_always = die_on_every_render  # a cluster that keeps losing this worker
        self.ray_oom_above = ray_oom_above  # batches above this many items meet Ray's memory monitor
        self.lose_refkv = lose_first_refkv  # what this worker's first encode returns is lost (ObjectLostError)
        self.poison_fails_the_batch = poison_fails_the_batch  # a poisoned item fails its whole batch, as a forward
        self.slow_reference = slow_reference  # (reference hash, seconds): renders of it take this long
        self.cache = RefKVCache(1 << 40)
        self.log: list[tuple] = []
        self.lock = threading.Lock()
        self.active = 0
        self.peak_active = 0

    def reset(self, name: str, **kwargs) -> None:
        """A fresh fake for the next test, in this process: what the constructor does with these arguments
        (once no call of the last test is still sleeping, so none of its bookkeeping lands on the new state)."""
        deadline = time.monotonic() + 30
        while self.active and time.monotonic() < deadline:
            time.sleep(0.01)
        self.__init__(name, **kwargs)

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
        info = EncodeInfo(task.reference_hash, kv.nbytes, kv.encode_seconds, self.name, encoded=not hit)
        if self.lose_refkv:  # what a reader meets when the object's node is gone
            self.lose_refkv = False
            return ray.exceptions.ObjectLostError(f"{os.getpid():028x}", None, "fake"), info
        return kv, info

    def render(self, task: RenderTask, handle) -> list[ItemOutcome]:
        if self.die_always or (self.die_marker and not Path(self.die_marker).exists()):
            if self.die_marker:
                Path(self.die_marker).touch()
            os._exit(1)
        if self.ray_oom_above is not None and len(task.items) > self.ray_oom_above:
            with self.lock:
                self.log.append(("oom", task.reference.reference_hash, len(task.items)))
            return ray.exceptions.OutOfMemoryError(RAY_OOM_MESSAGE)  # ray.get raises it at the driver
        with self.lock:
            self.active += 1
            self.peak_active = max(self.peak_active, self.active)
        try:
            source, lost = "cache", ""

            def fetch_or_encode() -> RefKV:
                nonlocal source, lost
                if handle:
                    try:
                        shared = ray.get(handle[0], timeout=30)
                    except LOST_REFKV_ERRORS as e:  # as RenderWorker does: encode it here, say so
                        lost, source = type(e).__name__, "lost"
                        return self._encode(task.reference.reference_hash)
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
            slow = self.slow_reference and self.slow_reference[0] == task.reference.reference_hash
            time.sleep(self.slow_reference[1] if slow else self.render_s)
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
            poisoned_batch = self.poison_fails_the_batch and any("poison" in i.prompt for i in task.items)
            for item in task.items:
                if poisoned_batch and "poison" not in item.prompt:
                    error = "RuntimeError: NaN in a batch with a poisoned item"
                    outcomes.append(ItemOutcome(item.item_id, error=error, stage="sample", refkv_source=source))
                elif "poison" in item.prompt:
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
                            item.item_id,
                            row={"item_id": item.item_id, "worker": self.name, "attempt": task.attempts[item.item_id]},
                            refkv_source="encoded" if lost else source,
                            refkv_lost=lost,
                        )
                    )
            return outcomes
        finally:
            with self.lock:
                self.active -= 1

    def calls(self) -> tuple[list[tuple], int]:
        return list(self.log), self.peak_active


FAKE_OPTIONS = {"max_concurrency": 4, "max_restarts": -1, "max_task_retries": 0}
# A fake made with these dies on purpose; Ray restarts it with its constructor's arguments, so it is never reused.
DYING = {"die_on_first_render", "die_on_every_render"}


@pytest.fixture(scope="module")
def idle_fakes():
    """Fake workers a test left alive, reset and reused by the next: each new one is a Ray worker
    process that imports torch (~2.5 CPU-seconds), and the scheduler sees only the handles."""
    idle: list = []
    yield idle
    for h in idle:
        ray.kill(h, no_restart=True)


@pytest.fixture
def make_workers(idle_fakes):
    """Fake workers for one test, new or reset: make_workers(n, **kwargs) -> (handles, infos)."""
    lent, started = [], []

    def make(n: int, *, options: dict | None = None, per_worker: list[dict] | None = None, **kwargs):
        opts = {**FAKE_OPTIONS, **(options or {})}
        handles, resets = [], []
        for i in range(n):
            args = {**kwargs, **(per_worker or [{}] * n)[i]}
            reusable = opts == FAKE_OPTIONS and not args.keys() & DYING
            if reusable and idle_fakes:
                handle = idle_fakes.pop()
                resets.append(handle.reset.remote(f"w{i}", **args))
            else:
                handle = FakeWorker.options(**opts).remote(f"w{i}", **args)
            (lent if reusable else started).append(handle)
            handles.append(handle)
        ray.get(resets, timeout=60)
        return handles, ray.get([h.info.remote() for h in handles], timeout=60)

    yield make
    for h in started:
        ray.kill(h, no_restart=True)
    idle_fakes.extend(lent)


def items(reference: str, n: int, *, settings: RenderSettings = SETTINGS, prompt: str = "scene") -> list[WorkItem]:
    spec = ReferenceInput((f"/refs/{reference}.png",), "single", ("reference",))
    return [
        WorkItem(f"{reference}-{i}", i + 1, spec, f"hash-{reference}", f"{prompt} {i}", i, settings, 0)
        for i in range(n)
    ]


class Recorder:
    """The scheduler's callbacks: committed ids (with repeats), their attempt numbers, failures and events."""

    def __init__(self) -> None:
        self.done: Counter[str] = Counter()
        self.attempts: dict[str, int] = {}
        self.failed: list[tuple[str, str, int]] = []
        self.events: list[SchedulerEvent] = []
        self.progress_calls = 0

    def scheduler(self, handles, infos, *, pool=None, **config) -> BatchScheduler:
        return BatchScheduler(
            handles,
            infos,
            SchedulerConfig(wait_timeout_s=0.2, **config),
            on_done=self._done,
            on_failed=lambda outcome, item, attempt: self.failed.append((item.item_id, outcome.error, attempt)),
            on_progress=self._progress,
            pool=pool,
            on_event=self.events.append,
        )

    def _done(self, outcome: ItemOutcome, item: WorkItem) -> None:
        self.done.update([item.item_id])
        self.attempts[item.item_id] = outcome.row.get("attempt", 1)

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


def test_run_is_repeatable_on_the_same_workers_and_a_reference_can_be_dropped_midway(make_workers):
    """Judging rounds run the schedule again on the same pool, and drop a reference's queued items once its quota is
    met (from `on_done`): the dropped items are neither done nor failed, and the run ends without them."""
    handles, infos = make_workers(1, render_s=0.02)
    rec = Recorder()
    scheduler = rec.scheduler(handles, infos, max_in_flight_per_worker=1, max_batch=1)
    dropped = []

    def done_then_drop(outcome: ItemOutcome, item: WorkItem) -> None:
        rec._done(outcome, item)
        if item.item_id == "A-1":  # one call out at a time: A-2..A-5 are queued, none dispatched
            dropped.append(scheduler.drop_reference("hash-A"))

    scheduler.on_done = done_then_drop
    scheduler.run(items("A", 6))
    assert dropped == [4] and rec.done == Counter(["A-0", "A-1"]) and rec.failed == []
    stats = scheduler.run(items("B", 2))  # a second round on the same workers
    assert rec.done == Counter(["A-0", "A-1", "B-0", "B-1"]) and stats.done_items == 4


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
    assert rec.failed == [] and stats.worker_failures == 1 and stats.retried_items == 0
    # The lost batch was requeued without counting an attempt, as a worker loss (its node is alive).
    assert stats.attempts_charged == 0 and set(rec.attempts.values()) == {1}
    assert {c: n for c, n in stats.requeues.items() if n} == {"worker_lost": 1}
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


# -- out of memory: Ray's memory monitor ------------------------------------------------------------------------


def test_ray_out_of_memory_halves_the_batch_without_an_attempt_and_the_cap_is_remembered(make_workers):
    handles, infos = make_workers(1, ray_oom_above=1)
    rec = Recorder()
    work = items("A", 6) + items("B", 3)  # B opens once A is done (one open reference): after the halving
    stats = rec.scheduler(handles, infos, max_in_flight_per_worker=1, max_batch=4, max_open_references=1).run(work)
    assert rec.done == Counter(i.item_id for i in work) and rec.failed == []
    assert stats.attempts_charged == 0 and set(rec.attempts.values()) == {1}
    log, _ = calls_of(handles[0])
    # A batch of 4 met the memory monitor, then its half (2); from then on batches of this shape were single
    # images, B's from its first batch on.
    assert [c for c in log if c[0] == "oom"] == [("oom", "hash-A", 4), ("oom", "hash-A", 2)]
    assert {len(c[2]) for c in log if c[0] == "render"} == {1}
    assert stats.batch_splits == 2 and stats.requeues["oom_killed"] == 4 + 2
    assert sum(stats.requeues.values()) == 6
    rows = 1 + (SETTINGS.cfg != 1.0)  # conditional and CFG's unconditional; ref_guidance unset adds no row
    assert stats.batch_limits == [
        {"width": 256, "height": 256, "rows_per_image": rows, "batch": 1, "max_batch": 4, "out_of_memory_splits": 2}
    ]


def test_an_image_that_never_fits_fails_with_its_size_device_and_memory_figures(make_workers):
    handles, infos = make_workers(1, ray_oom_above=0)  # not even one image fits
    rec = Recorder()
    work = items("A", 2)
    stats = rec.scheduler(handles, infos, max_in_flight_per_worker=1, max_batch=2, max_attempts=3).run(work)
    assert rec.done == Counter()
    assert sorted((item_id, attempt) for item_id, _, attempt in rec.failed) == [("A-0", 3), ("A-1", 3)]
    for _, error, _ in rec.failed:
        assert error.startswith(
            "out of memory on worker w0 (fake): one 256x256 image (2 row(s) per image) does not fit: Task was killed"
        )
        assert "118.9GB / 124.8GB (0.952)" in error  # the node's figures, from Ray's message
    # The pair was halved once without an attempt; then each single image was charged its 3 attempts.
    assert (stats.batch_splits, stats.requeues["oom_killed"], stats.attempts_charged) == (1, 2, 6)


# -- infrastructure failures cost no attempt, within a budget ----------------------------------------------------


@pytest.mark.slow
def test_a_cluster_that_keeps_losing_workers_ends_the_job_with_a_message(make_workers):
    # Every render kills its worker (Ray restarts it): no item can be charged, only the budget stops this.
    # One item, so a budget of one requeue: each loss is a worker process Ray starts again (~6 s of this
    # test's time here).
    handles, infos = make_workers(1, die_on_every_render=True)
    rec = Recorder()
    scheduler = rec.scheduler(
        handles, infos, max_in_flight_per_worker=1, max_batch=1, max_requeues_per_item=1, loss_classification_grace_s=0
    )
    with pytest.raises(
        RequeueBudgetExceeded, match=r"the cluster lost work 2 times \(worker_lost=2\), over the budget of 1"
    ):
        scheduler.run(items("A", 1))
    assert scheduler.stats.attempts_charged == 0 and rec.failed == [] and rec.done == Counter()


def test_a_batch_whose_forward_fails_charges_only_the_item_that_raises(make_workers):
    handles, infos = make_workers(1, poison_fails_the_batch=True)
    rec = Recorder()
    good = items("A", 3)
    poison = WorkItem("poisoned", 9, good[0].reference, good[0].reference_hash, "poison", 1, SETTINGS, 0)
    # A batch of four where one item's sampling raises: the fake fails all four, as one forward does.
    stats = rec.scheduler(handles, infos, max_in_flight_per_worker=1, max_batch=4, max_attempts=2).run(
        [good[0], poison, *good[1:]]
    )
    assert rec.done == Counter(i.item_id for i in good) and set(rec.attempts.values()) == {1}
    assert rec.failed == [("poisoned", "RuntimeError: poisoned (attempt 2)", 2)]
    assert (stats.isolated_batches, stats.attempts_charged) == (1, 2)


# -- RefKVs: one that cannot be fetched is encoded, and never handed out again ---------------------------------


def test_a_refkv_that_could_not_be_fetched_is_not_handed_out_again(make_workers):
    # w0 opens A, but what its encode returns is lost (ObjectLostError to every reader). w1 finishes B first and
    # helps with A: its fetch fails, it encodes A itself and says so. w2 finishes C later: by then the driver has
    # forgotten the lost handle and re-opened A (a new RefKV), so w2 is never sent to the lost one.
    handles, infos = make_workers(
        3, per_worker=[{"lose_first_refkv": True, "render_s": 0.1}, {"render_s": 0.3}, {"render_s": 1.5}]
    )
    rec = Recorder()
    work = items("A", 24) + items("B", 1) + items("C", 1)
    stats = rec.scheduler(handles, infos, max_in_flight_per_worker=1, max_batch=1).run(work)
    assert rec.done == Counter(i.item_id for i in work) and rec.failed == []
    assert stats.attempts_charged == 0
    renders = [c for h in handles for c in calls_of(h)[0] if c[0] == "render"]
    assert [c[3] for c in renders if c[3] == "lost"] == ["lost"]  # one reader met the lost RefKV, only one
    w2_on_a = [c for c in calls_of(handles[2])[0] if c[0] == "render" and c[1] == "hash-A"]
    assert w2_on_a, "w2 never helped with A: the situation under test did not arise"
    assert stats.requeues["refkv_lost"] == 1 and stats.refkvs_dropped == 1
    kinds = [(e.kind, e.reference_hash) for e in rec.events]
    dropped = kinds.index(("refkv_dropped", "hash-A"))
    assert ("encode_sent", "hash-A") in kinds[dropped:]


class FixedPool:
    """The `WorkerPool` interface `_scale` uses, over workers that already run: it never launches any (the pool
    is full), so what is under test is only the decision to release a worker."""

    def __init__(self, size: int) -> None:
        self.plan = PoolPlan(use_gpu=False, min_workers=size, max_workers=size)
        self.config = SimpleNamespace(output_format="files")  # what the schedule reads of the workers' config
        self.starting: dict = {}
        self.start_failures: list[str] = []

    def launch(self, count: int) -> None:
        assert count == 0, "a full pool launched workers"

    def starting_futures(self) -> list:
        return []

    def cancel_starting(self) -> int:
        return 0


@pytest.mark.slow
def test_the_worker_whose_refkv_a_helper_may_still_fetch_is_not_released(make_workers):
    # w0 (fast) opens A; w1 opens B, then helps with A, slowly (4 s a batch). When A's last queued item is taken
    # no work is unassigned and w0 goes idle while w1 still renders A: w0 encoded A's RefKV (the primary copy is
    # in its node's store), so it must stay until A is done.
    handles, infos = make_workers(
        2, per_worker=[{"render_s": 0.05}, {"render_s": 0.05, "slow_reference": ("hash-A", 4.0)}]
    )
    rec = Recorder()
    work = items("A", 16) + items("B", 1)
    stats = rec.scheduler(handles, infos, max_in_flight_per_worker=1, max_batch=1, pool=FixedPool(2)).run(work)
    assert rec.done == Counter(i.item_id for i in work)
    a_done = [n for n, e in enumerate(rec.events) if e.kind == "item_done" and e.reference_hash == "hash-A"]
    helped = [e for e in rec.events if e.kind == "render_sending" and e.worker == 1 and e.reference_hash == "hash-A"]
    assert helped, "w1 never helped with A: the situation under test did not arise"
    released_early = [
        n for n, e in enumerate(rec.events) if e.kind == "worker_released" and e.worker == 0 and n < a_done[-1]
    ]
    assert released_early == [], "the creator of A's RefKV was released while A still had work"
    assert stats.workers_released <= 1  # w1, once idle (its B done, nothing of A left to take)


# -- the real RenderWorker's fetch: each of Ray's lost-object and actor errors -> encode ----------------------


@ray.remote
class _Owner:
    """Owns objects it puts; killed, its objects' readers get OwnerDiedError; called dead, ActorDiedError."""

    def make(self) -> list:
        return [ray.put(b"x" * 200_000)]

    def ping(self) -> int:
        return 1


@ray.remote
def _never_ready(seconds: float) -> bytes:
    time.sleep(seconds)
    return b""


@ray.remote
def _raises() -> bytes:
    raise ValueError("the encode of this reference raised")


def _lost_object_hex() -> str:
    return "ab" * 14


def _killed(actor) -> None:
    """ray.kill returns before the actor is gone: wait until the driver sees it dead."""
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=10)
        except ray.exceptions.ActorDiedError:
            return
        time.sleep(0.1)
    raise TimeoutError("the killed actor still answers")


def _handle_for(case: str):
    """A RefKV handle whose `ray.get` raises the case's error: produced the real way where a local Ray can (a
    killed owner, a dead actor, a get that times out), else a real instance stored as the object's value."""
    E = ray.exceptions
    if case == "OwnerDiedError":
        owner = _Owner.remote()
        (inner,) = ray.get(owner.make.remote(), timeout=60)
        _killed(owner)
        deadline = time.monotonic() + 60  # until the driver, a borrower too, hears of the owner's death
        while time.monotonic() < deadline:
            try:
                ray.get(inner, timeout=10)
            except ray.exceptions.OwnerDiedError:
                return inner
            time.sleep(0.1)
        raise TimeoutError("the object outlived its owner")
    if case == "ActorDiedError":
        actor = _Owner.remote()
        ray.get(actor.ping.remote(), timeout=60)
        _killed(actor)
        return actor.ping.remote()
    if case == "GetTimeoutError":
        return _never_ready.remote(30)
    if case == "RayTaskError":
        failed = _raises.remote()
        ray.wait([failed], timeout=60)  # finished (failed) before the worker reads it: no fetch timeout here
        return failed
    stored = {
        "ObjectLostError": lambda: E.ObjectLostError(_lost_object_hex(), None, ""),
        "ObjectFetchTimedOutError": lambda: E.ObjectFetchTimedOutError(_lost_object_hex(), None, ""),
        "ObjectFreedError": lambda: E.ObjectFreedError(_lost_object_hex(), None, ""),
        "ObjectReconstructionFailedError": lambda: E.ObjectReconstructionFailedError(_lost_object_hex()),
        "ReferenceCountingAssertionError": lambda: E.ReferenceCountingAssertionError(_lost_object_hex(), None, ""),
        "ActorUnavailableError": lambda: E.ActorUnavailableError("the actor is restarting", None),
        "NodeDiedError": lambda: E.NodeDiedError("the node of the object's creator died"),
        "WorkerCrashedError": lambda: E.WorkerCrashedError(),
        "OutOfMemoryError": lambda: E.OutOfMemoryError("the reconstruction was killed by the memory monitor"),
    }
    return ray.put(stored[case]())


LOST_CASES = [
    "ObjectLostError",
    "OwnerDiedError",
    "ObjectFetchTimedOutError",
    "ObjectFreedError",
    "ObjectReconstructionFailedError",
    "ReferenceCountingAssertionError",
    "ActorDiedError",
    "ActorUnavailableError",
    "NodeDiedError",
    "WorkerCrashedError",
    "OutOfMemoryError",
    "GetTimeoutError",
]


@pytest.fixture(scope="module")
def real_worker(ray_cluster, tiny_models, tmp_path_factory):
    """One real RenderWorker (tiny models on the CPU) and a reference image it can encode."""
    from snapref_ray.cluster.worker import RenderWorker, WorkerConfig
    from tests.cluster.conftest import make_reference_png

    folder = tmp_path_factory.mktemp("fetch")
    reference = make_reference_png(folder / "ref.png", (200, 60, 90))
    config = WorkerConfig(
        model=ModelSpec(models_dir=str(tiny_models), device="cpu"),
        warmup=False,
        output_uri=str(folder / "out"),
        output_threads=0,
        refkv_fetch_timeout_s=1.5,
    )
    worker = ray.remote(RenderWorker).options(num_cpus=1, max_concurrency=2).remote(config, None)
    ray.get(worker.info.remote(), timeout=120)
    yield worker, str(reference)
    ray.kill(worker, no_restart=True)


def _fetch_render(worker, reference: str, case: str) -> ItemOutcome:
    # The caption makes a reference key of its own per case: nothing is in the worker's device cache yet.
    settings = RenderSettings(width=256, height=256, steps=2, cfg=1.0, sampler="euler", ref_caption=case)
    item = WorkItem(
        f"fetch-{case}",
        1,
        ReferenceInput((reference,), "single", ("reference",)),
        "hash-fetch",
        "1girl",
        1,
        settings,
        0,
    )
    task = RenderTask(0, ReferenceTask.for_item(item), (item,), {item.item_id: 1})
    (outcome,) = ray.get(worker.render.remote(task, [_handle_for(case)]), timeout=120)
    return outcome


@pytest.mark.slow
@pytest.mark.parametrize("case", LOST_CASES)
def test_a_refkv_fetch_that_finds_the_object_gone_encodes_the_reference(real_worker, case):
    worker, reference = real_worker
    outcome = _fetch_render(worker, reference, case)
    assert outcome.error is None, outcome.error
    assert (outcome.refkv_source, outcome.refkv_lost) == ("encoded", case)
    assert outcome.row["item_id"] == f"fetch-{case}"


@pytest.mark.slow
def test_a_refkv_whose_encode_raised_fails_its_items_instead(real_worker):
    # Not a lost object: the task that made it raised. Encoding here would raise the same; the item's error says so.
    worker, reference = real_worker
    outcome = _fetch_render(worker, reference, "RayTaskError")
    assert (outcome.row, outcome.stage, outcome.refkv_lost) == (None, "encode", "")
    assert "the encode of this reference raised" in outcome.error
