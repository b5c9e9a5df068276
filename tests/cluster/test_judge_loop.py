"""The judged job's loop (jobs/judge_loop.py): tiny models, the session's local Ray, real outputs.

A manifest whose rows share one seed renders near-duplicates on random weights (the prompt barely moves a tiny
model's image; checked below, not assumed). The driver rejects them against its reference's kept set, renders them
again with the seeds of the documented sequence, and stops a reference at its quota. Oracles computed apart from
the code under test: pHash distances recomputed with `imagehash` on the stored images, the seed sequence from its
documented formula (sha256 of "<seed>:<k>"), counts from the metadata as a user reads it.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import os
import signal
import subprocess
import sys
import tarfile
import time
from collections import Counter
from pathlib import Path

import imagehash
import pytest
import ray
import yaml
from PIL import Image

from snapref_ray.jobs.generate_dataset import run_job
from snapref_ray.storage.backends import open_storage
from snapref_ray.storage.metadata import read_item_ids, read_metadata_table, read_summary
from tests.cluster.conftest import REPO, expected_item_ids, job_spec, make_reference_png, write_manifest
from tests.cluster.test_failures import run_job_killing_a_worker

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.timeout(600)]

PROMPTS = ["1girl, city", "1girl, beach", "1girl, forest", "1girl, snow", "1girl, night", "1girl, rain"]
SEED = 7


# `python -m jobs.generate_dataset` (what `ray job submit` runs) with torch made unimportable in the driver.
DRIVER_WITHOUT_TORCH = [
    sys.executable,
    "-c",
    "import runpy, sys; sys.modules['torch'] = None;"
    " runpy.run_module('jobs.generate_dataset', run_name='__main__', alter_sys=True)",
]


def _manifest(folder: Path, references: int = 2, prompts: int = 6) -> Path:
    rows = []
    for r in range(references):
        ref = make_reference_png(folder / "refs" / f"ref{r}.png", (70 * r % 256, 90, 200 - 60 * r))
        rows += [
            {"reference": ref.relative_to(folder).as_posix(), "prompt": p, "seed": SEED} for p in PROMPTS[:prompts]
        ]
    return write_manifest(folder / "m.csv", rows)


def _spec(tmp_path: Path, models: Path, *, judge: dict, output: dict | None = None, **kw):
    return job_spec(
        _manifest(tmp_path, **kw),
        models,
        str(tmp_path / "out"),
        cluster={"num_workers": 1, "max_batch": 2},
        output=output or {},
        judge=judge,
    )


def _documented_seed(seed: int, k: int) -> int:
    """docs/judging.md: render k > 0 of an item with seed s uses the first 8 bytes of sha256("s:k"), top bit off."""
    return seed if k == 0 else int.from_bytes(hashlib.sha256(f"{seed}:{k}".encode()).digest()[:8], "big") & (2**63 - 1)


def _images(storage, rows: list[dict], tmp_path: Path) -> dict[str, Image.Image]:
    """Each row's image as a user reads it: its file, or its member of the tar its row names."""
    images = {}
    tars: dict[str, tarfile.TarFile] = {}
    for row in rows:
        if row.get("shard_key"):
            key = row["shard_key"]
            if key not in tars:
                local = tmp_path / key.replace("/", "_")
                local.write_bytes(storage.get_bytes(key))
                tars[key] = tarfile.open(local)
            data = tars[key].extractfile(row["shard_member"] or f"{row['item_id']}.png").read()
        elif row.get("image_key"):
            data = storage.get_bytes(row["image_key"])
        else:
            continue
        images[row["item_id"]] = Image.open(io.BytesIO(data)).convert("RGB")
    return images


