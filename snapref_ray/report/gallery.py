"""The results gallery of a batch job: static HTML pages next to the job's output.

``gallery.html`` (page 1), ``gallery-2.html``, ... show one row per reference: the reference
image (``references/{hash}.jpg``), then its generated scenes as thumbnails (``thumbs/...``)
linking to the full images (``images/...``), the prompt as caption and the seed and settings
on hover. Page 1 has a header with counts and the job's one throughput figure (images per
minute while rendering, as the throughput chart's mean line), the runs ``summary.json``
records, links to the report plots and the rows not rendered (invalid rows and failed items); every one is
listed on ``errors.html``, ``errors-2.html``, ...

The pages are Jinja2 templates (``templates/``) rendered with autoescaping, so a prompt, a
file name or an error message is always text, never markup; storage keys become relative URLs
through the ``relurl`` filter. This module only prepares what the templates show.

Why static pages and not one page with a data file: browsers block ``fetch()`` of local
files, and the gallery must open from a local folder (``file://``) as well as from S3 static
hosting. So every page is self-contained HTML with relative links only, no external
resources (the stylesheet and script in ``static/`` are inlined), and holds ``page_size``
items: its size does not grow with the job (the pager shows a fixed window of page links),
thumbnails load lazily, and 60,000 images open as fast as 200. The job's rows are read a page at a
time (report/rows.py), so writing the pages of a million items holds a few columns of each, not
every row. A webdataset job has previews for a sample of its items only: the gallery draws that
sample and says so on every page. The small script counts
loaded images into ``body[data-images-loaded]`` (used by the browser tests) and drives the
"go to page" box.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from urllib.parse import quote

import jinja2
import pyarrow as pa
from markupsafe import Markup

from snapref_ray.report.header import page_header, sample_note
from snapref_ray.report.items import THUMB_SIZE, FailedItem, GalleryItem, clip, failed_items, gallery_item
from snapref_ray.report.plots import PLOT_KEYS
from snapref_ray.report.rows import JobRows
from snapref_ray.storage import metadata

__all__ = ["DEFAULT_TITLE", "THUMB_SIZE", "FailedItem", "errors_page_key", "failed_items", "page_key", "write_gallery"]

DEFAULT_TITLE = "snapref-ray results"
# Items of the errors preview on page 1; the rest are on the errors pages.
_ERRORS_PREVIEW = 20
# Page links either side of the current page; the pager's size does not grow with the job.
_PAGER_WINDOW = 3
_HTML = "text/html; charset=utf-8"


def page_key(page: int) -> str:
    """Storage key of gallery page ``page`` (1-based): ``gallery.html``, ``gallery-2.html``..."""
    return "gallery.html" if page == 1 else f"gallery-{page}.html"


def errors_page_key(page: int) -> str:
    """Storage key of errors page ``page`` (1-based): ``errors.html``, ``errors-2.html``..."""
    return "errors.html" if page == 1 else f"errors-{page}.html"


def write_gallery(
    storage,
    table: pa.Table | JobRows | None = None,
    *,
    page_size: int = 200,
    title: str = DEFAULT_TITLE,
    errors: pa.Table | None = None,
    summary: Mapping | None = None,
    plot_keys: Mapping[str, str] | None = None,
    judging=None,
) -> list[str]:
    """Write the gallery pages of a job's output; returns the keys written, page 1 first.

    ``storage`` is the job's :class:`~snapref_ray.storage.backends.Storage`. ``table`` (a
    metadata table, or the :class:`~snapref_ray.report.rows.JobRows` of one), ``errors`` and
    ``summary`` default to what the storage holds (metadata parts, read page by page; errors
    parts; ``summary.json``). ``errors`` may hold rows of items that later succeeded: they are
    left out. ``plot_keys`` (name -> key) are linked from the header; by default the plots of
    :data:`~snapref_ray.report.plots.PLOT_KEYS` that exist. The gallery pages come first in the
    returned list, then the errors pages (if any). Pages left over from an earlier run with more
    pages are deleted. Only items with a preview file are drawn (report/rows.py). ``judging`` (a judged job's
    `report.judging.JudgeReport`) puts its counts and cost per kept image in the header; a rejected render's tile
    is marked either way.
    """
    if page_size < 1:
        raise ValueError(f"write_gallery: page_size must be >= 1, got {page_size}")
    if table is None:
        rows = JobRows.from_storage(storage)
    elif isinstance(table, JobRows):
        rows = table
    else:
        rows = JobRows.from_table(table)
    done = rows.keys.column("item_id")
    if errors is None:
        errors = metadata.read_errors_table(storage, exclude_ids=done)
    else:
        errors = metadata.without_items(errors, done)
    if summary is None:
        summary = metadata.read_summary(storage)
    if plot_keys is None:
        plot_keys = {name: key for name, key in PLOT_KEYS.items() if storage.exists(key)}
    failed = failed_items(errors, set())
    n_pages = max(1, math.ceil(rows.n_shown / page_size))
    n_error_pages = math.ceil(len(failed) / page_size)
    common = {
        "title": title,
        "home": page_key(1),
        "errors_page_1": errors_page_key(1),
        "n_items": rows.n_shown,
        "n_failed": len(failed),
        "sample_note": sample_note(rows),
    }

    written = []
    for page in range(1, n_pages + 1):
        offset = (page - 1) * page_size
        chunk = [gallery_item(r) for r in rows.page(offset, offset + page_size).to_pylist()]
        html = _render(
            "gallery.html.j2",
            **common,
            page_title=f"{title} — page {page} of {n_pages}",
            page=page,
            n_pages=n_pages,
            prefix="gallery",
            header=page_header(rows, failed, summary or {}, plot_keys, n_pages, judging) if page == 1 else None,
            pager=_Pager.of(page, n_pages, page_key),
            rows=_reference_rows(chunk, rows.reference_run, offset),
            failed_preview=failed[:_ERRORS_PREVIEW] if page == 1 else [],
        )
        storage.put_bytes(page_key(page), html.encode("utf-8"), content_type=_HTML)
        written.append(page_key(page))

    for page in range(1, n_error_pages + 1):
        html = _render(
            "errors.html.j2",
            **common,
            page_title=f"{title} — not rendered, page {page}",
            page=page,
            n_pages=n_error_pages,
            prefix="errors",
            pager=_Pager.of(page, n_error_pages, errors_page_key),
            failed=failed[(page - 1) * page_size : page * page_size],
        )
        storage.put_bytes(errors_page_key(page), html.encode("utf-8"), content_type=_HTML)
        written.append(errors_page_key(page))
    _delete_stale_pages(storage, n_pages, n_error_pages)
    return written


def _delete_stale_pages(storage, n_pages: int, n_error_pages: int) -> None:
    """Remove pages a larger earlier run left (a re-run after more failures were retried)."""
    stale = [k for k in storage.list("gallery-") if _page_number(k, "gallery") > n_pages]
    stale += [k for k in storage.list("errors-") if _page_number(k, "errors") > n_error_pages]
    if n_error_pages == 0 and storage.exists(errors_page_key(1)):
        stale.append(errors_page_key(1))
    for key in stale:
        storage.delete(key)


def _page_number(key: str, prefix: str) -> int:
    m = re.fullmatch(rf"{prefix}-(\d+)\.html", key)
    return int(m.group(1)) if m else 0


# ----------------------------------------------------------------------------- what the pages show


@dataclass(frozen=True)
class _PageLink:
    number: int
    gap_before: bool  # pages left out between this link and the one before


@dataclass(frozen=True)
class _Pager:
    page: int
    n_pages: int
    key: Callable[[int], str]
    shown: list[_PageLink]
    jump: bool  # a "go to page" box, when some pages have no link

    @classmethod
    def of(cls, page: int, n_pages: int, key: Callable[[int], str]) -> _Pager:
        numbers = sorted({1, n_pages, *range(max(1, page - _PAGER_WINDOW), min(n_pages, page + _PAGER_WINDOW) + 1)})
        shown = [_PageLink(p, gap_before=p > prev + 1) for prev, p in zip([0, *numbers], numbers)]
        return cls(page, n_pages, key, shown, jump=n_pages > len(numbers))


@dataclass(frozen=True)
class _ReferenceRow:
    reference_hash: str
    reference_key: str
    count: str  # "4 images", or "images 39–54 of 54" where the reference spans pages
    source: str  # file name of its first source
    more: str  # " +2" when it has several sources
    all_sources: str
    items: Sequence[GalleryItem]
    scenes: Markup  # the items' tiles (scene_html)


def _reference_rows(
    chunk: Sequence[GalleryItem], run_of: Callable[[int], tuple[int, int]], offset: int
) -> list[_ReferenceRow]:
    """One row per run of items of the same reference on this page.

    ``run_of`` maps a position of the whole gallery order to (position of its reference's first
    item, that reference's item count), so a reference whose images span pages says which of them
    a page shows.
    """
    rows = []
    i = 0
    while i < len(chunk):
        h = chunk[i].reference_hash
        j = i
        while j < len(chunk) and chunk[j].reference_hash == h:
            j += 1
        first, total = run_of(offset + i)
        rows.append(_reference_row(chunk[i:j], offset + i - first, total))
        i = j
    return rows


def _reference_row(items: Sequence[GalleryItem], start: int, total: int) -> _ReferenceRow:
    it = items[0]
    uris = it.reference_uris
    return _ReferenceRow(
        reference_hash=it.reference_hash,
        reference_key=it.reference_key,
        count=(
            f"{total} image{'s' if total != 1 else ''}"
            if len(items) == total
            else f"images {start + 1}–{start + len(items)} of {total}"
        ),
        source=clip(uris[0].rstrip("/").rsplit("/", 1)[-1], 80) if uris else "",
        more=f" +{len(uris) - 1}" if len(uris) > 1 else "",
        all_sources=clip("\n".join(uris[:8]), 2000),
        items=items,
        scenes=Markup("").join(scene_html(item) for item in items),
    )


def scene_html(it: GalleryItem) -> Markup:
    """One tile: the thumbnail linked to the image, the prompt as caption, id and settings on hover.

    Built here rather than in a template macro (a million tiles in a million-item job); every value is
    escaped, and keys become relative URLs through `_relurl` as in the templates."""
    item_id = _escape(it.item_id)
    # A judged job's rejected render stands beside the kept ones, marked (class and badge name its checks).
    rejected = it.verdict.startswith("rejected")
    css = "scene rejected" if rejected else "scene"
    badge = f'<span class="verdict">{_escape(it.verdict)}</span>' if rejected else ""
    return Markup(
        f'<figure class="{css}" data-item-id="{item_id}" data-verdict="{_escape(it.verdict)}"'
        f' title="{_escape(it.settings)}">'
        f'<a href="{_escape(_relurl(it.image_key))}"><img class="thumb" src="{_escape(_relurl(it.thumb_key))}"'
        f' width="{int(it.thumb_w)}" height="{int(it.thumb_h)}" loading="lazy" decoding="async" alt="{item_id}"></a>'
        f"<figcaption>{badge}{_escape(it.prompt)}</figcaption></figure>"
    )


# ----------------------------------------------------------------------------- rendering


def _relurl(key: str) -> str:
    """A key relative to the job root as a relative URL (works on file:// and S3).

    ``:`` is percent-encoded too, so no key (an item id is part of one) reads as a scheme such
    as ``javascript:``; the template's autoescaping then makes it a safe attribute value.
    """
    return key if _PLAIN_KEY(key) else quote(key, safe="/-_.~")


# A key made only of characters `quote` leaves alone is its own URL (most keys: thumbs/<id>.jpg).
_PLAIN_KEY = re.compile(r"[A-Za-z0-9/_.~-]*\Z").match


def _escape(text: str) -> str:
    """HTML-escape `text` as markupsafe (the templates' autoescaping) does, without a Markup object per value."""
    return (
        text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&#34;").replace("'", "&#39;")
    )


@functools.cache
def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("snapref_ray.report", "templates"),
        autoescape=True,  # every page is HTML: every value is escaped unless marked safe here
        undefined=jinja2.StrictUndefined,  # a misspelt name in a template fails the tests, not a page
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["relurl"] = _relurl
    static = resources.files("snapref_ray.report") / "static"
    # Our own files, inlined as they are (escaping would break the CSS and the script).
    env.globals["css"] = Markup((static / "gallery.css").read_text(encoding="utf-8"))
    env.globals["js"] = Markup((static / "gallery.js").read_text(encoding="utf-8"))
    return env


def _render(template: str, **context) -> str:
    return _environment().get_template(template).render(**context)
