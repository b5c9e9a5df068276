"""A whole node lost mid-job costs no item, on a real multi-node cluster, and out of memory splits a batch
there.

Ray's autoscaler with its fake provider (benchmarks/fake_cluster.py): a head and up to three 1-CPU `GPU: 1` nodes,
each a real raylet with its own object store; the job's GPU workers run the tiny models on the CPU. A node is
lost by SIGKILL to its raylet (its workers go with it), at a moment picked through the scheduler's event seam
(`run_job(on_event=...)`), never by sleeping: before any image, mid-batch, as a RefKV fetch from it starts,
and the moment a node loss was first reported at — the node of a worker whose reference other workers still
need, once two images are written.

The references are 320x448 (the example references' size), so a RefKV is ~0.6 MB: above Ray's 100 KiB inline
limit, it lives in the object store of the node that encoded it, and is lost with that node. One cluster serves
the module (started once); every job is independent of the others (its own output, its own workers).
"""

from __future__ import annotations

import io
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from PIL import Image

from benchmarks.fake_cluster import FakeCluster
from snapref_ray.cluster.scheduler import SchedulerEvent
from snapref_ray.jobs.generate_dataset import run_job
from snapref_ray.storage.backends import open_storage
from snapref_ray.storage.metadata import read_errors_table, read_item_ids, read_metadata_table
from tests.cluster.conftest import expected_item_ids, job_spec, make_reference_png, write_manifest
from tests.cluster.renderer_doubles import OutOfMemoryAbove

# ray_order: its tests kill nodes, so it runs after the fake-cluster modules that want a warm cluster.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.ray_order(2)]

REFERENCE_SIZE = (320, 448)


@pytest.fixture(scope="module")
def cluster(fake_cluster_module) -> FakeCluster:
    """The session's fake cluster (tests/conftest.py); every test's job is its own, and kills at most one node."""
    return fake_cluster_module


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> list[Path]:
    folder = tmp_path_factory.mktemp("node-loss-refs")
    colours = [(200, 40, 40), (40, 160, 60), (40, 70, 200)]
    return [make_reference_png(folder / f"ref{i}.png", c, size=REFERENCE_SIZE) for i, c in enumerate(colours)]


def _manifest(folder: Path, references: list[Path], prompts: tuple[int, ...]) -> Path:
    rows = [
        {"reference": str(ref), "prompt": f"1girl, scene {p}", "seed": 100 * r + p}
        for r, (ref, count) in enumerate(zip(references, prompts))
        for p in range(count)
    ]
    return write_manifest(folder / "manifest.csv", rows)


def _spec(tmp_path: Path, references, models, cluster: FakeCluster, *, prompts=(8, 8, 8), size=256, **shape):
    return job_spec(
        _manifest(tmp_path, references, prompts),
        models,
        str(tmp_path / "out"),
        defaults={"width": size, "height": size, "steps": 2},
        model={"device": "auto"},  # on a cluster: GPU workers, one per fake GPU node
        cluster={
            "address": cluster.address,
            "num_workers": None,
            "min_workers": 1,
            "max_workers": 3,
            "max_batch": 4,
            "max_in_flight_per_worker": 2,
            "refkv_fetch_timeout_s": 5.0,  # a fetch from a dead node gives up sooner than the default
            **shape,
        },
    )


@dataclass
class NodeKiller:
    """Watches the schedule and SIGKILLs one node's raylet the first time `choose(event, self)` names a node."""

    cluster: FakeCluster
    choose: object  # (SchedulerEvent, NodeKiller) -> node id | None
    events: list[SchedulerEvent] = field(default_factory=list)
    joined: list[str] = field(default_factory=list)  # node of each worker, in the order they joined
    encoders: list[str] = field(default_factory=list)  # nodes whose worker opened a reference, in order
    done: int = 0
    killed: str | None = None
    killed_at_event: int | None = None
    killed_at: float | None = None

    def __call__(self, event: SchedulerEvent) -> None:
        self.events.append(event)
        if event.kind == "worker_joined":
            self.joined.append(event.node_id)
        elif event.kind == "encode_sent":
            self.encoders.append(event.node_id)
        elif event.kind == "item_done":
            self.done += 1
        if self.killed is None:
            node = self.choose(event, self)
            if node is not None:
                self.cluster.kill_node(node)
                self.killed, self.killed_at_event, self.killed_at = node, len(self.events) - 1, time.time()


