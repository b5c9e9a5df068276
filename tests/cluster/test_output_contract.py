"""One output contract: workers publish, the lease-holding driver alone commits (storage/job_output.py).

Real drivers and workers (tiny models, the session's local Ray) on a local folder and on S3 (SeaweedFS): a worker
that exits right after staging a shard inside a render call, a worker still staging when its release times out,
and a driver paused (SIGSTOP) past its lease while a second driver takes the output over and finishes. Exactly once
is checked by reading what a user reads: every metadata row's image exists (an object, or a member of the tar the
row names), every committed item is in exactly one tar, no tar in ``shards/`` holds an uncommitted item, and
nothing is left staged once a driver finished.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import tarfile
import time
import uuid
from pathlib import Path

import pytest
import ray
import yaml
from PIL import Image

from snapref_ray.jobs.generate_dataset import run_job
from snapref_ray.storage.backends import Storage, open_storage
from snapref_ray.storage.metadata import read_item_ids, read_metadata_table, read_summary
from snapref_ray.storage.shards import VOID, verdict
from tests.cluster.conftest import REPO, expected_item_ids, job_spec, make_reference_png, write_manifest
from tests.cluster.renderer_doubles import ExitAfterStagingAShard, SlowStaging

pytestmark = [pytest.mark.usefixtures("ray_cluster_s3"), pytest.mark.timeout(300)]

PROMPTS = ["1girl, city", "1girl, beach", "1girl, forest", "1girl, snow"]


def _manifest(folder: Path, references: int = 2) -> Path:
    rows = []
    for r in range(references):
        ref = make_reference_png(folder / "refs" / f"ref{r}.png", (70 * r % 256, 90, 200 - 60 * r))
        rows += [
            {"reference": ref.relative_to(folder).as_posix(), "prompt": p, "seed": 10 * r + i}
            for i, p in enumerate(PROMPTS)
        ]
    return write_manifest(folder / "m.csv", rows)


def assert_exactly_once(storage: Storage, expected: set[str], tmp_path: Path, *, settled: bool = True) -> None:
    """What a user reads holds each expected item once and nothing else (see the module docstring); `settled`: and
    no staged file is left (a driver finished since the last worker could stage one)."""
    ids = read_item_ids(storage)
    assert len(ids) == len(set(ids)) and set(ids) == expected, f"committed {sorted(ids)}"
    rows = read_metadata_table(storage).to_pylist()
    tars = sorted(k for k in storage.list("shards/") if k.endswith(".tar"))
    members: dict[str, list[str]] = {}
    for key in tars:
        local = tmp_path / f"read-{uuid.uuid4().hex}.tar"
        local.write_bytes(storage.get_bytes(key))
        with tarfile.open(local) as tar:
            for member in tar.getmembers():
                if member.name.endswith(".png"):
                    Image.open(tar.extractfile(member)).load()
                    members.setdefault(member.name.removesuffix(".png"), []).append(key)
    for row in rows:
        if row.get("shard_key"):
            assert row["shard_key"] in members.get(row["item_id"], []), f"{row['item_id']}: no image in its tar"
        else:
            Image.open(io.BytesIO(storage.get_bytes(row["image_key"]))).load()
    assert all(len(where) == 1 for where in members.values()), f"an item in two tars: {members}"
    assert set(members) <= set(ids), f"a tar in shards/ holds uncommitted items: {set(members) - set(ids)}"
    if tars:
        assert set(members) == set(ids)
    if settled:
        assert storage.list("staging/") == [], "a finished job left staged files"


@pytest.mark.slow
def test_a_worker_that_exits_right_after_staging_a_shard_inside_a_render_call(tiny_models, tmp_path):
    """The window the old protocol left open: a full shard published inside a render call whose answer never comes.
    The driver never hears of the shard, so it never commits it: it requeues the call's items and voids the shard."""
    marker = tmp_path / "exited"
    out = tmp_path / "out"
    spec = job_spec(
        _manifest(tmp_path),
        tiny_models,
        str(out),
        cluster={"num_workers": 1, "max_batch": 1},
        output={"format": "webdataset", "shard_max_items": 2},
    )
    summary = run_job(spec, progress=False, write_gallery=False, renderer_factory=ExitAfterStagingAShard(str(marker)))
    expected = expected_item_ids(spec)
    assert marker.exists(), "the worker never exited"
    exited_with = marker.read_text()
    storage = open_storage(str(out))
    assert summary.images_this_run == len(expected) == 8 and summary.failed_items == 0
    assert verdict(storage, exited_with) == VOID  # decided once: no later commit can count it
    assert exited_with not in storage.list("shards/")
    assert_exactly_once(storage, expected, tmp_path)


