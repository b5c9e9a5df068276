"""Jobs on one output (run_job, tiny models, the session's local Ray), 6 items each.

Two real drivers started together on one output, a local folder and S3: the output's lease lets one render
while the other waits, then finds everything committed; a driver that does not wait refuses with one line
naming the holder. Every item is rendered and listed once. And a job with ``output.format: webdataset``:
every item in exactly one committed shard, read back by the `webdataset` library.
"""

from __future__ import annotations

import csv
import json
import threading
import uuid

import pyarrow.parquet as pq
import pytest

from snapref_ray.jobs.generate_dataset import run_job
from snapref_ray.storage.backends import open_storage
from snapref_ray.storage.lease import LeaseHeldError, current_lease
from snapref_ray.storage.metadata import read_item_ids, read_metadata_table
from tests.cluster.conftest import expected_item_ids, job_spec

pytestmark = [pytest.mark.usefixtures("ray_cluster_s3"), pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def six_items(job_inputs, tmp_path_factory):
    """A manifest of 6 items: the first two references of the job inputs, 3 prompts each."""
    with open(job_inputs.good_manifest, newline="") as f:
        rows = list(csv.DictReader(f))[:6]
    path = job_inputs.folder / "six.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def _output(kind: str, s3_server, tmp_path) -> tuple[str, dict]:
    if kind == "local":
        return str(tmp_path / "out"), {}
    uri = f"s3://{s3_server.bucket}/two-drivers-{uuid.uuid4().hex[:8]}"
    return uri, {"s3": {"endpoint_url": s3_server.endpoint_url}}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["local", "s3"])
def test_two_drivers_started_together_render_every_item_once(kind, six_items, tiny_models, s3_server, tmp_path):
    uri, s3 = _output(kind, s3_server, tmp_path)
    one = {"num_workers": 1}
    waiting = job_spec(six_items, tiny_models, uri, cluster=one, output={"lease_wait_seconds": 240, **s3})
    impatient = job_spec(six_items, tiny_models, uri, cluster={"num_workers": 1}, output=s3)
    barrier = threading.Barrier(2)
    summaries: list[dict] = []
    refusals: list[str] = []
    failures: list[BaseException] = []

    def third_driver_once(_n: int) -> None:
        # While one driver renders, a third one that does not wait is refused.
        if not refusals:
            try:
                run_job(impatient, progress=False, write_gallery=False)
                refusals.append("not refused")
            except LeaseHeldError as e:
                refusals.append(str(e))

    def driver() -> None:
        barrier.wait()
        try:
            summaries.append(run_job(waiting, progress=False, write_gallery=False, on_progress=third_driver_once))
        except BaseException as e:
            failures.append(e)

    threads = [threading.Thread(target=driver) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    storage = open_storage(uri, waiting.s3_options())
    ids = read_item_ids(storage)  # every committed row, duplicates included
    assert len(ids) == 6
    assert set(ids) == expected_item_ids(waiting)
    assert sorted(s.images_this_run for s in summaries) == [0, 6]
    assert sorted(s.skipped_already_done for s in summaries) == [0, 6]
    assert len(refusals) == 1 and "\n" not in refusals[0]
    assert refusals[0].startswith(f"output {storage.uri} is in use by job ")
    assert "its lease expires at " in refusals[0]
    assert current_lease(storage).released  # the last driver let go of it


def test_the_cli_refuses_a_held_output_with_one_line(six_items, tiny_models, tmp_path, capsys):
    import yaml

    from snapref_ray import cli
    from snapref_ray.storage.lease import OutputLease

    out = tmp_path / "out"
    spec = job_spec(six_items, tiny_models, str(out), cluster={"num_workers": 1})
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec.model_dump(mode="json", exclude_none=True)))
    holder = OutputLease.acquire(open_storage(str(out)), job_id="raysubmit_first", duration_s=60)
    try:
        status = cli.main(["render", str(spec_path), "--no-progress"])
    finally:
        holder.release()
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert len(err) == 1 and err[0].startswith(f"error: output {out} is in use by job raysubmit_first (host ")
    assert "--wait-for-lease" in err[0]
    assert read_item_ids(open_storage(str(out))) == []