def after_two_images_the_last_joined_encoder(event: SchedulerEvent, k: NodeKiller) -> str | None:
    """The reported failure: once two images are written, the node of the last-added worker that encoded a
    reference (its prompts are still to be rendered: at most a batch of 4 of 24 is done)."""
    if event.kind == "item_done" and k.done >= 2:
        return next((n for n in reversed(k.joined) if n in k.encoders), None)
    return None


def before_any_image(event: SchedulerEvent, k: NodeKiller) -> str | None:
    """The first worker to open a reference, as its encode and first batch are sent: nothing is written yet."""
    return event.node_id if event.kind == "encode_sent" and k.done == 0 else None


def mid_batch(event: SchedulerEvent, k: NodeKiller) -> str | None:
    """A worker's first RefKV is ready: the batch sent with its encode is sampling now."""
    return event.node_id if event.kind == "refkv_ready" else None


def as_a_fetch_from_it_starts(event: SchedulerEvent, k: NodeKiller) -> str | None:
    """A worker is about to be handed a RefKV held on another node: that node dies as the fetch starts (the event
    comes before the call, so no byte of it can have moved yet)."""
    if event.kind == "render_sending" and event.refkv_node and event.refkv_node != event.node_id:
        return event.refkv_node
    return None


def _run(spec, cluster: FakeCluster, choose) -> tuple[dict, NodeKiller]:
    killer = NodeKiller(cluster, choose)
    summary = run_job(spec, progress=False, write_gallery=False, on_event=killer)
    assert killer.killed is not None, "the moment to kill a node never came: nothing was tested"
    return summary, killer


def _every_item_once(spec, summary: dict, items: int = 24) -> list[dict]:
    """`items`/`items` committed exactly once, every image decodes, nothing in errors/, and no attempt was counted."""
    storage = open_storage(spec.output.uri)
    ids = read_item_ids(storage)
    assert len(ids) == len(set(ids)), f"duplicated items: {[i for i, n in Counter(ids).items() if n > 1]}"
    assert set(ids) == expected_item_ids(spec) and len(ids) == items
    rows = read_metadata_table(storage).to_pylist()
    for row in rows:
        Image.open(io.BytesIO(storage.get_bytes(row["image_key"]))).load()
    assert read_errors_table(storage).num_rows == 0
    # What generate_dataset's main() turns into exit status 0.
    assert (summary.images_this_run, summary.failed_items) == (items, 0)
    assert summary.attempts.charged == 0 and {r["attempt"] for r in rows} == {1}
    return rows


def _nothing_sent_to_the_dead_node(killer: NodeKiller, rows: list[dict]) -> None:
    """Once the driver knew of the loss (a call of the dead node's worker came back failed, or a fetch from it
    did), no worker was sent to fetch a RefKV from that node; and no image after the kill came from it."""

    def tells_of_the_loss(e: SchedulerEvent) -> bool:
        return (e.kind == "requeued" and e.node_id == killer.killed) or (
            e.kind == "refkv_dropped" and e.refkv_node == killer.killed
        )

    after_kill = list(enumerate(killer.events))[killer.killed_at_event + 1 :]
    noticed = next((n for n, e in after_kill if tells_of_the_loss(e)), None)
    assert noticed is not None, "the driver never learnt of the lost node"
    sent_there = [e for e in killer.events[noticed:] if e.kind == "render_sending" and e.refkv_node == killer.killed]
    assert sent_there == [], sent_there
    assert killer.killed not in killer.cluster.raylet_pids()  # its raylet is gone for good
    assert not [r for r in rows if r["node_id"] == killer.killed and r["finished_at"] > killer.killed_at]