@pytest.mark.slow
def test_a_worker_still_staging_when_its_release_times_out_is_never_committed_and_its_items_render_again(
    tiny_models, tmp_path, monkeypatch
):
    """`ray.kill` returns before the worker is dead: a shard it is still staging when its release gives up is never
    committed (nothing is deleted on a timing guess either); its items render again in the same run."""
    from snapref_ray.cluster import pool

    monkeypatch.setattr(pool, "RELEASE_PUBLISH_TIMEOUT_S", 0.5)
    marker = tmp_path / "slow"
    out = tmp_path / "out"
    spec = job_spec(
        _manifest(tmp_path, references=1),
        tiny_models,
        str(out),
        cluster={"num_workers": 1},
        output={"format": "webdataset", "shard_max_items": 100},  # only the release closes the shard
    )
    summary = run_job(spec, progress=False, write_gallery=False, renderer_factory=SlowStaging(3.0, str(marker)))
    slow_shard = marker.read_text()
    storage = open_storage(str(out))
    assert summary.images_this_run == 4 and summary.requeues["shard_lost"] >= 1
    assert verdict(storage, slow_shard) in (None, VOID) and slow_shard not in storage.list("shards/")
    deadline = time.monotonic() + 30  # the killed worker's staging, if it lands at all, lands late
    while time.monotonic() < deadline and storage.list("staging/"):
        time.sleep(0.2)
        if verdict(storage, slow_shard) is None:
            break
    run_job(spec, progress=False, write_gallery=False)  # a rerun settles whatever landed late, renders nothing
    assert verdict(storage, slow_shard) in (None, VOID)
    assert_exactly_once(storage, expected_item_ids(spec), tmp_path)


def _driver_env(s3_server) -> dict[str, str]:
    return {
        **os.environ,
        **s3_server.aws_environment(),
        "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
        "RAY_AUTH_MODE": "token",
        "PYTHONPATH": str(REPO),
    }


@pytest.mark.slow
@pytest.mark.parametrize("output_format", ["files", "webdataset"])
def test_a_driver_paused_past_its_lease_writes_nothing_more_once_another_took_the_output_over(
    output_format, tiny_models, tmp_path, s3_server
):
    """Processes on S3: driver 1 is SIGSTOPped while it renders and commits; driver 2, started with a wait for the
    lease, takes the output over after driver 1's lease runs out and finishes the job; driver 1, resumed, stops at
    its next step with one line and writes nothing more — and the output holds each item exactly once."""
    uri = f"s3://{s3_server.bucket}/paused-{output_format}-{uuid.uuid4().hex[:8]}"
    output = {
        "format": output_format,
        "shard_max_items": 2,
        "metadata_flush_seconds": 0.2,
        "lease_seconds": 3,
        "s3": {"endpoint_url": s3_server.endpoint_url},
    }
    spec = job_spec(
        _manifest(tmp_path, references=3),
        tiny_models,
        uri,
        defaults={"steps": 3},
        cluster={"num_workers": 1, "max_batch": 1},
        output=output,
    )
    expected = expected_item_ids(spec)
    first_spec, second_spec = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first_spec.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    waiting = spec.model_copy(update={"output": spec.output.model_copy(update={"lease_wait_seconds": 120})})
    second_spec.write_text(yaml.safe_dump(waiting.model_dump(mode="json")))
    env = _driver_env(s3_server)
    storage = open_storage(uri, s3_server.s3_options())
    command = [sys.executable, "-m", "jobs.generate_dataset", "--no-progress"]
    first_log = open(tmp_path / "first.log", "wb")  # closed below
    first = subprocess.Popen(
        [*command, str(first_spec)],
        cwd=REPO,
        env=env,
        stdout=first_log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline and first.poll() is None and len(read_item_ids(storage)) < 2:
            time.sleep(0.1)
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        first.send_signal(signal.SIGSTOP)  # a driver paused (GC, swap, a suspended VM) in mid-job
        second = subprocess.run(
            [*command, str(second_spec)], cwd=REPO, env=env, capture_output=True, text=True, timeout=240
        )
        assert second.returncode == 0, second.stderr[-3000:]
        summary_of_second = read_summary(storage)
        # The paused driver's worker may have staged a shard after the second driver settled: never where readers
        # look, and settled by the next driver.
        assert_exactly_once(storage, expected, tmp_path, settled=False)
        first.send_signal(signal.SIGCONT)
        first.wait(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGCONT)
            os.killpg(first.pid, signal.SIGKILL)
        first_log.close()
    log = (tmp_path / "first.log").read_text()
    assert first.returncode != 0, log[-3000:]
    assert "error: lost the lease on " in log and "Traceback" not in log  # one line, no traceback
    # Nothing more from the paused driver: the output is as the second driver left it.
    assert read_summary(storage) == summary_of_second
    assert_exactly_once(storage, expected, tmp_path, settled=False)
    third = subprocess.run([*command, str(first_spec)], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert third.returncode == 0, third.stderr[-3000:]
    assert read_summary(storage)["images_this_run"] == 0
    assert_exactly_once(storage, expected, tmp_path)