@pytest.mark.slow
def test_a_webdataset_job_puts_every_item_in_one_committed_shard(six_items, tiny_models, tmp_path):
    webdataset = pytest.importorskip("webdataset")
    import zlib

    out = tmp_path / "out"
    output = {"format": "webdataset", "shard_max_items": 4, "thumbnail_every": 3}
    spec = job_spec(six_items, tiny_models, str(out), cluster={"num_workers": 1}, output=output)
    summary = run_job(spec, progress=False, write_gallery=False)
    ids = expected_item_ids(spec)
    assert summary.images_this_run == 6
    storage = open_storage(str(out))
    assert sorted(read_item_ids(storage)) == sorted(ids)  # committed once, by the worker with its shard
    shards = sorted(k for k in storage.list("shards/") if k.endswith(".tar"))
    # One worker: a shard closed at 4 items, and the rest committed when the driver released the worker.
    per_shard = [pq.read_table(out / k.replace(".tar", ".parquet")).num_rows for k in shards]
    assert sorted(per_shard) == [2, 4]
    samples = list(webdataset.WebDataset([str(out / k) for k in shards], shardshuffle=False))
    assert sorted(s["__key__"] for s in samples) == sorted(ids)
    for s in samples:
        assert s["png"][:8] == b"\x89PNG\r\n\x1a\n"
        assert json.loads(s["json"])["prompt"] == s["txt"].decode()
    assert not storage.list("images/")  # no object per image
    # Thumbnails for a sample only: about one id in three, by a hash of the id.
    sampled = {i for i in ids if zlib.crc32(i.encode()) % 3 == 0}
    assert storage.list("thumbs/") == sorted(f"thumbs/{i}.jpg" for i in sampled)
    # The gallery's copy of a reference only for the references of sampled items (the gallery draws no other).
    rows = {r["item_id"]: r for r in read_metadata_table(storage).to_pylist()}
    assert storage.list("references/") == sorted({f"references/{rows[i]['reference_hash']}.jpg" for i in sampled})
    assert all((rows[i]["reference_image_key"] is None) == (i not in sampled) for i in ids)
    # Rerunning the same spec renders nothing and keeps one shard per item.
    again = run_job(spec, progress=False, write_gallery=False)
    assert (again.images_this_run, again.skipped_already_done) == (0, 6)
    assert sorted(k for k in storage.list("shards/") if k.endswith(".tar")) == shards


def _kill_for_good(handle) -> None:
    """ray.kill returns before the actor is gone: wait until a call finds it dead, so that no later call (the
    release's commit) runs on it."""
    import ray

    ray.kill(handle, no_restart=True)
    for _ in range(600):
        try:
            ray.get(handle.pid.remote(), timeout=10)
        except ray.exceptions.ActorDiedError:
            return
    raise AssertionError("the killed worker still answers")


