"""End to end: two real render workers (tiny models) on a local Ray render manifests to a local folder
and to a real S3-compatible server (SeaweedFS), and the outputs read back with pyarrow and pandas."""

from __future__ import annotations

import io
import json
import shutil
import uuid

import pandas as pd
import pyarrow.parquet as pq
import pytest
from PIL import Image

from snapref_ray.jobs.generate_dataset import run_job
from snapref_ray.storage.backends import open_storage
from snapref_ray.storage.ledger import OutputConflictError, read_job
from snapref_ray.storage.metadata import read_errors_table, read_item_ids
from tests.cluster.conftest import GOOD_PROMPTS, expected_item_ids, job_spec, write_manifest

pytestmark = [pytest.mark.usefixtures("ray_cluster_s3"), pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def local_job(ray_cluster_s3, job_inputs, tiny_models, tmp_path_factory):
    """The manifest with bad rows rendered once to a local folder: (spec, summary, output folder).

    Tests read this output and never change it (the append test works on a copy).
    """
    out = tmp_path_factory.mktemp("local-job") / "out"
    spec = job_spec(job_inputs.bad_rows_manifest, tiny_models, str(out))
    summary = run_job(spec, progress=False, write_gallery=False)
    return spec, summary, out


@pytest.mark.slow
def test_local_job_renders_every_good_row(local_job):
    spec, summary, out = local_job
    assert {
        k: getattr(summary, k)
        for k in (
            "manifest_rows",
            "invalid_rows",
            "items",
            "images_this_run",
            "images_total",
            "failed_items",
            "skipped_already_done",
            "interrupted",
        )
    } == {
        "manifest_rows": 14,
        "invalid_rows": 5,
        "items": 9,
        "images_this_run": 9,
        "images_total": 9,
        "failed_items": 0,
        "skipped_already_done": 0,
        "interrupted": False,
    }
    assert json.loads((out / "summary.json").read_text()) == summary.to_json()


@pytest.mark.slow
def test_metadata_reads_back_with_pyarrow_and_pandas(local_job):
    spec, _, out = local_job
    ids = expected_item_ids(spec)
    table = pq.read_table(out / "metadata")
    frame = pd.read_parquet(out / "metadata")
    assert table.num_rows == len(frame) == 9
    assert sorted(table.column("item_id").to_pylist()) == sorted(frame["item_id"]) == sorted(ids)
    assert frame["item_id"].is_unique
    # Every row names its image, relative to the output root, and the absolute URI next to it.
    assert all(frame["image_key"] == "images/" + frame["item_id"] + ".png")
    assert all(frame["image_uri"] == frame["image_key"].map(lambda k: str(out / k)))
    assert set(frame["prompt"]) == set(GOOD_PROMPTS)
    assert set(zip(frame["width"], frame["height"], frame["steps"], frame["sampler"])) == {(256, 256, 2, "euler")}
    assert (frame["attempt"] == 1).all() and (frame["sample_s"] > 0).all()
    assert sorted(frame["manifest_row"]) == list(range(1, 10))
    # Two workers shared the job.
    assert frame["worker_id"].nunique() == 2


@pytest.mark.slow
def test_every_image_exists_decodes_and_carries_its_info(local_job):
    _, _, out = local_job
    frame = pd.read_parquet(out / "metadata")
    for row in frame.itertuples():
        data = (out / row.image_key).read_bytes()
        image = Image.open(io.BytesIO(data))
        image.load()
        assert (image.format, image.size) == ("PNG", (256, 256))
        info = json.loads(image.text["snapref"])
        assert (info["item_id"], info["seed"], info["reference_hash"]) == (row.item_id, row.seed, row.reference_hash)
        assert info["settings"]["sampler"] == "euler"
        assert f"Seed: {row.seed}" in image.text["parameters"]
        assert (out / row.thumb_key).is_file()
    assert sorted(p.name for p in (out / "images").iterdir()) == sorted(frame["item_id"] + ".png")


@pytest.mark.slow
def test_each_reference_is_encoded_exactly_once(local_job):
    _, summary, out = local_job
    frame = pd.read_parquet(out / "metadata")
    assert frame["reference_hash"].nunique() == 3
    assert (
        summary.references,
        summary.reference_encodes,
        summary.encodes_per_reference,
        summary.max_encodes_per_reference,
    ) == (3, 3, 1.0, 1)
    assert summary.scheduler["encodes_requested"] == 3
    assert summary.scheduler["local_encodes"] == 0


@pytest.mark.slow
def test_bad_rows_are_listed_in_errors_with_their_reason(local_job, job_inputs):
    _, _, out = local_job
    errors = pd.read_parquet(out / "errors").sort_values("manifest_row")
    assert list(errors["manifest_row"]) == sorted(job_inputs.bad_rows)
    assert set(errors["stage"]) == {"validate"} and errors["item_id"].isna().all()
    for row in errors.itertuples():
        field, reason = job_inputs.bad_rows[row.manifest_row]
        assert row.error.startswith(f"field {field!r}: "), row.error
        assert reason in row.error, row.error


@pytest.mark.slow
def test_rerunning_the_same_spec_renders_nothing_new(local_job):
    spec, first, out = local_job
    parts = sorted(p.name for p in (out / "metadata").iterdir())
    errors_before = len(read_errors_table(open_storage(str(out)), exclude_ids=set()))
    again = run_job(spec, progress=False, write_gallery=False)
    assert (again.images_this_run, again.skipped_already_done, again.images_total) == (0, 9, 9)
    assert again.config_hash == first.config_hash
    assert sorted(p.name for p in (out / "metadata").iterdir()) == parts  # no new part
    # The invalid rows are not recorded a second time.
    assert len(read_errors_table(open_storage(str(out)), exclude_ids=set())) == errors_before == 5
    assert json.loads((out / "summary.json").read_text())["images_this_run"] == 0
    # The resume keeps the job's throughput and each run's figures: the first run's, and its own (nothing to do).
    assert again.images_per_hour == first.images_per_hour > 0
    assert again.runs[0] == first.runs[-1] and again.runs[-1].items_to_render == 0
    # Each run reports what its driver cost: this test's process is the driver, so its peak RSS is at least what
    # the kernel says this process holds now, and validating and planning took some of its CPU.
    with open("/proc/self/status") as f:
        rss_now = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    assert again.runs[-1].driver_peak_rss_bytes >= rss_now * 0.9 and again.runs[-1].driver_cpu_seconds > 0


@pytest.mark.slow
def test_another_spec_is_refused_unless_appending(local_job, job_inputs, tiny_models, tmp_path):
    spec, first, original = local_job
    out = tmp_path / "out"
    shutil.copytree(original, out)
    other = job_spec(job_inputs.bad_rows_manifest, tiny_models, str(out), defaults={"steps": 3})
    with pytest.raises(OutputConflictError, match="belongs to another job"):
        run_job(other, progress=False, write_gallery=False)
    assert sorted(read_item_ids(open_storage(str(out)))) == sorted(expected_item_ids(spec))

    extra = write_manifest(
        job_inputs.folder / "extra.csv",
        [
            {"reference": job_inputs.references[1], "prompt": "1girl, solo, mountain, snow", "seed": 7},
            {"reference": job_inputs.references[1], "prompt": "1girl, solo, train station", "seed": 8},
        ],
    )
    appended = job_spec(extra, tiny_models, str(out), output={"append": True})
    summary = run_job(appended, progress=False, write_gallery=False)
    assert (summary.images_this_run, summary.failed_items) == (2, 0)
    ids = read_item_ids(open_storage(str(out)))
    assert len(ids) == len(set(ids)) == 11
    assert set(ids) == expected_item_ids(spec) | expected_item_ids(appended)
    job = read_job(open_storage(str(out)))
    assert job["fingerprint"] == first.config_hash
    assert [a["fingerprint"] for a in job["appended"]] == [summary.config_hash]
    # The summary describes the whole output, and each job's part of it; every run and every row names its job.
    jobs = (first.config_hash, summary.config_hash)
    assert (summary.images_total, summary.job_images, summary.items) == (11, 2, 2)
    assert [(part.job, part.images, part.invalid_rows) for part in summary.jobs] == [
        (jobs[0], 9, 5),
        (jobs[1], 2, 0),
    ]
    assert summary.runs[-1].job == jobs[1] and {r.job for r in summary.runs} == set(jobs)
    rows = pq.read_table(out / "metadata", columns=["job", "manifest_row"]).to_pylist()
    assert sorted((r["job"], r["manifest_row"]) for r in rows) == sorted(
        [(jobs[0], row) for row in range(1, 10)] + [(jobs[1], 1), (jobs[1], 2)]
    )  # manifest rows 1 and 2 are in both jobs: the job tells them apart
    # The original job still resumes on the shared output (its spec there: the output is no part of the job's
    # fingerprint): nothing left to do, and the summary is still of all of the output.
    resumed = run_job(
        job_spec(job_inputs.bad_rows_manifest, tiny_models, str(out)), progress=False, write_gallery=False
    )
    assert (resumed.images_this_run, resumed.images_total, resumed.job_images) == (0, 11, 9)
    assert [part.job for part in resumed.jobs] == list(jobs)


@pytest.mark.slow
def test_job_reads_from_and_writes_to_s3_with_embedded_images(
    s3_server, job_inputs, tiny_models, tmp_path, monkeypatch
):
    """Manifest and references on S3 (relative paths resolve against the manifest's prefix), output
    to s3:// through `endpoint_url`, image bytes embedded in the Parquet for Hugging Face datasets."""
    from pyarrow import fs

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    prefix = f"batch-{uuid.uuid4().hex[:8]}"
    client = s3_server.client()
    for ref in job_inputs.references:
        client.put_object(
            Bucket=s3_server.bucket, Key=f"{prefix}/inputs/{ref}", Body=(job_inputs.folder / ref).read_bytes()
        )
    client.put_object(
        Bucket=s3_server.bucket, Key=f"{prefix}/inputs/good.csv", Body=job_inputs.good_manifest.read_bytes()
    )
    out_uri = f"s3://{s3_server.bucket}/{prefix}/out"
    spec = job_spec(
        f"s3://{s3_server.bucket}/{prefix}/inputs/good.csv",
        tiny_models,
        out_uri,
        output={"embed_images": True, "s3": {"endpoint_url": s3_server.endpoint_url}},
    )
    summary = run_job(spec, progress=False, write_gallery=False)
    assert (summary.images_this_run, summary.failed_items, summary.invalid_rows) == (9, 0, 0)
    assert (summary.reference_encodes, summary.encodes_per_reference) == (3, 1.0)

    s3fs = fs.S3FileSystem(
        endpoint_override=s3_server.endpoint_url,
        scheme="http",
        region="us-east-1",
        access_key=s3_server.access_key,
        secret_key=s3_server.secret_key,
    )
    table = pq.read_table(f"{s3_server.bucket}/{prefix}/out/metadata", filesystem=s3fs)
    frame = pd.read_parquet(f"{s3_server.bucket}/{prefix}/out/metadata", filesystem=s3fs)
    assert sorted(table.column("item_id").to_pylist()) == sorted(frame["item_id"]) == sorted(expected_item_ids(spec))
    assert table.schema.field("image").type.names == ["bytes", "path"]
    features = json.loads(table.schema.metadata[b"huggingface"])["info"]["features"]
    assert features["image"] == {"_type": "Image"}
    for row in table.select(["item_id", "image_key", "image_uri", "image"]).to_pylist():
        assert row["image_uri"] == f"{out_uri}/{row['image_key']}"
        stored = client.get_object(Bucket=s3_server.bucket, Key=f"{prefix}/out/{row['image_key']}")["Body"].read()
        assert row["image"] == {"bytes": stored, "path": f"{row['item_id']}.png"}
        image = Image.open(io.BytesIO(stored))
        image.load()
        assert image.size == (256, 256)
        assert json.loads(image.text["snapref"])["item_id"] == row["item_id"]
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=s3_server.bucket, Prefix=f"{prefix}/out/")["Contents"]}
    assert {f"{prefix}/out/summary.json", f"{prefix}/out/job.json"} <= keys

    # Hugging Face datasets decodes the embedded column to PIL images (parts fetched to a folder).
    datasets = pytest.importorskip("datasets")
    local = tmp_path / "parts"
    local.mkdir()
    for key in sorted(k for k in keys if k.startswith(f"{prefix}/out/metadata/")):
        (local / key.rsplit("/", 1)[1]).write_bytes(client.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read())
    ds = datasets.load_dataset(
        "parquet", data_files=str(local / "*.parquet"), split="train", cache_dir=str(tmp_path / "hf-cache")
    )
    assert ds.num_rows == 9 and isinstance(ds.features["image"], datasets.Image)
    assert {row["image"].size for row in ds} == {(256, 256)}


