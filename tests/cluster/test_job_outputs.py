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
    assert sorted(s["images_this_run"] for s in summaries) == [0, 6]
    assert sorted(s["skipped_already_done"] for s in summaries) == [0, 6]
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
    assert summary["images_this_run"] == 6
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
    # Rerunning the same spec renders nothing and keeps one shard per item.
    again = run_job(spec, progress=False, write_gallery=False)
    assert (again["images_this_run"], again["skipped_already_done"]) == (0, 6)
    assert sorted(k for k in storage.list("shards/") if k.endswith(".tar")) == shards


@pytest.mark.slow
def test_a_worker_killed_mid_shard_leaves_no_partial_shard_and_the_rerun_renders_only_its_items(
    six_items, tiny_models, tmp_path
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

    def kill_the_worker_once(_n: int) -> None:
        if not killed:  # an item was rendered, so the worker's open shard holds it
            pid = ray.get(handles[0].pid.remote(), timeout=60)
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    run_job(
        spec,
        progress=False,
        write_gallery=False,
        on_workers=lambda h, i: handles.extend(h),
        on_progress=kill_the_worker_once,
    )
    storage = open_storage(str(out))
    first = read_item_ids(storage)
    assert killed and len(first) == len(set(first)) and set(first) < expected_item_ids(spec)
    tars = sorted(k for k in storage.list("shards/") if k.endswith(".tar"))
    assert tars == committed_shards(storage)  # the dead worker's shard is not there, not even in part
    before = {r["item_id"]: r["shard_key"] for r in read_metadata_table(storage).to_pylist()}

    again = run_job(spec, progress=False, write_gallery=False)
    assert again["images_this_run"] == 6 - len(first)  # only what the lost shard held
    ids = read_item_ids(storage)
    assert len(ids) == len(set(ids)) and set(ids) == expected_item_ids(spec)
    after = {r["item_id"]: r["shard_key"] for r in read_metadata_table(storage).to_pylist()}
    assert {i: after[i] for i in before} == before  # committed items were not rendered again
    tars = sorted(str(out / k) for k in storage.list("shards/") if k.endswith(".tar"))
    keys = [s["__key__"] for s in webdataset.WebDataset(tars, shardshuffle=False)]
    assert sorted(keys) == sorted(expected_item_ids(spec))  # every item in exactly one committed shard


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
