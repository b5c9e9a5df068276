"""The results gallery: real job output on disk, opened in headless Chromium, and its paging."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from io import BytesIO

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image, ImageStat

from snapref_ray.report import write_report
from snapref_ray.report.gallery import THUMB_SIZE, page_key, write_gallery
from snapref_ray.report.plots import PLOT_KEYS
from snapref_ray.storage.backends import open_storage
from snapref_ray.storage.metadata import (
    METADATA_SCHEMA,
    ErrorWriter,
    MetadataWriter,
    image_key,
    reference_image_key,
    thumb_key,
    write_summary,
)
from tests.report import browser
from tests.report.test_plots import mean_line_value

T0 = 1_700_000_000.0
# A prompt that breaks out of an element, an attribute and a script if anything is left unescaped.
EVIL = """</figcaption><script>document.title="pwned"</script> & "double" 'single' <b>bold</b>"""


def item_colour(i: int) -> tuple[int, int, int]:
    """A distinct, saturated colour per item, so its thumbnail can be found in a screenshot."""
    return ((53 * i + 40) % 256, (97 * i + 160) % 256, (151 * i + 80) % 256)


def encode(img: Image.Image, fmt: str) -> bytes:
    buf = BytesIO()
    img.save(buf, format=fmt, quality=95) if fmt == "JPEG" else img.save(buf, format=fmt)
    return buf.getvalue()


def metadata_row(i: int, ref: int, per_ref: int, *, prompt: str | None = None) -> dict:
    """One METADATA_SCHEMA row: reference `ref`, scene i; 3 workers, each item takes 2 s."""
    item_id = f"item-{i:05d}"
    ref_hash = f"{ref:02x}" * 32
    started = T0 + 2.0 * (i // 3)
    row = dict.fromkeys(METADATA_SCHEMA.names)
    row.update(
        item_id=item_id,
        manifest_row=i,
        reference_uris=[f"refs/character_{ref}.png"],
        reference_hash=ref_hash,
        reference_image_key=reference_image_key(ref_hash),
        prompt=prompt if prompt is not None else f"character {ref} in scene {i % per_ref}",
        negative_prompt="blurry",
        seed=1000 + i,
        width=96,
        height=64,
        steps=8,
        cfg=4.5,
        sampler="er_sde",
        scheduler="simple",
        mode="snapref",
        ref_weight=1.0,
        ref_guidance=0.0,
        ref_in_uncond=False,
        correction="none",
        ref_start=0.0,
        ref_end=1.0,
        ref_caption="",
        settings_json="{}",
        image_key=image_key(item_id),
        image_uri=f"/out/{image_key(item_id)}",
        thumb_key=thumb_key(item_id),
        image_format="png",
        adapter="tiny-snapref",
        model="tiny-anima",
        worker_id=f"worker-{i % 3}",
        node_id="node-0",
        encode_s=0.1,
        sample_s=1.5,
        decode_s=0.2,
        upload_s=0.05,
        attempt=1,
        started_at=started,
        finished_at=started + 2.0,
    )
    return row


def write_job(root, n_refs: int, per_ref: int, *, images: bool, evil_item: int | None = None, storage=None):
    """A job's output folder as the batch job leaves it; returns (storage, metadata rows).

    Without images, returns (storage, rows, table) and writes no metadata: large-job tests pass
    the table straight to write_gallery (MetadataWriter converts row by row, too slow for 4,000).
    """
    storage = storage or open_storage(str(root))
    if not images:
        rows = [metadata_row(ref * per_ref + k, ref, per_ref) for ref in range(n_refs) for k in range(per_ref)]
        return storage, rows, pa.Table.from_pylist(rows, schema=METADATA_SCHEMA)
    rows = []
    with MetadataWriter(storage, flush_rows=1000, flush_seconds=0) as writer:
        for ref in range(n_refs):
            if images:
                grey = Image.new("RGB", (80, 120), (30 + 60 * ref, 30 + 60 * ref, 30 + 60 * ref))
                storage.put_bytes(reference_image_key(f"{ref:02x}" * 32), encode(grey, "JPEG"))
            for k in range(per_ref):
                i = ref * per_ref + k
                row = metadata_row(i, ref, per_ref, prompt=EVIL if i == evil_item else None)
                if images:
                    img = Image.new("RGB", (row["width"], row["height"]), item_colour(i))
                    storage.put_bytes(row["image_key"], encode(img, "PNG"))
                    storage.put_bytes(row["thumb_key"], encode(img, "JPEG"))
                writer.add(row)
                rows.append(row)
    return storage, rows


class Dom(HTMLParser):
    """Elements of a page as (tag, attrs) plus the text inside each figcaption."""

    def __init__(self, html: str):
        super().__init__()
        self.elements: list[tuple[str, dict]] = []
        self.captions: list[str] = []
        self._in_caption = False
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, dict(attrs)))
        if tag == "figcaption":
            self._in_caption = True
            self.captions.append("")

    def handle_endtag(self, tag):
        if tag == "figcaption":
            self._in_caption = False

    def handle_data(self, data):
        if self._in_caption:
            self.captions[-1] += data

    def find(self, tag: str, cls: str | None = None) -> list[dict]:
        return [a for t, a in self.elements if t == tag and (cls is None or cls in (a.get("class") or "").split())]


@pytest.fixture(scope="module")
def small_job(tmp_path_factory):
    """3 references x 4 images with real files, one failed item, a summary, and the report written."""
    root = tmp_path_factory.mktemp("job")
    storage, rows = write_job(root, n_refs=3, per_ref=4, images=True, evil_item=5)
    with ErrorWriter(storage, flush_seconds=0) as errors:
        errors.add(
            {
                "item_id": "item-00001",
                "manifest_row": 1,
                "error": "RayActorError: worker died",
                "stage": "sample",
                "attempt": 1,
                "at": T0 + 3,
            }
        )  # retried and succeeded: not failed
        errors.add(
            {
                "item_id": "item-00012",
                "manifest_row": 12,
                "error": 'ValueError: <bad> & "size"',
                "stage": "sample",
                "attempt": 1,
                "at": T0 + 5,
            }
        )
        errors.add(
            {
                "item_id": "item-00012",
                "manifest_row": 12,
                "error": "ValueError: still <bad>",
                "stage": "sample",
                "attempt": 2,
                "at": T0 + 9,
            }
        )
        errors.add(
            {
                "item_id": None,
                "manifest_row": 13,
                "error": "field 'prompt': empty",
                "stage": "validate",
                "attempt": 1,
                "at": T0,
            }
        )
    write_summary(
        storage,
        {
            "images_this_run": 12,
            "wall_seconds": 20.0,
            "images_per_hour": 2160.0,
            "encodes_per_reference": 1.0,
            "failed_items": 1,
            "scheduler": {"done_items": 12},
        },
    )
    result = write_report(str(root))
    return root, rows, result


def test_write_report_result(small_job):
    root, rows, result = small_job
    assert (result["gallery"], result["pages"]) == (str(root / "gallery.html"), 1)
    assert result["errors_page"] == str(root / "errors.html")
    assert result["plots"] == {name: str(root / key) for name, key in PLOT_KEYS.items()}
    assert (result["images"], result["references"], result["invalid_rows"], result["failed_items"]) == (12, 3, 1, 1)
    assert all((root / key).is_file() for key in PLOT_KEYS.values())


def test_gallery_in_chromium_shows_every_reference_and_loads_every_thumbnail(small_job):
    root, rows, _ = small_job
    dom = Dom(browser.dump_dom(browser.file_url(root / "gallery.html")))
    body = dom.find("body")[0]
    # 3 reference images + 12 thumbnails, all decoded by the browser (naturalWidth > 0).
    assert (body["data-images-total"], body["data-images-loaded"], body["data-images-failed"]) == ("15", "15", "0")
    assert body.get("data-all-images-loaded") == "true"

    sections = dom.find("section", "ref")
    assert [s["data-reference-hash"] for s in sections] == [f"{r:02x}" * 32 for r in range(3)]
    assert [img["src"] for img in dom.find("img", "reference")] == [
        f"references/{s['data-reference-hash']}.jpg" for s in sections
    ]
    figures = dom.find("figure", "scene")
    assert [f["data-item-id"] for f in figures] == [r["item_id"] for r in rows]
    thumbs = dom.find("img", "thumb")
    assert [t["src"] for t in thumbs] == [f"thumbs/{r['item_id']}.jpg" for r in rows]
    assert [t["loading"] for t in thumbs] == ["lazy"] * 12
    assert (thumbs[0]["width"], thumbs[0]["height"]) == (str(THUMB_SIZE), "171")  # aspect of 96x64
    links = [a["href"] for a in dom.find("a") if a.get("href", "").startswith("images/")]
    assert links == [f"images/{r['item_id']}.png" for r in rows]
    # Seed and settings on hover; the prompt as caption, the hostile one as inert text.
    assert figures[0]["title"].splitlines()[:2] == [
        "item item-00000 · seed 1000",
        "96×64 · steps 8 · cfg 4.5 · er_sde/simple",
    ]
    assert dom.captions[5] == EVIL and dom.captions[0] == "character 0 in scene 0"
    assert dom.find("b") == [] and len(dom.find("script")) == 1
    # Header links to the plots; the failed items are the two without an image, last attempt shown.
    assert [a["href"] for a in dom.find("a") if a.get("href", "").startswith("report/")] == [
        "report/throughput.svg",
        "report/workers.svg",
        "report/latency.svg",
        "report/throughput.svg",
        "report/workers.svg",
        "report/latency.svg",
    ]  # text links, then previews
    failed = [tr.get("data-item-id") for tr in dom.find("tr") if "data-item-id" in tr]
    assert failed == ["item-00012", ""]


def test_gallery_source_escapes_user_strings(small_job):
    root, _, _ = small_job
    html = (root / "gallery.html").read_text()
    # Jinja2's autoescaping (markupsafe) writes a double quote as &#34; where html.escape wrote &quot;.
    assert "&lt;/figcaption&gt;&lt;script&gt;document.title=&#34;pwned&#34;&lt;/script&gt; &amp; " in html
    assert "<script>document.title" not in html
    assert "ValueError: still &lt;bad&gt;" in html and "RayActorError" not in html


def test_gallery_screenshot_shows_the_images(small_job, tmp_path):
    root, rows, _ = small_job
    shot = browser.screenshot(
        browser.file_url(root / "gallery.html"), tmp_path / "gallery.png", window_size=(1280, 1000)
    )
    img = Image.open(shot).convert("RGB")
    assert img.size == (1280, 1000)
    assert max(ImageStat.Stat(img).stddev) > 20  # not a blank page
    # The first reference's four thumbnails are on screen, each as a sizeable block of its colour.
    pixels = np.asarray(img, dtype=np.int32)
    for i in range(4):
        near = int((np.abs(pixels - np.array(item_colour(i))).sum(axis=-1) <= 12).sum())
        assert near > 5000, f"thumbnail of item {i} (colour {item_colour(i)}) not in the screenshot: {near} px"


def test_large_job_pages_stay_small_and_link_to_each_other(tmp_path):
    storage, rows, table = write_job(tmp_path / "job", n_refs=37, per_ref=54, images=False)  # 1,998 items
    storage_big, _, table_big = write_job(tmp_path / "big", n_refs=74, per_ref=54, images=False)  # 3,996
    keys = write_gallery(storage, table, page_size=200)
    assert keys == [page_key(p) for p in range(1, 11)]
    pages = [storage.get_bytes(k).decode() for k in keys]

    first = Dom(pages[0])
    assert len(first.find("figure", "scene")) == 200 and len(first.find("img", "thumb")) == 200
    assert len(pages[0].encode()) < 20_000 + 800 * 200
    # Page 1 does not grow with the job: twice the items, the same bytes up to the page count.
    write_gallery(storage_big, table_big, page_size=200)
    assert abs(len(storage_big.get_bytes("gallery.html")) - len(pages[0].encode())) < 64

    # Every item exactly once over the pages, in manifest order; a reference split over pages says so.
    ids = [f["data-item-id"] for page in pages for f in Dom(page).find("figure", "scene")]
    assert ids == [r["item_id"] for r in rows]
    # Reference 3 has items 162-215: 38 on page 1, the other 16 on page 2.
    assert "images 1–38 of 54" in pages[0] and "images 39–54 of 54" in pages[1]

    def rel(html: str, kind: str) -> list[str]:
        return [a["href"] for a in Dom(html).find("a") if a.get("rel") == kind]

    assert (rel(pages[0], "prev"), rel(pages[0], "next")) == ([], ["gallery-2.html", "gallery-2.html"])
    assert (rel(pages[1], "prev"), rel(pages[1], "next")) == (["gallery.html"] * 2, ["gallery-3.html"] * 2)
    assert (rel(pages[9], "prev"), rel(pages[9], "next")) == (["gallery-9.html"] * 2, [])
    # The pager shows a fixed window around the current page, and a box to jump anywhere.
    page5 = {a["href"] for a in Dom(pages[4]).find("a") if a["href"].startswith("gallery")}
    assert page5 == {page_key(p) for p in (1, 2, 3, 4, 6, 7, 8, 10)}
    assert Dom(pages[4]).find("input") and Dom(pages[4]).find("body")[0]["data-pages"] == "10"


def test_rewrite_with_fewer_pages_deletes_stale_pages(tmp_path):
    storage, _, table = write_job(tmp_path / "job", n_refs=5, per_ref=10, images=False)
    assert write_gallery(storage, table, page_size=10)[-1] == "gallery-5.html"
    assert write_gallery(storage, table.slice(0, 25), page_size=10) == [page_key(p) for p in (1, 2, 3)]
    assert [k for k in storage.list("gallery") if k.endswith(".html")] == [
        "gallery-2.html",
        "gallery-3.html",
        "gallery.html",
    ]


def test_empty_job_still_writes_a_page(tmp_path):
    storage = open_storage(str(tmp_path / "job"))
    assert write_gallery(storage) == ["gallery.html"]
    html = storage.get_bytes("gallery.html").decode()
    assert "No images in this job yet." in html
    assert Dom(html).find("body")[0]["data-pages"] == "1" and Dom(html).find("figure") == []


def test_report_on_s3_serves_as_a_static_site(s3_server):
    """On S3 the pages carry the content types a static website needs, and every link is relative."""
    uri = f"s3://{s3_server.bucket}/report-test/job"
    storage = open_storage(uri, s3_server.s3_options())
    _, rows, table = write_job(None, n_refs=2, per_ref=3, images=False, storage=storage)
    with MetadataWriter(storage, flush_seconds=0) as writer:
        for row in rows:
            writer.add(row)
    result = write_report(uri, s3_server.s3_options(), page_size=4)
    assert (result["gallery"], result["pages"], result["images"]) == (f"{uri}/gallery.html", 2, 6)

    client = s3_server.client()

    def content_type(key: str) -> str:
        return client.head_object(Bucket=s3_server.bucket, Key=f"report-test/job/{key}")["ContentType"]

    assert content_type("gallery.html") == content_type("gallery-2.html") == "text/html; charset=utf-8"
    assert {content_type(key) for key in PLOT_KEYS.values()} == {"image/svg+xml"}
    dom = Dom(storage.get_bytes("gallery.html").decode())
    urls = [a.get("href") or a.get("src") for t, a in dom.elements if t in ("a", "img")]
    # 4 scenes (link + thumbnail), 2 references (link + image), 3 plots (link, then link + preview),
    # pager above and below (page 2, next).
    assert len(urls) == 4 * 2 + 2 * 2 + 3 * 3 + 2 * 2
    assert all(u and "://" not in u and not u.startswith("/") for u in urls)


def header_facts(html: str) -> list[tuple[str, str]]:
    """(label, value) of the header's fact lists, without the "all of summary.json" dump."""
    header = html.split('<details class="summary">', 1)[0].split("</header>", 1)[0]
    return re.findall(r"<dt>(.*?)</dt><dd>(.*?)</dd>", header)