def _check_loop(storage, tmp_path: Path, *, max_distance: int, max_renders: int, quota: int | None) -> list[dict]:
    """The loop's promises, read back from the output (see the module docstring); returns the rows."""
    rows = read_metadata_table(storage).to_pylist()
    ids = [r["item_id"] for r in rows]
    assert len(ids) == len(set(ids)), "a render committed twice"
    images = _images(storage, rows, tmp_path)
    by_item: dict[str, list[dict]] = {}
    for row in rows:
        by_item.setdefault(row["render_of"], []).append(row)
    for item, renders in by_item.items():
        renders.sort(key=lambda r: r["render_index"])
        assert [r["render_index"] for r in renders] == list(range(len(renders))), f"{item}: a render missing"
        assert sum(r["accepted"] for r in renders) <= 1, f"{item}: two accepted renders"
        assert all(not r["accepted"] for r in renders[:-1]), f"{item}: rendered again after a kept render"
        assert len(renders) <= max_renders
        base = renders[0]["seed"]
        for r in renders:  # the recorded, documented seed sequence; the row id names the render
            assert r["seed"] == _documented_seed(base, r["render_index"])
            assert r["item_id"] == (item if r["render_index"] == 0 else f"{item}-r{r['render_index']}")
            if r["item_id"] in images:  # (a rejected render whose image was not kept has none)
                assert r["phash"] == str(imagehash.phash(images[r["item_id"]]))
    kept: dict[str, list[str]] = {}
    for row in rows:
        if row["accepted"]:
            kept.setdefault(row["reference_hash"], []).append(row["item_id"])
    for ref, kept_ids in kept.items():  # every kept set pairwise apart, by the library itself
        hashes = [imagehash.phash(images[i]) for i in kept_ids]
        for a, b in itertools.combinations(hashes, 2):
            assert a - b > max_distance, f"reference {ref[:8]}: two kept images {a - b} bits apart"
        if quota is not None:
            assert len(kept_ids) <= quota
    for row in rows:  # a near-duplicate reject lies within max_distance of an image kept before it
        if row["rejected_by"] and "near_duplicate" in row["rejected_by"]:
            assert row["score_near_duplicate"] <= max_distance and not row["accepted"]
    if quota is None:  # the loop ran out: each item kept one render, or made all it may
        for item, renders in by_item.items():
            assert renders[-1]["accepted"] or len(renders) == max_renders, f"{item}: left unfinished"
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["files", "webdataset"])
def test_near_duplicates_are_rejected_and_rendered_again_with_the_documented_seeds(tiny_models, tmp_path, fmt):
    # The identity gap runs too (its contrast: another reference of the job), scoring without rejecting.
    judge = {"near_duplicate": {"max_distance": 10}, "identity_gap": {"min_gap": -1e9}, "max_renders_per_item": 3}
    spec = _spec(tmp_path, tiny_models, judge=judge, output={"format": fmt, "shard_max_items": 3, "thumbnail_every": 1})
    summary = run_job(spec, progress=False, write_gallery=False)
    storage = open_storage(spec.output.uri)
    rows = _check_loop(storage, tmp_path, max_distance=10, max_renders=3, quota=None)
    first = [r for r in rows if r["render_index"] == 0]
    assert len(first) == 12
    # The manifest does render near-duplicates (one seed, several prompts): the premise of the test.
    assert any("near_duplicate" in (r["rejected_by"] or "") for r in first)
    assert any(r["render_index"] > 0 for r in rows), "no reject was rendered again"
    assert all(r["score_identity_gap"] is not None for r in rows)
    # keep_rejected_images (the default): every render's image is kept, the rejected ones with accepted false.
    assert set(_images(storage, rows, tmp_path)) == {r["item_id"] for r in rows}
    assert {r["item_id"] for r in rows if not r["accepted"]} == {r["item_id"] for r in rows if r["rejected_by"]}
    assert all(r["score_sanity_std"] is None for r in rows)  # a check not asked for: null
    figures = summary.judge
    assert figures["renders"] == len(rows)
    assert figures["kept"] == sum(r["accepted"] for r in rows)
    assert figures["rejected_by"]["near_duplicate"] == sum("near_duplicate" in (r["rejected_by"] or "") for r in rows)
    assert figures["renders_per_kept_image"] == round(len(rows) / figures["kept"], 4)
    _check_report(spec, rows)


