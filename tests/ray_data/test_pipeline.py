"""docs/ray-data.md's Ray Data pipeline on S3, run as written on a local Ray against the SeaweedFS S3 server;
read_results and docs/ray-data.md's read_results block, run as written. (The README's laptop pipeline runs in
tests/test_readme.py, on a Ray of 2 CPUs.)

3 references x 4 prompts (and one corrupt reference) in a CSV on S3, the tiny models in an s3://
models folder, an actor pool of 2, `write_parquet` to S3 and read back with pyarrow. Every image is
compared with `Renderer.render` of the same requests (the same rows in the same batched forward,
since batched matmuls may differ from single ones in the last bit): bitwise equal on the CPU.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from snapref_ray.adapter.images import content_hash
from snapref_ray.job_spec import JobSpec
from snapref_ray.jobs.manifest_check import load_work_items
from snapref_ray.requests import RenderRequest, RenderSettings
from snapref_ray.storage.image_files import read_image_info, read_image_parameters
from tests.cluster.conftest import make_reference_png, write_manifest
from tests.ray_data.conftest import FAST_SETTINGS, REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BUCKET = "my-bucket"  # the README's names, created on the test server
PROMPTS = [
    "1girl, solo, city street, night",
    "1girl, solo, beach",
    "1girl, solo, library, reading",
    "1girl, solo, rain, umbrella",
]


def readme_block(marker: str = "ray-data-pipeline-s3", page: str = "docs/ray-data.md") -> str:
    """The Python block that follows `<!-- marker: ... -->` in `page` (README.md, docs/...), verbatim."""
    text = (REPO / page).read_text()
    match = re.search(rf"<!-- {marker}:[^>]*-->\n```python\n(.*?)\n```", text, re.S)
    assert match, f"{page} lost its {marker} block"
    return match.group(1)


def _upload_folder(client, folder: Path, prefix: str) -> None:
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/{path.relative_to(folder).as_posix()}", Body=path.read_bytes())


def _read_parquet_prefix(client, prefix: str) -> pa.Table:
    keys = [
        o["Key"]
        for o in client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
        if o["Key"].endswith(".parquet")
    ]
    assert keys, f"nothing written under s3://{BUCKET}/{prefix}"
    return pa.concat_tables(
        [pq.read_table(io.BytesIO(client.get_object(Bucket=BUCKET, Key=k)["Body"].read())) for k in keys]
    )


@pytest.fixture(scope="module")
def inputs(s3_server, tiny_models, tmp_path_factory):
    """Bucket, models, references and prompts.csv on S3; returns (reference bytes by URI, csv rows, local csv)."""
    client = s3_server.client()
    if BUCKET not in [b["Name"] for b in client.list_buckets()["Buckets"]]:
        client.create_bucket(Bucket=BUCKET)
    _upload_folder(client, tiny_models, "models/anima")
    folder = tmp_path_factory.mktemp("ray-data-inputs")
    references = {}
    for name, colour in {"red": (200, 40, 40), "green": (40, 160, 60), "blue": (40, 70, 200)}.items():
        data = make_reference_png(folder / f"{name}.png", colour).read_bytes()
        client.put_object(Bucket=BUCKET, Key=f"refs/{name}.png", Body=data)
        references[f"s3://{BUCKET}/refs/{name}.png"] = data
    whole = make_reference_png(folder / "whole.png", (90, 90, 90)).read_bytes()
    client.put_object(Bucket=BUCKET, Key="refs/corrupt.png", Body=whole[: len(whole) * 2 // 3])
    rows = [
        {
            "reference": uri,
            "prompt": prompt,
            "seed": 100 * i + j,
            "character": uri.rsplit("/", 1)[-1][:-4],
            **FAST_SETTINGS,
        }
        for i, uri in enumerate(references)
        for j, prompt in enumerate(PROMPTS)
    ]
    rows.insert(
        5,
        {
            "reference": f"s3://{BUCKET}/refs/corrupt.png",
            "prompt": "1girl, park",
            "seed": 7,
            "character": "corrupt",
            **FAST_SETTINGS,
        },
    )
    local_csv = folder / "prompts.csv"
    with open(local_csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    client.put_object(Bucket=BUCKET, Key="prompts.csv", Body=local_csv.read_bytes())
    return references, rows, local_csv


@pytest.fixture(scope="module")
def rendered(ray_s3_env, s3_server, inputs) -> pa.Table:
    """Run the docs' S3 block; the Parquet it wrote, read back from S3 with pyarrow. The block ends in
    `raise SystemExit(check_renders(...))`: with one corrupt reference of 13 rows, exit status 1 and its line."""
    said = io.StringIO()
    with contextlib.redirect_stdout(said), pytest.raises(SystemExit) as ended:
        exec(compile(readme_block(), "docs/ray-data.md:ray-data-pipeline-s3", "exec"), {"__name__": "docs_pipeline"})
    assert ended.value.code == 1, said.getvalue()
    line = said.getvalue().strip().splitlines()[-1]
    assert line.startswith("12 of 13 row(s) rendered to s3://my-bucket/renders/; 1 failed, the first: "), line
    assert "corrupt.png" in line
    return _read_parquet_prefix(s3_server.client(), "renders/")


def test_every_row_comes_back_once_with_its_own_columns(rendered, inputs):
    _, rows, _ = inputs
    assert rendered.num_rows == len(rows) == 13
    got = sorted(zip(rendered.column("character").to_pylist(), rendered.column("seed").to_pylist()))
    assert got == sorted((r["character"], r["seed"]) for r in rows)


def test_the_corrupt_reference_is_an_error_row_and_the_rest_render(rendered):
    table = rendered.to_pylist()
    failed = [r for r in table if r["error"] is not None]
    assert [r["character"] for r in failed] == ["corrupt"]
    assert failed[0]["error_stage"] == "validate" and failed[0]["image"] is None  # before any device work
    assert "cannot decode the image" in failed[0]["error"] and "corrupt.png" in failed[0]["error"]
    good = [r for r in table if r["error"] is None]
    assert len(good) == 12 and all(r["image"] for r in good)


@pytest.fixture
def one_thread():
    """torch on one thread, as in a Ray actor with one CPU (Ray sets OMP_NUM_THREADS=1 there): CPU matmuls
    split over another thread count sum in another order, which moves the last bit."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_each_image_equals_renderer_render_of_the_same_batch(rendered, inputs, tiny_renderer, one_thread):
    references, _, _ = inputs
    good = [r for r in rendered.to_pylist() if r["error"] is None]
    batches: dict[str, list[dict]] = {}
    for row in good:
        batches.setdefault(row["batch_id"], []).append(row)
    checked = 0
    for rows in batches.values():
        rows.sort(key=lambda r: r["batch_index"])
        assert [r["batch_index"] for r in rows] == list(range(rows[0]["batch_size"]))
        assert len({r["reference"] for r in rows}) == 1  # a batched forward reads one reference
        settings = RenderSettings.model_validate_json(rows[0]["settings_json"])
        assert settings == tiny_renderer.resolve(RenderSettings(**FAST_SETTINGS))  # as rendered
        expected = tiny_renderer.render(
            [RenderRequest(prompt=r["prompt"], seed=r["seed"], settings=settings) for r in rows],
            references=[references[rows[0]["reference"]]],
        )
        for row, want in zip(rows, expected):
            image = Image.open(io.BytesIO(row["image"]))
            assert image.format == "PNG" and image.size == (256, 256)
            assert np.array_equal(np.asarray(image), np.asarray(want.image)), (row["reference"], row["seed"])
            checked += 1
    assert checked == 12