def test_header_shows_one_labelled_throughput_the_charts_mean_line(small_job):
    root, _, _ = small_job
    facts = header_facts((root / "gallery.html").read_text())
    rates = [(label, value) for label, value in facts if re.search(r"throughput|/ ?(min|hour)|per_", label + value)]
    # 12 images, the first started at T0 and the last finished at T0 + 8 s: 90 images per minute. The
    # summary's own figure (images_per_hour 2160, wall time) is no second throughput beside it.
    assert rates == [("throughput", "90 images / min")]
    assert ("rendering time", "8.0 s") in facts
    assert mean_line_value((root / "report/throughput.svg").read_text()) == pytest.approx(90, rel=1e-3)
    # What the output left out, in the terminal's and summary.json's words: the validate-stage row is an invalid
    # row, the item whose last attempt failed a failed item (the one that failed once, then rendered, is neither).
    assert ("invalid rows", "1") in facts and ("failed items", "1") in facts
    assert not [label for label, _ in facts if label == "failed"]


def test_after_an_append_the_throughput_divides_by_the_runs_rendering_time(tmp_path):
    """Two runs (a job, then one appended an hour later): images over the sum of the runs' rendering times, not
    over the span from the first image to the last, which holds the hour between them."""
    storage, rows, table = write_job(tmp_path / "job", n_refs=2, per_ref=6, images=False)
    later = [dict(r, started_at=r["started_at"] + 3600, finished_at=r["finished_at"] + 3600) for r in rows[8:]]
    table = pa.Table.from_pylist(rows[:8] + later, schema=METADATA_SCHEMA)
    runs = [
        {"job": "a", "images": 8, "items_to_render": 8, "render_seconds": 6.0, "wall_seconds": 9.0},
        {"job": "b", "images": 4, "items_to_render": 4, "render_seconds": 2.0, "wall_seconds": 5.0},
        {"job": "a", "images": 0, "items_to_render": 0, "render_seconds": 0.0, "wall_seconds": 1.0},  # a resume
    ]
    write_gallery(storage, table, summary={"runs": runs, "images_total": 12})
    html = storage.get_bytes("gallery.html").decode()
    facts = header_facts(html)
    assert ("throughput", "90 images / min") in facts and ("rendering time", "8.0 s") in facts  # 12 in 8 s
    assert "12 images in 8.0 s over 2 runs" in html