@pytest.mark.slow
def test_workers_ask_ray_for_the_estimated_memory_and_report_their_fit(local_job, tiny_models):
    """The job's workers ask Ray for memory= (the estimate from the model files at its largest image and
    max_batch), and summary.json reports that request and each worker's measured fit."""
    from snapref_ray.render_service.memory_estimate import estimate_worker_memory

    spec, summary, _ = local_job
    request = summary.memory_per_worker
    expected = estimate_worker_memory(
        spec.model.local_files(), width=256, height=256, batch=spec.cluster.max_batch, on_gpu=False
    )
    assert request == {"bytes": expected.total, "estimate": expected.report()}
    assert 0.5 * 2**30 < request["bytes"] < 4 * 2**30  # runtime, the tiny weights, one 256x256 decode
    # Each worker measured its batch at the size it rendered and reported it.
    fits = summary.memory_fit
    assert fits and {(f["width"], f["height"], f["device"]) for f in fits} == {(256, 256, "cpu")}
    assert all(f["image_peak_bytes"] > 0 and 1 <= f["batch"] for f in fits)


@pytest.mark.slow
def test_a_worker_that_fits_on_no_node_is_refused_before_it_starts(job_inputs, tiny_models, tmp_path):
    from snapref_ray.cluster.pool import WorkerDoesNotFit

    spec = job_spec(job_inputs.bad_rows_manifest, tiny_models, str(tmp_path / "out"))
    huge = spec.model_copy(update={"cluster": spec.cluster.model_copy(update={"memory_per_worker": 2**50})})
    with pytest.raises(WorkerDoesNotFit, match=r"a worker asks for 1048576\.00 GiB of memory, and the largest node"):
        run_job(huge, progress=False, write_gallery=False)


@pytest.mark.slow
def test_summary_counts_the_forwards_the_step_cache_saved(local_job, job_inputs, tiny_models, tmp_path):
    _, plain, _ = local_job
    assert plain.step_cache is None  # no image ran with the cache
    manifest = write_manifest(
        job_inputs.folder / "cached.csv",
        [{"reference": job_inputs.references[0], "prompt": f"1girl, solo, scene {i}", "seed": i} for i in range(3)],
    )
    spec = job_spec(manifest, tiny_models, str(tmp_path / "out"), defaults={"steps": 10, "step_cache": "on"})
    summary = run_job(spec, progress=False, write_gallery=False)
    rows = pq.read_table(tmp_path / "out" / "metadata").to_pylist()
    assert summary.images_this_run == len(rows) == 3
    # the summary adds up what each image's metadata row says it skipped
    assert summary.step_cache.model_dump() == {
        "images": 3,
        "forwards": 30,
        "forwards_saved": sum(r["skipped_forwards"] for r in rows),
    }
    assert all(r["skipped_forwards"] is not None for r in rows)