def test_three_workers_at_the_default_size_fit_one_machine_without_a_memory_kill(
    cluster, references, tiny_models, tmp_path
):
    """Three workers on the fake cluster's nodes (one 24 GB machine in all), the default 1024x1024 and
    max_batch 4. Their batches' VAE decodes once took ~2.3 GB per image and Ray's memory monitor killed them;
    now every item lands once, no worker is killed, and each worker reports the batch its measured fit chose.
    All three start at once (min_workers 3) and get a reference with a full batch of prompts each: the
    three batches render side by side, which is the memory this is about.
    First in the module: a node a later test kills lingers in the autoscaler's books for about a minute,
    counting against the three."""
    spec = _spec(tmp_path, references, tiny_models, cluster, prompts=(4, 4, 4), size=1024, max_batch=4, min_workers=3)
    summary = run_job(spec, progress=False, write_gallery=False)
    rows = _every_item_once(spec, summary, items=12)
    assert summary.requeues["oom_killed"] == 0 and summary.peak_workers == 3, summary.requeues
    assert summary.memory_per_worker["bytes"] > 0  # each asked Ray for memory
    fits = [f for f in summary.memory_fit if (f["width"], f["height"]) == (1024, 1024)]
    assert fits and all(f["image_peak_bytes"] > 0 and f["batch"] >= 1 for f in fits)
    assert max(r["forward_batch"] for r in rows) > 1  # batches, not single images


def test_node_of_a_worker_whose_reference_is_still_needed_killed_after_two_images(
    cluster, references, tiny_models, tmp_path
):
    # As reported: 3 references x 8 prompts at 512x512, max_workers 3 (and the default max_batch of 4).
    spec = _spec(tmp_path, references, tiny_models, cluster, size=512)
    summary, killer = _run(spec, cluster, after_two_images_the_last_joined_encoder)
    rows = _every_item_once(spec, summary)
    _nothing_sent_to_the_dead_node(killer, rows)
    # The dead node's batches came back without an attempt, counted as a node loss; its RefKV was forgotten.
    assert summary.requeues["node_lost"] >= 1 and summary.requeues["worker_lost"] == 0, summary.requeues
    assert summary.scheduler["refkvs_dropped"] >= 1


@pytest.mark.parametrize("choose", [before_any_image, mid_batch], ids=lambda f: f.__name__)
def test_node_killed_at_a_moment_of_the_job_loses_and_duplicates_nothing(
    cluster, references, tiny_models, tmp_path, choose
):
    spec = _spec(tmp_path, references, tiny_models, cluster)
    summary, killer = _run(spec, cluster, choose)
    rows = _every_item_once(spec, summary)
    _nothing_sent_to_the_dead_node(killer, rows)
    assert summary.requeues["node_lost"] >= 1 and summary.requeues["worker_lost"] == 0, summary.requeues


def test_node_killed_as_a_refkv_fetch_from_it_starts(cluster, references, tiny_models, tmp_path):
    # 16 prompts of the first reference and 4 of each other, two workers from the start: the one with the small
    # references finishes them first and helps with the big one, fetching its RefKV from the other node.
    spec = _spec(tmp_path, references, tiny_models, cluster, prompts=(16, 4, 4), max_batch=1, min_workers=2)
    summary, killer = _run(spec, cluster, as_a_fetch_from_it_starts)
    rows = _every_item_once(spec, summary)
    _nothing_sent_to_the_dead_node(killer, rows)
    # The fetching worker could not have the RefKV (lost, or not in 5 s) and encoded it itself.
    assert summary.requeues["refkv_lost"] >= 1, summary.requeues


def test_out_of_memory_on_the_nodes_splits_batches_and_remembers_the_size(cluster, references, tiny_models, tmp_path):
    # The workers' renderer runs out of memory above one 256x256 image per forward (a torch.OutOfMemoryError).
    spec = _spec(tmp_path, references, tiny_models, cluster)
    summary = run_job(spec, progress=False, write_gallery=False, renderer_factory=OutOfMemoryAbove(((256, 256, 1),)))
    rows = _every_item_once(spec, summary)
    assert {r["forward_batch"] for r in rows} == {1}
    # Each worker's render service halved its batches of 4 (4 -> 2 -> 1) and kept the cap for the size, so no
    # render call failed and the driver had nothing to requeue.
    fits = [f for f in summary.memory_fit if (f["width"], f["height"]) == (256, 256)]
    assert fits and {f["out_of_memory_cap"] for f in fits} == {1} and {f["batch"] for f in fits} == {1}
    assert summary.requeues["device_oom"] == 0 and summary.attempts.charged == 0, summary