def test_runs_of_summary_json_are_a_table_and_odd_entries_do_not_fail_the_page(tmp_path):
    storage, _, table = write_job(tmp_path / "job", n_refs=1, per_ref=2, images=False)
    runs = [
        # As the job's typed summary writes a run (snapref_ray.jobs.job_summary's RunFigures).
        {
            "started_at": T0,
            "finished_at": T0 + 30,
            "items_to_render": 9,
            "images": 8,
            "failed_items": 1,
            "interrupted": False,
            "wall_seconds": 30.0,
            "startup_seconds": 12.0,
            "render_seconds": 16.0,
        },
        {"images": 4, "interrupted": True},  # no timings
        "not a run",  # skipped
        {"images": EVIL, "render_seconds": "fast"},  # odd values show as "–"
    ]
    write_gallery(storage, table, summary={"runs": runs, "manifest": EVIL, "wall_seconds": 46.0})
    html = storage.get_bytes("gallery.html").decode()
    body = html.split('<details class="runs" open>', 1)[1].split("</details>", 1)[0]
    cells = [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", body)[1:]]
    assert cells == [
        ["1", "2023-11-14 22:13:20", "8", "1", "30 s", "12 s", "16 s", "30", "no"],  # 8 images in 16 s
        ["2", "–", "4", "–", "–", "–", "–", "–", "yes"],
        ["3", "–", "–", "–", "–", "–", "–", "–", "–"],
    ]
    # The top-level wall time is the job's when runs exist: no "last run" wall time beside the table.
    assert ("wall time", "46 s") not in header_facts(html)
    # The summary's strings reach the page as text only (the "all of summary.json" facts).
    dom = Dom(html)
    assert dom.find("b") == [] and len(dom.find("script")) == 1
    assert "manifest</dt><dd>&lt;/figcaption&gt;&lt;script&gt;" in html
    # Without runs (an older summary.json, or none), no table and no failure.
    write_gallery(storage, table, summary={"images_per_hour": 0.0})
    assert 'class="runs"' not in storage.get_bytes("gallery.html").decode()


def test_hostile_file_names_and_ids_stay_inert(tmp_path):
    storage = open_storage(str(tmp_path / "job"))
    row = metadata_row(0, 0, 1)
    row.update(
        item_id='"><script>alert(1)</script>',
        reference_uris=["refs/<img src=x onerror=alert(2)>.png"],
        image_key="javascript:alert(3)//.png",
        thumb_key='thumbs/" onerror="alert(4).jpg',
    )
    write_gallery(storage, pa.Table.from_pylist([row], schema=METADATA_SCHEMA))
    html = storage.get_bytes("gallery.html").decode()
    dom = Dom(html)
    assert len(dom.find("script")) == 1 and all("onerror" not in attrs for _, attrs in dom.elements)
    urls = [a.get("href") or a.get("src") for t, a in dom.elements if t in ("a", "img")]
    assert "javascript%3Aalert%283%29//.png" in urls and "thumbs/%22%20onerror%3D%22alert%284%29.jpg" in urls
    assert all(":" not in u for u in urls)  # relative, no scheme
    assert [f["data-item-id"] for f in dom.find("figure", "scene")] == ['"><script>alert(1)</script>']
    assert "&lt;img src=x onerror=alert(2)&gt;.png</p>" in html
