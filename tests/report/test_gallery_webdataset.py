"""The gallery of a `webdataset` job: its images are inside tar shards and only a sample has a thumbnail, so the
gallery draws that sample, links nothing that does not exist, and says how many items the job has."""

from __future__ import annotations

import re
from urllib.parse import unquote

import pytest
from PIL import Image

from snapref_ray.report import write_report
from snapref_ray.report.gallery import page_key
from snapref_ray.storage.backends import open_storage
from snapref_ray.storage.metadata import reference_image_key, thumb_key
from snapref_ray.storage.shards import ShardWriter, commit_shard, wants_thumbnail
from tests.report.test_gallery import Dom, encode, item_colour, metadata_row

N_REFS, PER_REF, EVERY = 4, 15, 4


def write_shard_job(root, *, n_refs: int = N_REFS, per_ref: int = PER_REF, every: int = EVERY):
    """A webdataset job's output as its workers leave it: two workers' shards (ShardWriter, closed every 8 items),
    a thumbnail under thumbs/ for the items `wants_thumbnail` picks, the references' gallery copies."""
    storage = open_storage(str(root))
    writers = [ShardWriter(storage, name=f"worker-{w}", max_items=8) for w in range(2)]
    for ref in range(n_refs):
        ref_hash = f"{ref:02x}" * 32
        storage.put_bytes(reference_image_key(ref_hash), encode(Image.new("RGB", (80, 120), (90, 90, 90)), "JPEG"))
        for k in range(per_ref):
            i = ref * per_ref + k
            row = metadata_row(i, ref, per_ref)
            sampled = wants_thumbnail(row["item_id"], every)
            row.update(image_key=None, image_uri=None, thumb_key=thumb_key(row["item_id"]) if sampled else None)
            img = Image.new("RGB", (row["width"], row["height"]), item_colour(i))
            if sampled:
                storage.put_bytes(row["thumb_key"], encode(img, "JPEG"))
            writers[ref % 2].add(row, encode(img, "PNG"), "png", row["prompt"])
    for writer in writers:  # each worker stages its open shard; the driver commits what they staged
        writer.close()
        for shard in writer.drain():
            commit_shard(storage, shard.key)
    return storage


@pytest.fixture(scope="module")
def shard_job(tmp_path_factory):
    root = tmp_path_factory.mktemp("wds-job")
    storage = write_shard_job(root)
    return root, storage, write_report(str(root), page_size=5)


def test_gallery_draws_only_thumbnails_that_exist_and_links_only_objects_that_exist(shard_job):
    root, storage, result = shard_job
    stored = set(storage.list(""))  # the oracle: what the storage holds, listed apart from the gallery
    sampled = {k.removeprefix("thumbs/").removesuffix(".jpg") for k in storage.list("thumbs/")}
    n_items = N_REFS * PER_REF
    assert 0 < len(sampled) < n_items  # the sample is a real sample
    pages = [k for k in storage.list("gallery") if k.endswith(".html")]
    assert result["pages"] == len(pages) == -(-len(sampled) // 5)

    drawn, targets = [], []
    for key in pages:
        dom = Dom(storage.get_bytes(key).decode())
        drawn += [f["data-item-id"] for f in dom.find("figure", "scene")]
        targets += [img["src"] for img in dom.find("img")]
        targets += [a["href"] for a in dom.find("a") if not re.fullmatch(r"(gallery|errors)(-\d+)?\.html", a["href"])]
    assert sorted(drawn) == sorted(sampled)
    missing = sorted({unquote(t) for t in targets} - stored)
    assert missing == [], f"the gallery points at objects that do not exist: {missing[:5]}"


def test_every_page_says_the_gallery_is_a_sample_and_counts_every_item(shard_job):
    root, storage, result = shard_job
    n_items, shown = N_REFS * PER_REF, len(storage.list("thumbs/"))
    assert (result["images"], result["shown"], result["references"]) == (n_items, shown, N_REFS)
    one_in = round(n_items / shown)
    note = f"The job has {n_items:,} images; the gallery shows a sample of {shown:,}, about one in {one_in}"
    for page in range(1, result["pages"] + 1):
        html = storage.get_bytes(page_key(page)).decode()
        assert note in html
    first = storage.get_bytes(page_key(1)).decode()
    # The header counts every item, not the sample.
    assert f"<dt>images</dt><dd>{n_items}</dd>" in first and f"<dd>{shown} (a sample)</dd>" in first


def test_a_job_whose_sample_is_empty_says_how_many_images_it_has_and_not_that_it_has_none(tmp_path):
    storage = write_shard_job(tmp_path, n_refs=2, per_ref=4, every=0)  # thumbnail_every 0: no previews at all
    assert storage.list("thumbs/") == []
    result = write_report(str(tmp_path))
    assert (result["images"], result["shown"]) == (8, 0)
    html = (tmp_path / "gallery.html").read_text()
    assert "The job has 8 images and none has a preview file, so the gallery shows none" in html
    assert "No images in this job yet" not in html


def test_files_job_has_no_sample_note(tmp_path):
    from tests.report.test_gallery import write_job

    write_job(tmp_path, n_refs=2, per_ref=3, images=True)
    result = write_report(str(tmp_path))
    assert result["images"] == result["shown"] == 6
    assert 'id="sample-note"' not in (tmp_path / "gallery.html").read_text()


def test_chromium_loads_every_image_of_the_sample_gallery(shard_job):
    from tests.report import browser

    root, storage, result = shard_job
    dom = Dom(browser.dump_dom(browser.file_url(root / "gallery.html")))
    body = dom.find("body")[0]
    drawn = len(dom.find("img", "thumb")) + len(dom.find("img", "reference"))
    assert 0 < drawn and body["data-images-failed"] == "0"
    assert body["data-images-loaded"] == body["data-images-total"] and int(body["data-images-total"]) >= drawn