def test_rows_carry_the_job_metadata_and_png_chunks(rendered, inputs, tiny_renderer, s3_server):
    references, rows, local_csv = inputs
    # The ids, hashes and settings a batch job gives the same rows (the job's own validation; a job
    # manifest has no room for the pass-through `character` column).
    manifest = local_csv.with_name("job-manifest.csv")
    write_manifest(manifest, [{k: v for k, v in r.items() if k != "character"} for r in rows])
    spec = JobSpec.model_validate({"model": {"models_dir": "unused"}, "manifest": str(manifest)})
    items = {(i.reference.uris[0], i.seed): i for i in load_work_items(spec, s3_server.s3_options()).items}
    for row in (r for r in rendered.to_pylist() if r["error"] is None):
        item = items[(row["reference"], row["seed"])]
        assert (row["item_id"], row["reference_hash"]) == (item.item_id, item.reference_hash)
        assert row["prompt"] == item.prompt
        assert row["reference_hash"] == content_hash(references[row["reference"]])
        assert row["reference_uris"] == [row["reference"]]
        assert RenderSettings.model_validate_json(row["settings_json"]) == item.settings
        assert (row["width"], row["steps"], row["sampler"], row["image_format"]) == (256, 2, "euler", "png")
        assert row["adapter"] == tiny_renderer.adapter.identity
        info = read_image_info(row["image"])
        assert (info["item_id"], info["seed"], info["reference_hash"]) == (item.item_id, item.seed, item.reference_hash)
        assert info["settings"] == item.settings.model_dump()
        assert f"Seed: {item.seed}, Size: 256x256" in read_image_parameters(row["image"])


def test_two_actors_and_their_cache_counters(rendered):
    good = [r for r in rendered.to_pylist() if r["error"] is None]
    workers = {r["worker_id"] for r in good}
    assert 1 <= len(workers) <= 2
    # Each actor's counters only grow; its last value is its total.
    encodes = {w: max(r["actor_encodes"] for r in good if r["worker_id"] == w) for w in workers}
    hits = {w: max(r["actor_cache_hits"] for r in good if r["worker_id"] == w) for w in workers}
    groups = {(r["worker_id"], r["batch_id"]) for r in good}
    # Every batched forward either encoded its reference or found it cached, on its own actor.
    assert sum(encodes.values()) + sum(hits.values()) == len(groups)
    # A reference is encoded at least once, and at most once per actor.
    assert 3 <= sum(encodes.values()) <= 3 * len(workers)
    misses = {(r["worker_id"], r["reference"]) for r in good if not r["refkv_cache_hit"]}
    assert len(misses) == sum(encodes.values())  # a miss encodes once per actor and reference
    print(json.dumps({"actors": len(workers), "encodes": encodes, "hits": hits, "batches": len(groups)}))


