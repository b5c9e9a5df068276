"""The results gallery of a batch job: static HTML pages next to the job's output.

``gallery.html`` (page 1), ``gallery-2.html``, ... show one row per reference: the reference
image (``references/{hash}.jpg``), then its generated scenes as thumbnails (``thumbs/...``)
linking to the full images (``images/...``), the prompt as caption and the seed and settings
on hover. Page 1 has a header with counts and throughput (``summary.json`` when present,
else computed from the metadata), links to the report plots and the failed items; every
failed item is listed on ``errors.html``, ``errors-2.html``, ...

Why static pages and not one page with a data file: browsers block ``fetch()`` of local
files, and the gallery must open from a local folder (``file://``) as well as from S3 static
hosting. So every page is self-contained HTML with relative links only, no external
resources, and holds ``page_size`` items: its size does not grow with the job (the pager
shows a fixed window of page links), thumbnails load lazily, and 60,000 images open as
fast as 200. A small inline script counts loaded images into ``body[data-images-loaded]``
(used by the browser tests) and drives the "go to page" box.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from html import escape
from urllib.parse import quote

import pyarrow as pa

from snapref_ray.report.plots import PLOT_KEYS, format_duration
from snapref_ray.storage import metadata

__all__ = ["DEFAULT_TITLE", "THUMB_SIZE", "FailedItem", "errors_page_key", "failed_items", "page_key", "write_gallery"]

DEFAULT_TITLE = "snapref-ray results"
#: Longest side of the thumbnails the sink writes under ``thumbs/``.
THUMB_SIZE = 256
# Items of the errors preview on page 1; the rest are on the errors pages.
_ERRORS_PREVIEW = 20
# Page links either side of the current page; the pager's size does not grow with the job.
_PAGER_WINDOW = 3
# User strings are capped so one pathological prompt cannot make a page heavy; the full
# text stays in the Parquet metadata and in the image's PNG chunks.
_MAX_PROMPT = 1200
_MAX_ERROR = 2000

_META_COLUMNS = (
    "item_id",
    "manifest_row",
    "reference_uris",
    "reference_hash",
    "reference_image_key",
    "prompt",
    "negative_prompt",
    "seed",
    "width",
    "height",
    "steps",
    "cfg",
    "sampler",
    "scheduler",
    "mode",
    "ref_weight",
    "ref_guidance",
    "ref_in_uncond",
    "correction",
    "ref_start",
    "ref_end",
    "image_key",
    "thumb_key",
    "adapter",
    "worker_id",
    "sample_s",
    "started_at",
    "finished_at",
)


def page_key(page: int) -> str:
    """Storage key of gallery page ``page`` (1-based): ``gallery.html``, ``gallery-2.html``..."""
    return "gallery.html" if page == 1 else f"gallery-{page}.html"


def errors_page_key(page: int) -> str:
    """Storage key of errors page ``page`` (1-based): ``errors.html``, ``errors-2.html``..."""
    return "errors.html" if page == 1 else f"errors-{page}.html"


def write_gallery(
    storage,
    table: pa.Table | None = None,
    *,
    page_size: int = 200,
    title: str = DEFAULT_TITLE,
    errors: pa.Table | None = None,
    summary: Mapping | None = None,
    plot_keys: Mapping[str, str] | None = None,
) -> list[str]:
    """Write the gallery pages of a job's output; returns the keys written, page 1 first.

    ``storage`` is the job's :class:`~snapref_ray.storage.backends.Storage`. ``table``,
    ``errors`` and ``summary`` default to what the storage holds (metadata parts, errors
    parts, ``summary.json``). ``plot_keys`` (name -> key) are linked from the header;
    by default the plots of :data:`~snapref_ray.report.plots.PLOT_KEYS` that exist.
    The gallery pages come first in the returned list, then the errors pages (if any).
    Pages left over from an earlier run with more pages are deleted.
    """
    if page_size < 1:
        raise ValueError(f"write_gallery: page_size must be >= 1, got {page_size}")
    if table is None:
        table = metadata.read_metadata_table(storage)
    items = _items(table)
    groups = _groups(items)
    done = {it.item_id for it in items}
    if errors is None:
        errors = metadata.read_errors_table(storage, exclude_ids=done)
    if summary is None:
        summary = metadata.read_summary(storage)
    if plot_keys is None:
        plot_keys = {name: key for name, key in PLOT_KEYS.items() if storage.exists(key)}
    failed = failed_items(errors, done)
    n_pages = max(1, math.ceil(len(items) / page_size))
    n_error_pages = math.ceil(len(failed) / page_size)
    header = _header(title, items, failed, summary or {}, plot_keys, n_pages)

    written = []
    for page in range(1, n_pages + 1):
        chunk = items[(page - 1) * page_size : page * page_size]
        body = [header if page == 1 else _small_header(title, len(items), page, n_pages)]
        body.append(_pager(page, n_pages, page_key))
        body.append('<main id="gallery">')
        body += _reference_rows(chunk, groups, page_size * (page - 1))
        if not items:
            body.append('<p class="empty">No images in this job yet.</p>')
        body.append("</main>")
        if page == 1 and failed:
            body.append(_errors_section(failed[:_ERRORS_PREVIEW], len(failed), preview=True))
        body.append(_pager(page, n_pages, page_key))
        html = _document(f"{title} — page {page} of {n_pages}", body, page, n_pages, "gallery")
        storage.put_bytes(page_key(page), html.encode("utf-8"), content_type="text/html; charset=utf-8")
        written.append(page_key(page))

    for page in range(1, n_error_pages + 1):
        chunk = failed[(page - 1) * page_size : page * page_size]
        body = [
            _small_header(f"{title}: failed items", len(items), page, n_error_pages),
            _pager(page, n_error_pages, errors_page_key),
            _errors_section(chunk, len(failed), preview=False),
            _pager(page, n_error_pages, errors_page_key),
        ]
        html = _document(f"{title} — failed items, page {page}", body, page, n_error_pages, "errors")
        storage.put_bytes(errors_page_key(page), html.encode("utf-8"), content_type="text/html; charset=utf-8")
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


# ----------------------------------------------------------------------------- data


@dataclass(frozen=True)
class _Item:
    item_id: str
    order: tuple
    reference_hash: str
    reference_key: str
    reference_uris: tuple[str, ...]
    image_key: str
    thumb_key: str
    prompt: str
    settings: str  # hover text
    thumb_w: int
    thumb_h: int
    started_at: float | None
    finished_at: float | None
    worker_id: str | None


def _items(table: pa.Table) -> list[_Item]:
    """One item per metadata row, ordered by reference (first manifest row) then row."""
    cols = [c for c in _META_COLUMNS if c in table.column_names]
    rows = table.select(cols).to_pylist()
    first_row: dict[str, float] = {}
    for r in rows:
        h = str(r.get("reference_hash") or "")
        first_row[h] = min(first_row.get(h, math.inf), _row_number(r))
    items = []
    for r in rows:
        h = str(r.get("reference_hash") or "")
        image_key = str(r.get("image_key") or "")
        w, hgt = r.get("width"), r.get("height")
        scale = THUMB_SIZE / max(w, hgt) if isinstance(w, int) and isinstance(hgt, int) and w > 0 and hgt > 0 else 0
        items.append(
            _Item(
                item_id=str(r.get("item_id") or ""),
                order=(first_row[h], h, _row_number(r), str(r.get("item_id") or "")),
                reference_hash=h,
                reference_key=str(r.get("reference_image_key") or f"references/{h}.jpg"),
                reference_uris=tuple(str(u) for u in (r.get("reference_uris") or ())),
                image_key=image_key,
                thumb_key=str(r.get("thumb_key") or image_key),
                prompt=_clip(str(r.get("prompt") or ""), _MAX_PROMPT),
                settings=_settings_text(r),
                thumb_w=round(w * scale) if scale else THUMB_SIZE,
                thumb_h=round(hgt * scale) if scale else THUMB_SIZE,
                started_at=r.get("started_at"),
                finished_at=r.get("finished_at"),
                worker_id=r.get("worker_id"),
            )
        )
    items.sort(key=lambda it: it.order)
    return items


def _row_number(r: Mapping) -> float:
    v = r.get("manifest_row")
    return float(v) if isinstance(v, (int, float)) else math.inf


def _settings_text(r: Mapping) -> str:
    """The hover text of a thumbnail: id, seed and every setting that is set."""

    def num(v) -> str:
        return f"{v:g}" if isinstance(v, float) else str(v)

    def join(*parts: str | None) -> str:
        return " · ".join(p for p in parts if p)

    def field(label: str, key: str) -> str | None:
        v = r.get(key)
        return f"{label} {num(v)}" if v is not None and v != "" else None

    size = f"{r['width']}×{r['height']}" if r.get("width") and r.get("height") else None
    sampler = "/".join(str(r[k]) for k in ("sampler", "scheduler") if r.get(k))
    ref_range = (
        f"ref range {num(r['ref_start'])}–{num(r['ref_end'])}"
        if r.get("ref_start") is not None and r.get("ref_end") is not None
        else None
    )
    lines = [
        join(f"item {r.get('item_id')}", field("seed", "seed")),
        join(size, field("steps", "steps"), field("cfg", "cfg"), sampler or None),
        join(
            field("mode", "mode"),
            field("ref weight", "ref_weight"),
            field("ref guidance", "ref_guidance"),
            "ref in uncond" if r.get("ref_in_uncond") else None,
            field("correction", "correction"),
            ref_range,
        ),
        join(
            field("adapter", "adapter"),
            field("worker", "worker_id"),
            f"sampling {r['sample_s']:.2f} s" if isinstance(r.get("sample_s"), float) else None,
        ),
    ]
    if r.get("negative_prompt"):
        lines.append("negative: " + _clip(str(r["negative_prompt"]), 300))
    return "\n".join(line for line in lines if line)


@dataclass(frozen=True)
class FailedItem:
    """The last recorded error of an item that produced no image (``item_id`` "" if unknown)."""

    item_id: str
    manifest_row: object
    stage: str
    attempt: object
    at: str
    error: str


def failed_items(errors: pa.Table | None, done: set[str]) -> list[FailedItem]:
    """Items that failed for good: the last error of each id that never produced an image.

    An item that failed once and succeeded on a retry has an error row and a metadata row;
    it is not a failed item. Rows without an id (a manifest row that could not be parsed)
    are all kept.
    """
    if errors is None or errors.num_rows == 0:
        return []
    last: dict[object, Mapping] = {}
    for i, r in enumerate(errors.to_pylist()):
        item_id = r.get("item_id")
        if item_id is not None and str(item_id) in done:
            continue
        key = str(item_id) if item_id is not None else ("row", r.get("manifest_row"), i)
        prev = last.get(key)
        if prev is None or (r.get("attempt") or 0) >= (prev.get("attempt") or 0):
            last[key] = r
    out = [
        FailedItem(
            item_id="" if r.get("item_id") is None else str(r["item_id"]),
            manifest_row=r.get("manifest_row"),
            stage=str(r.get("stage") or ""),
            attempt=r.get("attempt"),
            at=_timestamp(r.get("at")),
            error=_clip(str(r.get("error") or ""), _MAX_ERROR),
        )
        for r in last.values()
    ]
    out.sort(key=lambda f: (f.manifest_row if isinstance(f.manifest_row, int) else math.inf, f.item_id))
    return out


# ----------------------------------------------------------------------------- HTML


def _reference_rows(chunk: Sequence[_Item], groups: Mapping[str, tuple[int, int]], offset: int) -> list[str]:
    """One ``section.ref`` per run of items of the same reference on this page.

    ``groups`` maps a reference hash to (index of its first item, item count) in the whole
    ordered job, so a reference whose images span pages says which of them a page shows.
    """
    out = []
    i = 0
    while i < len(chunk):
        h = chunk[i].reference_hash
        j = i
        while j < len(chunk) and chunk[j].reference_hash == h:
            j += 1
        first, total = groups[h]
        out.append(_reference_row(chunk[i:j], offset + i - first, total))
        i = j
    return out


def _groups(items: Sequence[_Item]) -> dict[str, tuple[int, int]]:
    """Reference hash -> (index of its first item, item count); items are grouped already."""
    groups: dict[str, tuple[int, int]] = {}
    for i, it in enumerate(items):
        first, count = groups.get(it.reference_hash, (i, 0))
        groups[it.reference_hash] = (first, count + 1)
    return groups


def _reference_row(items: Sequence[_Item], start: int, total: int) -> str:
    it = items[0]
    h = it.reference_hash
    count = (
        f"{total} image{'s' if total != 1 else ''}"
        if len(items) == total
        else f"images {start + 1}–{start + len(items)} of {total}"
    )
    uris = it.reference_uris
    source = uris[0].rstrip("/").rsplit("/", 1)[-1] if uris else ""
    more = f" +{len(uris) - 1}" if len(uris) > 1 else ""
    all_uris = _clip("\n".join(uris[:8]), 2000)
    scenes = "".join(_scene(x) for x in items)
    return (
        f'<section class="ref" id="ref-{_attr(h)}" data-reference-hash="{_attr(h)}">'
        f'<div class="ref-card"><a href="{_href(it.reference_key)}">'
        f'<img class="reference" src="{_href(it.reference_key)}" loading="lazy" decoding="async" '
        f'alt="reference {_attr(h[:12])}"></a>'
        f'<p class="ref-meta"><code title="{_attr(h)}">{escape(h[:12])}</code> · {count}</p>'
        + (f'<p class="ref-src" title="{_attr(all_uris)}">{escape(_clip(source, 80))}{more}</p>' if uris else "")
        + f'</div><div class="scenes">{scenes}</div></section>'
    )


def _scene(it: _Item) -> str:
    return (
        f'<figure class="scene" data-item-id="{_attr(it.item_id)}" title="{_attr(it.settings)}">'
        f'<a href="{_href(it.image_key)}"><img class="thumb" src="{_href(it.thumb_key)}" '
        f'width="{it.thumb_w}" height="{it.thumb_h}" loading="lazy" decoding="async" '
        f'alt="{_attr(it.item_id)}"></a>'
        f"<figcaption>{escape(it.prompt)}</figcaption></figure>"
    )


def _header(
    title: str,
    items: Sequence[_Item],
    failed: Sequence[FailedItem],
    summary: Mapping,
    plot_keys: Mapping[str, str],
    n_pages: int,
) -> str:
    refs = len({it.reference_hash for it in items})
    workers = len({it.worker_id for it in items if it.worker_id is not None})
    starts = [it.started_at for it in items if isinstance(it.started_at, float)]
    ends = [it.finished_at for it in items if isinstance(it.finished_at, float)]
    facts = [("images", f"{len(items):,}"), ("references", f"{refs:,}"), ("failed", f"{len(failed):,}")]
    if workers:
        facts.append(("workers", f"{workers:,}"))
    if starts and ends and max(ends) > min(starts):
        span = max(ends) - min(starts)
        facts += [("rendering time", format_duration(span)), ("images / minute", f"{len(ends) / span * 60:.3g}")]
    facts.append(("pages", f"{n_pages:,}"))
    parts = [f"<header><h1>{escape(title)}</h1>", _facts(facts, "facts")]
    run = [
        (label, _format_or_str(fmt, summary[key])) for key, label, fmt in _SUMMARY_FACTS if summary.get(key) is not None
    ]
    if run:
        parts.append(f'<p class="muted run">last run (summary.json)</p>{_facts(run, "facts")}')
    scalars = _summary_scalars(summary)
    if scalars:
        parts.append(
            f'<details class="summary"><summary>all of summary.json</summary>{_facts(scalars, "facts small")}</details>'
        )
    links = [f'<a href="{_href(key)}">{escape(name)}</a>' for name, key in plot_keys.items()]
    if failed:
        links.append(f'<a href="{_href(errors_page_key(1))}">failed items ({len(failed):,})</a>')
    if links:
        parts.append(f'<nav class="links">{" · ".join(links)}</nav>')
    if plot_keys:
        imgs = "".join(
            f'<a href="{_href(k)}"><img src="{_href(k)}" loading="lazy" alt="{_attr(n)} plot"></a>'
            for n, k in plot_keys.items()
        )
        parts.append(f'<details class="plots"><summary>plots</summary><div class="plot-row">{imgs}</div></details>')
    parts.append("</header>")
    return "".join(parts)


def _small_header(title: str, n_items: int, page: int, n_pages: int) -> str:
    return (
        f'<header class="small"><h1><a href="{page_key(1)}">{escape(title)}</a></h1>'
        f'<p class="muted">{n_items:,} images · page {page} of {n_pages}</p></header>'
    )


def _facts(facts: Iterable[tuple[str, str]], cls: str) -> str:
    cells = "".join(f"<div><dt>{escape(k)}</dt><dd>{escape(v)}</dd></div>" for k, v in facts)
    return f'<dl class="{cls}">{cells}</dl>'


# Throughput and counts of the last run, shown in the header when summary.json has them.
_SUMMARY_FACTS = (
    ("images_this_run", "images this run", lambda v: f"{v:,}"),
    ("wall_seconds", "wall time", lambda v: format_duration(float(v))),
    ("images_per_hour", "images / hour", lambda v: f"{v:,.0f}"),
    ("encodes_per_reference", "encodes / reference", lambda v: f"{v:.2f}"),
    ("invalid_rows", "invalid manifest rows", lambda v: f"{v:,}"),
    ("interrupted", "interrupted", lambda v: "yes" if v else "no"),
)


def _format_or_str(fmt, v) -> str:
    try:
        return fmt(v)
    except (TypeError, ValueError):  # summary.json written by another version: show it as it is
        return _clip(str(v), 80)


def _summary_scalars(summary: Mapping, limit: int = 24) -> list[tuple[str, str]]:
    """Scalar entries of ``summary.json`` (nested one level as ``a.b``), at most ``limit``."""
    out: list[tuple[str, str]] = []
    for k, v in summary.items():
        if isinstance(v, Mapping):
            out += [(f"{k}.{k2}", v2) for k2, v2 in v.items() if not isinstance(v2, (Mapping, list))]
        elif not isinstance(v, list):
            out.append((str(k), v))

    def fmt(k: str, v) -> str:
        if k.endswith("_at") and isinstance(v, (int, float)) and not isinstance(v, bool):
            return _timestamp(v) + " UTC"
        if isinstance(v, float):
            return f"{v:.4g}"
        if isinstance(v, int) and not isinstance(v, bool):
            return f"{v:,}"
        return _clip(json.dumps(v) if v is None or isinstance(v, bool) else str(v), 80)

    return [(k, fmt(k, v)) for k, v in out[:limit]]


def _errors_section(failed: Sequence[FailedItem], total: int, preview: bool) -> str:
    rows = "".join(
        f'<tr data-item-id="{_attr(f.item_id)}"><td><code>{escape(f.item_id)}</code></td>'
        f"<td>{escape(str(f.manifest_row if f.manifest_row is not None else ''))}</td>"
        f"<td>{escape(f.stage)}</td><td>{escape(str(f.attempt if f.attempt is not None else ''))}</td>"
        f'<td class="nowrap">{escape(f.at)}</td><td><pre>{escape(f.error)}</pre></td></tr>'
        for f in failed
    )
    more = (
        f'<p><a href="{errors_page_key(1)}">all {total:,} failed items</a></p>'
        if preview and total > len(failed)
        else ""
    )
    return (
        f'<section class="errors" id="errors"><h2>Failed items ({total:,})</h2>'
        "<table><thead><tr><th>item</th><th>row</th><th>stage</th><th>attempt</th><th>at (UTC)</th>"
        f"<th>error</th></tr></thead><tbody>{rows}</tbody></table>{more}</section>"
    )


def _pager(page: int, n_pages: int, key) -> str:
    if n_pages <= 1:
        return ""
    shown = sorted({1, n_pages, *range(max(1, page - _PAGER_WINDOW), min(n_pages, page + _PAGER_WINDOW) + 1)})
    parts = [
        f'<a rel="prev" href="{key(page - 1)}">‹ previous</a>' if page > 1 else '<span class="off">‹ previous</span>'
    ]
    prev = 0
    for p in shown:
        if p > prev + 1:
            parts.append('<span class="gap">…</span>')
        parts.append(
            f'<span class="current" aria-current="page">{p}</span>' if p == page else f'<a href="{key(p)}">{p}</a>'
        )
        prev = p
    parts.append(
        f'<a rel="next" href="{key(page + 1)}">next ›</a>' if page < n_pages else '<span class="off">next ›</span>'
    )
    if n_pages > len(shown):
        parts.append(
            f'<form class="jump"><input type="number" name="page" min="1" max="{n_pages}" '
            f'placeholder="page" aria-label="go to page"><button>go</button></form>'
        )
    return f'<nav class="pager" aria-label="pages">{"".join(parts)}</nav>'


def _document(title: str, body: Sequence[str], page: int, n_pages: int, kind: str) -> str:
    prefix = "gallery" if kind == "gallery" else "errors"
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title><style>{_CSS}</style></head>"
        f'<body data-page="{page}" data-pages="{n_pages}" data-prefix="{prefix}">\n'
        + "\n".join(b for b in body if b)
        + f"\n<script>{_JS}</script></body></html>\n"
    )


def _href(key: str) -> str:
    """A key relative to the job root as an escaped relative URL (works on file:// and S3)."""
    return escape(quote(key, safe="/-_.~"), quote=True)


def _attr(s: str) -> str:
    return escape(s, quote=True)


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def _timestamp(v) -> str:
    if isinstance(v, dt.datetime):
        return v.strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return dt.datetime.fromtimestamp(v, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
    return "" if v is None else str(v)


_CSS = """
:root { color-scheme: light dark; --bg: #f6f7f9; --fg: #1f2328; --muted: #59636e; --card: #ffffff;
  --line: #d8dee4; --accent: #2f6fb0; --bad: #b3261e; }
@media (prefers-color-scheme: dark) { :root { --bg: #111316; --fg: #e6e8eb; --muted: #9aa4ae;
  --card: #1a1d21; --line: #2c3137; --accent: #6aa8e6; --bad: #f2857d; } }
* { box-sizing: border-box; }
body { margin: 0; background: var(--bg); color: var(--fg);
  font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; }
a { color: var(--accent); text-decoration: none; }
a:hover { text-decoration: underline; }
header { padding: 20px 24px 14px; background: var(--card); border-bottom: 1px solid var(--line); }
header.small { padding: 12px 24px; }
h1 { margin: 0 0 10px; font-size: 20px; font-weight: 600; }
header.small h1 { font-size: 16px; margin: 0; }
h1 a { color: inherit; }
h2 { font-size: 16px; margin: 0 0 10px; }
.muted { color: var(--muted); margin: 2px 0 0; }
dl.facts { display: flex; flex-wrap: wrap; gap: 6px 22px; margin: 0; }
dl.facts div { display: flex; gap: 6px; align-items: baseline; }
dt { color: var(--muted); }
dd { margin: 0; font-weight: 600; font-variant-numeric: tabular-nums; }
dl.small { font-size: 12px; margin-top: 8px; }
.run { font-size: 12px; margin-top: 8px; }
details { margin-top: 10px; }
summary { cursor: pointer; color: var(--muted); }
nav.links { margin-top: 10px; }
.plot-row { display: flex; flex-wrap: wrap; gap: 12px; margin-top: 8px; }
.plot-row img { max-width: 440px; width: 100%; border: 1px solid var(--line); border-radius: 6px; }
.pager { display: flex; flex-wrap: wrap; align-items: center; gap: 4px; padding: 12px 24px; }
.pager a, .pager span { padding: 3px 9px; border-radius: 5px; border: 1px solid transparent; }
.pager a { border-color: var(--line); background: var(--card); }
.pager .current { background: var(--accent); color: var(--bg); font-weight: 600; }
.pager .off, .pager .gap { color: var(--muted); }
.pager form { display: inline-flex; gap: 4px; margin-left: 10px; }
.pager input { width: 6em; }
main { padding: 0 24px; }
.ref { display: grid; grid-template-columns: 184px 1fr; gap: 18px; padding: 18px 0;
  border-bottom: 1px solid var(--line); }
.ref-card img { display: block; width: 184px; height: auto; min-height: 60px; border-radius: 6px;
  background: var(--line); }
.ref-meta, .ref-src { margin: 6px 0 0; font-size: 12px; color: var(--muted); overflow-wrap: anywhere; }
.scenes { display: grid; grid-template-columns: repeat(auto-fill, minmax(152px, 1fr)); gap: 12px;
  align-items: start; }
.scene { margin: 0; background: var(--card); border: 1px solid var(--line); border-radius: 6px;
  overflow: hidden; }
.scene img { display: block; width: 100%; height: auto; background: var(--line); }
.scene figcaption { margin: 6px 8px 8px; font-size: 12px; line-height: 1.35; color: var(--muted);
  display: -webkit-box; -webkit-line-clamp: 3; -webkit-box-orient: vertical; overflow: hidden;
  overflow-wrap: anywhere; }
.scene:hover figcaption { -webkit-line-clamp: unset; color: var(--fg); }
.empty { color: var(--muted); padding: 24px 0; }
.errors { padding: 18px 24px; }
.errors table { border-collapse: collapse; width: 100%; background: var(--card); font-size: 12px; }
.errors th, .errors td { text-align: left; vertical-align: top; padding: 6px 8px;
  border-bottom: 1px solid var(--line); }
.errors th { color: var(--muted); font-weight: 600; }
.errors th:last-child { width: 55%; }
.errors pre { margin: 0; white-space: pre-wrap; overflow-wrap: anywhere; color: var(--bad); font-size: 12px; }
.nowrap { white-space: nowrap; }
@media (max-width: 640px) { .ref { grid-template-columns: 1fr; } main, .errors { padding: 0 12px; } }
"""

# Counts the loaded gallery images (references and thumbnails, not the plot previews) into
# data attributes (read by the browser tests; lazy images below the fold count once
# scrolled into view) and makes the "go to page" box navigate to a
# relative page name, which works under file:// and on S3 alike.
_JS = """
(function () {
  var body = document.body, imgs = Array.prototype.slice.call(document.querySelectorAll("main img"));
  function update() {
    var ok = 0, bad = 0;
    imgs.forEach(function (im) { if (im.complete) { if (im.naturalWidth > 0) ok++; else bad++; } });
    body.dataset.imagesTotal = imgs.length;
    body.dataset.imagesLoaded = ok;
    body.dataset.imagesFailed = bad;
    if (ok === imgs.length) body.dataset.allImagesLoaded = "true";
  }
  imgs.forEach(function (im) { im.addEventListener("load", update); im.addEventListener("error", update); });
  update();
  Array.prototype.forEach.call(document.querySelectorAll("form.jump"), function (form) {
    form.addEventListener("submit", function (ev) {
      ev.preventDefault();
      var n = Math.round(Number(form.elements.page.value)), last = Number(body.dataset.pages);
      if (!(n >= 1 && n <= last)) return;
      var prefix = body.dataset.prefix;
      window.location.href = n === 1 ? prefix + ".html" : prefix + "-" + n + ".html";
    });
  });
})();
"""