def _check_report(spec, rows: list[dict]) -> None:
    """The report's counts against the metadata, and the rejected renders in the gallery beside the kept ones."""
    from snapref_ray.report import write_report

    report = write_report(spec.output.uri)["judging"]
    assert (report["renders"], report["kept"]) == (len(rows), sum(r["accepted"] for r in rows))
    per_ref = Counter((r["reference_hash"], r["accepted"]) for r in rows)
    assert {(x["reference_hash"], True): x["kept"] for x in report["references"]} == {
        k: v for k, v in per_ref.items() if k[1]
    }
    assert sum(x["rejected"] for x in report["references"]) == sum(not r["accepted"] for r in rows)
    checks = Counter(c for r in rows if r["rejected_by"] for c in r["rejected_by"].split(","))
    assert report["rejected_by"] == dict(checks)
    storage = open_storage(spec.output.uri)
    page = storage.get_bytes("gallery.html").decode()
    shown = [r for r in rows if r["thumb_key"]]
    assert page.count('class="scene rejected"') == sum(not r["accepted"] for r in shown) > 0
    assert page.count('data-verdict="kept"') == sum(r["accepted"] for r in shown)
    assert "renders / kept image" in page and "GPU-s / kept image" in page
    svg = storage.get_bytes("report/scores.svg").decode()
    assert 'id="score-near_duplicate-kept-0"' in svg and 'id="score-near_duplicate-rejected-0"' in svg


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["files", "webdataset"])
def test_the_quota_stops_a_reference_and_skips_its_items(tiny_models, tmp_path, fmt):
    # -1: scores only, every render kept but for the quota; a rejected render's image is not kept.
    judge = {"near_duplicate": {"max_distance": -1}, "kept_per_reference": 2, "keep_rejected_images": False}
    output = {"format": fmt, "shard_max_items": 3, "thumbnail_every": 1}
    spec = _spec(tmp_path, tiny_models, judge=judge, output=output)
    summary = run_job(spec, progress=False, write_gallery=False)
    storage = open_storage(spec.output.uri)
    rows = _check_loop(storage, tmp_path, max_distance=-1, max_renders=3, quota=2)
    for row in rows:  # kept: its image and thumbnail; rejected: its row and scores, no image
        names_image = row["image_key"] if fmt == "files" else row["shard_member"]
        assert (names_image is not None) == row["accepted"] and row["phash"] is not None
        assert storage.exists(f"images/{row['item_id']}.png") == (row["accepted"] and fmt == "files")
        assert storage.exists(f"thumbs/{row['item_id']}.jpg") == row["accepted"]
    _check_readers_see_kept_images_only(spec, storage, rows, fmt, tmp_path)
    kept = Counter(r["reference_hash"] for r in rows if r["accepted"])
    assert sorted(kept.values()) == [2, 2], "each reference keeps exactly its quota"
    quota_rejects = sum(r["rejected_by"] == "quota" for r in rows)
    assert quota_rejects > 0, "no render came in after its reference filled: nothing rejected to leave out"
    assert len(rows) == 4 + quota_rejects  # a render that came in after its reference filled is a row too
    if fmt == "files":  # (webdataset: verdicts come as a shard commits, when more of its items may be in flight)
        assert len(rows) < 12, "the queued items of a full reference were rendered anyway"
    assert summary.judge["references_at_quota"] == 2
    _check_skipped(spec, storage, summary, rows)
    # A rerun continues the quotas: the items of a full reference are skipped again, nothing renders, and they are
    # counted once.
    again = run_job(spec, progress=False, write_gallery=False)
    assert again.images_this_run == 0 and again.judge["renders"] == len(rows)
    _check_skipped(spec, storage, again, rows)
    assert read_metadata_table(storage).num_rows == len(rows)


def _check_skipped(spec, storage, summary, rows: list[dict]) -> None:
    """Every item without a kept image is skipped by the quota here (no check rejects, no render fails): counted in
    summary.json, the terminal line and the gallery in the same words, listed in skipped.parquet with its manifest
    row, and not a failure (exit status 0, nothing in errors/)."""
    from snapref_ray.jobs.job_outcome import exit_status, not_rendered_lines, summary_line
    from snapref_ray.jobs.quota_skips import read_skipped
    from snapref_ray.report import write_report

    kept_items = {r["render_of"] for r in rows if r["accepted"]}
    skipped = read_skipped(storage).to_pylist()
    manifest_rows = {r["render_of"]: r["manifest_row"] for r in rows}
    assert sorted(s["item_id"] for s in skipped) == sorted(expected_item_ids(spec) - kept_items)
    assert all(s["reason"] == "quota" for s in skipped)
    assert all(manifest_rows.get(s["item_id"], s["manifest_row"]) == s["manifest_row"] for s in skipped)
    assert sorted(s["manifest_row"] for s in skipped) == sorted(
        set(range(1, 13)) - {manifest_rows[i] for i in kept_items}
    )
    assert summary.skipped_by_quota == summary.judge["items_skipped_by_quota"] == 12 - 4 == len(skipped)
    assert summary.failed_items == 0 and summary.unrendered_items == 0 and exit_status(summary) == 0
    assert not_rendered_lines(summary, errors_at="errors/") == []
    assert "8 items skipped by the quota" in summary_line(summary)
    assert read_summary(storage)["skipped_by_quota"] == 8
    assert not storage.list("errors/")
    write_report(spec.output.uri)
    page = storage.get_bytes("gallery.html").decode()
    assert "skipped by the quota" in page and ">8<" in page.split("skipped by the quota", 1)[1][:400]