def test_docs_block_is_the_one_that_ran():
    code = readme_block()
    assert "SnapRefRenderer" in code and 'write_parquet("s3://my-bucket/renders/", mode="overwrite")' in code
    assert "ActorPoolStrategy" in code and "concurrency=" not in code  # Ray 2.60: `concurrency` is deprecated


# ---------------------------------------------------------------------------------------------
# read_results


@pytest.fixture(scope="module")
def job_output(ray_s3_env, s3_server, inputs, tiny_models, tmp_path_factory):
    """A batch job (2 references x 2 prompts) rendered to S3, then a later duplicate commit of its first
    metadata part, as a job that crashed after committing and was resumed may leave. (spec, output URI)."""
    from snapref_ray.jobs.generate_dataset import run_job
    from snapref_ray.storage.backends import open_storage
    from tests.cluster.conftest import job_spec

    folder = tmp_path_factory.mktemp("job-inputs")
    refs = [make_reference_png(folder / f"{n}.png", c).name for n, c in (("a", (200, 90, 40)), ("b", (40, 90, 200)))]
    manifest = write_manifest(
        folder / "manifest.csv",
        [{"reference": r, "prompt": p, "seed": i} for r in refs for i, p in enumerate(PROMPTS[:2])],
    )
    out = f"s3://{BUCKET}/run1"  # docs/ray-data.md's read_results example reads this
    spec = job_spec(manifest, tiny_models, out)
    summary = run_job(spec, progress=False, write_gallery=False)
    assert summary.images_total == 4
    storage = open_storage(out, s3_server.s3_options())
    first = sorted(k for k in storage.list("metadata/") if k.endswith(".parquet"))[0]
    part = pq.read_table(io.BytesIO(storage.get_bytes(first)))
    part = part.set_column(
        part.column_names.index("worker_id"), "worker_id", pa.array(["later-duplicate"] * part.num_rows)
    )
    buf = io.BytesIO()
    pq.write_table(part, buf)
    storage.put_bytes("metadata/part-99990101T000000000000Z-duplicate.parquet", buf.getvalue())
    return spec, out


def test_read_results_has_every_committed_item_once_with_its_image(job_output, s3_server):
    from snapref_ray.data import read_results
    from snapref_ray.storage.backends import open_storage
    from tests.cluster.conftest import expected_item_ids

    spec, out = job_output
    rows = read_results(out).take_all()

    ids = [r["item_id"] for r in rows]
    assert len(ids) == len(set(ids)) == 4 and set(ids) == expected_item_ids(spec)
    assert all(r["worker_id"] != "later-duplicate" for r in rows)  # the first commit wins
    storage = open_storage(out, s3_server.s3_options())
    for row in rows:
        assert row["image"] == storage.get_bytes(row["image_key"])
        assert read_image_info(row["image"])["item_id"] == row["item_id"]
    plain = read_results(out, images=False)
    assert "image" not in plain.columns() and plain.count() == 4


def test_read_results_refuses_a_folder_without_job_output(tmp_path):
    from snapref_ray.data import read_results
    from snapref_ray.storage.backends import StorageError

    with pytest.raises(StorageError, match="holds no metadata parts"):
        read_results(str(tmp_path))


def test_readme_read_results_block_runs_as_written(job_output, s3_server):
    exec(
        compile(
            readme_block("ray-data-read-results", "docs/ray-data.md"), "docs/ray-data.md:ray-data-read-results", "exec"
        ),
        {"__name__": "readme_read_results"},
    )
    table = _read_parquet_prefix(s3_server.client(), "run1-cs/")
    assert table.column_names == ["item_id", "prompt", "image"]
    client = s3_server.client()
    rows = table.to_pylist()
    assert len({r["item_id"] for r in rows}) == len(rows) == 4  # every item of the job once (all mode cs)
    for row in rows:
        stored = client.get_object(Bucket=BUCKET, Key=f"run1/images/{row['item_id']}.png")["Body"].read()
        assert row["image"] == stored


def test_read_results_of_a_webdataset_job_returns_every_image(ray_s3_env, tmp_path):
    """Items inside tar shards (storage/shards.py) come back with their images, read as byte ranges."""
    from snapref_ray.data import read_results
    from snapref_ray.storage.backends import open_storage
    from tests.ray_data.test_results_shards import N_ITEMS, decoded, pixels, write_shards

    out = tmp_path / "wds-out"
    write_shards(open_storage(str(out)))

    rows = read_results(str(out), rows_per_block=4).take_all()

    assert sorted(r["item_id"] for r in rows) == [f"item-{i:03d}" for i in range(N_ITEMS)]
    for r in rows:
        np.testing.assert_array_equal(decoded(r["image"]), pixels(int(r["item_id"].removeprefix("item-"))))