@pytest.mark.slow
# SIGKILLed after its first item: Ray restarts the actor and retries a call still out on it, whose answer shows a
# new process. Killed for good after its last item: nothing is out, the release's commit finds the worker dead, and
# the pool starts another for the items given back.
@pytest.mark.parametrize("kill_after, for_good", [(1, False), (6, True)])
def test_a_worker_killed_mid_shard_leaves_no_partial_shard_and_its_items_render_again_in_the_same_run(
    kill_after, for_good, six_items, tiny_models, tmp_path
):
    import os
    import signal

    import ray

    from snapref_ray.storage.shards import committed_shards

    webdataset = pytest.importorskip("webdataset")
    out = tmp_path / "out"
    output = {"format": "webdataset", "shard_max_items": 100}  # nothing closes a shard but the release
    spec = job_spec(six_items, tiny_models, str(out), cluster={"num_workers": 1}, output=output)
    handles: list = []
    killed: list[int] = []
    done_events: list[str] = []
    rendered: set[str] = set()

    def kill_the_worker_once(event) -> None:
        if event.kind == "item_done":
            done_events.extend(event.item_ids)
        if event.kind == "item_rendered":  # the item is in the worker's open shard, uncommitted
            rendered.update(event.item_ids)
        if len(rendered) == kill_after and not killed:
            pid = ray.get(handles[0].pid.remote(), timeout=60)
            if for_good:
                _kill_for_good(handles[0])
            else:
                os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    summary = run_job(
        spec,
        progress=False,
        write_gallery=False,
        on_workers=lambda h, i: handles.extend(h),
        on_event=kill_the_worker_once,
    )
    expected = expected_item_ids(spec)
    assert killed
    # The same run rendered the dead shard's items again: every item committed once, and counted once.
    assert summary.images_this_run == len(expected) == 6 and summary.failed_items == 0
    assert sorted(done_events) == sorted(expected)  # item_done only when committed, once each
    assert summary.requeues["shard_lost"] >= 1
    storage = open_storage(str(out))
    ids = read_item_ids(storage)
    assert len(ids) == len(set(ids)) and set(ids) == expected
    tars = sorted(k for k in storage.list("shards/") if k.endswith(".tar"))
    assert tars == committed_shards(storage)  # the dead worker's shard is not there, not even in part
    keys = [s["__key__"] for s in webdataset.WebDataset([str(out / k) for k in tars], shardshuffle=False)]
    assert sorted(keys) == sorted(expected)  # every item in exactly one committed shard
    before = {r["item_id"]: r["shard_key"] for r in read_metadata_table(storage).to_pylist()}

    again = run_job(spec, progress=False, write_gallery=False)
    assert (again.images_this_run, again.skipped_already_done) == (0, 6)
    after = {r["item_id"]: r["shard_key"] for r in read_metadata_table(storage).to_pylist()}
    assert after == before


@pytest.mark.slow
def test_a_job_that_ends_with_a_lost_open_shard_reports_its_items_uncommitted(six_items, tiny_models, tmp_path):
    # Interrupted right after its worker died for good with an item in its open shard: nothing renders the item
    # again in this run, so it must not be counted done, and errors/ and the summary say what became of it.
    from snapref_ray.storage.metadata import read_errors_table, read_summary

    out = tmp_path / "out"
    output = {"format": "webdataset", "shard_max_items": 100}
    spec = job_spec(six_items, tiny_models, str(out), cluster={"num_workers": 1}, output=output)
    handles: list = []
    rendered: list[str] = []

    def kill_the_worker_then_interrupt(event) -> None:
        if event.kind == "item_rendered" and not rendered:
            rendered.extend(event.item_ids)
            _kill_for_good(handles[0])  # no restart: the release's commit finds it dead at once
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_job(
            spec,
            progress=False,
            write_gallery=False,
            on_workers=lambda h, i: handles.extend(h),
            on_event=kill_the_worker_then_interrupt,
        )
    storage = open_storage(str(out))
    summary = read_summary(storage)
    assert summary["interrupted"] is True
    assert read_item_ids(storage) == [] and summary["images_this_run"] == 0  # nothing was committed
    assert summary["scheduler"]["uncommitted_items"] == len(rendered) == 1
    errors = read_errors_table(storage).to_pylist()
    assert [(e["item_id"], e["stage"]) for e in errors] == [(rendered[0], "write")]
    assert "shard was not committed as the job ended" in errors[0]["error"]


def test_wait_for_lease_sets_how_long_a_render_waits(six_items, tiny_models, tmp_path):
    import yaml

    from snapref_ray import cli

    spec = job_spec(six_items, tiny_models, str(tmp_path / "out"))
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec.model_dump(mode="json", exclude_none=True)))

    def waits(*flags: str) -> float:
        args = cli.build_parser().parse_args(["render", str(spec_path), *flags])
        return cli.render_spec(args).output.lease_wait_seconds

    assert (waits(), waits("--wait-for-lease"), waits("--wait-for-lease", "45")) == (0.0, 600.0, 45.0)