def _check_readers_see_kept_images_only(spec, storage, rows: list[dict], fmt: str, tmp_path: Path) -> None:
    """What the documented readers read holds the kept images and no other: `read_results` (a rejected render's row
    with no image), and with webdataset output every tar of shards/ as the `webdataset` library reads it."""
    from snapref_ray.data import read_results

    accepted = {r["item_id"] for r in rows if r["accepted"]}
    read = {r["item_id"]: r for r in read_results(spec.output.uri).take_all()}
    assert set(read) == {r["item_id"] for r in rows}
    assert {i for i, r in read.items() if r["image"] is not None} == accepted
    assert all(r["accepted"] is (i in accepted) for i, r in read.items())
    if fmt == "webdataset":
        import webdataset

        urls = sorted(str(Path(spec.output.uri) / k) for k in storage.list("shards/") if k.endswith(".tar"))
        samples = list(webdataset.WebDataset(urls, shardshuffle=False))
        assert sorted(s["__key__"] for s in samples) == sorted(accepted)
        for s in samples:  # the tar's image is the one read_results gives
            assert s["png"] == read[s["__key__"]]["image"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "output",
    [
        {"format": "files"},
        # The worker is killed with renders in its open shard: they render again.
        {"format": "webdataset", "shard_max_items": 3},
        # A shard commits when its idle worker publishes it, after the references of its renders closed: the
        # re-renders open them again, those whose re-renders are one batch in that batch's render alone
        # (cluster/placement.py), on the worker left.
        {"format": "webdataset"},
    ],
    ids=["files", "webdataset-small-shards", "webdataset"],
)
def test_a_worker_killed_mid_loop_loses_no_kept_image_and_keeps_none_twice(tiny_models, tmp_path, output):
    judge = {"near_duplicate": {"max_distance": 10}, "max_renders_per_item": 3}
    spec = job_spec(
        _manifest(tmp_path, references=4, prompts=3),
        tiny_models,
        str(tmp_path / "out"),
        defaults={"steps": 3},
        cluster={"num_workers": 2, "max_batch": 1},
        output=output,
        judge=judge,
    )
    summary, killed_pid, infos = run_job_killing_a_worker(spec)
    assert killed_pid in {i.pid for i in infos} and summary.failed_items == 0
    rows = _check_loop(open_storage(spec.output.uri), tmp_path, max_distance=10, max_renders=3, quota=None)
    assert {r["render_of"] for r in rows} == expected_item_ids(spec)
    assert summary.judge["renders"] == len(rows)


def _driver_env() -> dict[str, str]:
    return {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address, "PYTHONPATH": str(REPO)}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["files", "webdataset"])
def test_a_killed_driver_resumes_the_loop_its_kept_sets_and_quotas(tiny_models, tmp_path, fmt):
    """`kill -9` of a judged job's driver once some renders are committed, then the same command: the resume reads
    the kept sets, quotas and pending re-renders back from the committed rows; no committed render is made again.
    Both drivers run with torch unimportable: a job's driver plans, schedules, judges and commits without it
    (docs/design.md), and an import of torch there would end the job with a traceback."""
    judge = {"near_duplicate": {"max_distance": 10}, "max_renders_per_item": 3, "kept_per_reference": 4}
    spec = job_spec(
        _manifest(tmp_path, references=3),
        tiny_models,
        str(tmp_path / "out"),
        defaults={"steps": 4},
        cluster={"num_workers": 1, "max_batch": 1},
        output={"metadata_flush_seconds": 0.5, "format": fmt, "shard_max_items": 2},
        judge=judge,
    )
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    command = [*DRIVER_WITHOUT_TORCH, str(spec_file), "--no-progress"]
    storage = open_storage(spec.output.uri)
    out = Path(spec.output.uri)
    with open(tmp_path / "driver.log", "wb") as log:
        proc = subprocess.Popen(
            command, cwd=REPO, env=_driver_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline and proc.poll() is None:
                if (out / "metadata").is_dir() and len(read_item_ids(storage)) >= 4:
                    break
                time.sleep(0.05)
            assert proc.poll() is None, "the job ended before it was killed:\n" + (tmp_path / "driver.log").read_text()
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    before = {r["item_id"]: r for r in read_metadata_table(storage).to_pylist()}
    assert len(before) >= 4

    resumed = subprocess.run(command, cwd=REPO, env=_driver_env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = _check_loop(storage, tmp_path, max_distance=10, max_renders=3, quota=4)
    by_id = {r["item_id"]: r for r in rows}
    for item_id, row in before.items():  # committed before the kill: not rendered again, verdict unchanged
        assert by_id[item_id]["finished_at"] == row["finished_at"]
        assert by_id[item_id]["accepted"] == row["accepted"]
    assert {r["render_of"] for r in rows} <= expected_item_ids(spec)
    kept = Counter(r["reference_hash"] for r in rows if r["accepted"])
    assert all(n <= 4 for n in kept.values())
    figures = read_summary(storage)["judge"]
    assert (figures["renders"], figures["kept"]) == (len(rows), sum(r["accepted"] for r in rows))
    # Every item ended: kept, out of renders, or its reference full.
    for item in expected_item_ids(spec):
        renders = sorted((r for r in rows if r["render_of"] == item), key=lambda r: r["render_index"])
        ref = next(r["reference_hash"] for r in rows if r["render_of"] == item) if renders else None
        assert not renders or renders[-1]["accepted"] or len(renders) == 3 or kept[ref] == 4
