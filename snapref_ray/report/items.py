"""A job's items as the gallery shows them: one per metadata row, and the items that failed for good.

Read from the metadata and errors tables the job wrote; user strings (prompts, errors) are
clipped here so one pathological value cannot make a page heavy (the full text stays in the
Parquet metadata and in the image's PNG chunks). Escaping is the templates' job.
"""

from __future__ import annotations

import datetime as dt
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

import pyarrow as pa

from snapref_ray.storage.metadata import SETTINGS_IN_METADATA

__all__ = [
    "DISPLAY_COLUMNS",
    "THUMB_SIZE",
    "FailedItem",
    "GalleryItem",
    "clip",
    "failed_items",
    "gallery_item",
    "gallery_items",
    "timestamp",
]

#: Longest side of the thumbnails the sink writes under ``thumbs/``.
THUMB_SIZE = 256
_MAX_PROMPT = 1200
_MAX_ERROR = 2000

# The settings a tile's hover text lists (the negative prompt has a line of its own; the caption is the reference's).
_SETTINGS_KEYS = tuple(k for k in SETTINGS_IN_METADATA if k not in ("negative_prompt", "ref_caption"))

#: The metadata columns a gallery tile shows (caption, hover text, links); nothing else is read for a page.
DISPLAY_COLUMNS = (
    "item_id",
    "manifest_row",
    "reference_uris",
    "reference_hash",
    "reference_image_key",
    "prompt",
    "negative_prompt",
    "seed",
    *_SETTINGS_KEYS,
    "image_key",
    "thumb_key",
    "adapter",
    "worker_id",
    "sample_s",
    "started_at",
    "finished_at",
    "accepted",  # a judged job's verdict: a rejected render's tile is marked
    "rejected_by",
)


@dataclass(frozen=True)
class GalleryItem:
    """One image of the job: where its files are, its caption and hover text, its timings."""

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
    verdict: str = ""  # a judged job's: "kept" or "rejected: <checks>"; "" when the job did not judge


def gallery_items(table: pa.Table) -> list[GalleryItem]:
    """One item per metadata row, ordered by reference (first manifest row) then row."""
    cols = [c for c in DISPLAY_COLUMNS if c in table.column_names]
    rows = table.select(cols).to_pylist()
    first_row: dict[str, float] = {}
    for r in rows:
        h = str(r.get("reference_hash") or "")
        first_row[h] = min(first_row.get(h, math.inf), _row_number(r))
    items = [gallery_item(r, first_row[str(r.get("reference_hash") or "")]) for r in rows]
    items.sort(key=lambda it: it.order)
    return items


def gallery_item(r: Mapping, reference_first_row: float = math.inf) -> GalleryItem:
    """The tile of one metadata row (a mapping of DISPLAY_COLUMNS); `reference_first_row` orders its reference."""
    h = str(r.get("reference_hash") or "")
    image_key = str(r.get("image_key") or "")
    thumb_key = str(r.get("thumb_key") or image_key)
    w, hgt = r.get("width"), r.get("height")
    scale = THUMB_SIZE / max(w, hgt) if isinstance(w, int) and isinstance(hgt, int) and w > 0 and hgt > 0 else 0
    return GalleryItem(
        item_id=str(r.get("item_id") or ""),
        order=(reference_first_row, h, _row_number(r), str(r.get("item_id") or "")),
        reference_hash=h,
        reference_key=str(r.get("reference_image_key") or f"references/{h}.jpg"),
        reference_uris=tuple(str(u) for u in (r.get("reference_uris") or ())),
        # An item of a webdataset job has no file of its own (it is a member of a tar shard): its tile links
        # to its preview rather than to nothing.
        image_key=image_key or thumb_key,
        thumb_key=thumb_key,
        prompt=clip(str(r.get("prompt") or ""), _MAX_PROMPT),
        settings=_settings_text(r),
        thumb_w=round(w * scale) if scale else THUMB_SIZE,
        thumb_h=round(hgt * scale) if scale else THUMB_SIZE,
        started_at=r.get("started_at"),
        finished_at=r.get("finished_at"),
        worker_id=r.get("worker_id"),
        verdict=_verdict(r),
    )


def _verdict(r: Mapping) -> str:
    accepted = r.get("accepted")
    if accepted is None:
        return ""
    return "kept" if accepted else f"rejected: {r.get('rejected_by') or '?'}"


def _row_number(r: Mapping) -> float:
    v = r.get("manifest_row")
    return float(v) if isinstance(v, (int, float)) else math.inf


def _settings_text(r: Mapping) -> str:
    """The hover text of a thumbnail: id, seed and every setting that is set."""
    seed, adapter, worker, sample_s = r.get("seed"), r.get("adapter"), r.get("worker_id"), r.get("sample_s")
    first = f"item {r.get('item_id')}" if seed is None or seed == "" else f"item {r.get('item_id')} · seed {_num(seed)}"
    last = _join(
        None if adapter is None or adapter == "" else f"adapter {_num(adapter)}",
        None if worker is None or worker == "" else f"worker {_num(worker)}",
        f"sampling {sample_s:.2f} s" if isinstance(sample_s, float) else None,
    )
    lines = [first, _settings_lines(*[r.get(k) for k in _SETTINGS_KEYS]), last]
    if r.get("negative_prompt"):
        lines.append("negative: " + clip(str(r["negative_prompt"]), 300))
    return "\n".join(line for line in lines if line)


@functools.lru_cache(maxsize=4096)
def _settings_lines(*values) -> str:
    """The two lines of render settings; cached, since the many items of a job mostly share their settings."""
    r = dict(zip(_SETTINGS_KEYS, values, strict=True))
    size = f"{r['width']}×{r['height']}" if r.get("width") and r.get("height") else None
    sampler = "/".join(str(r[k]) for k in ("sampler", "scheduler") if r.get(k))
    ref_range = (
        f"ref range {_num(r['ref_start'])}–{_num(r['ref_end'])}"
        if r.get("ref_start") is not None and r.get("ref_end") is not None
        else None
    )
    lines = [
        _join(size, _field(r, "steps", "steps"), _field(r, "cfg", "cfg"), sampler or None),
        _join(
            _field(r, "mode", "mode"),
            _field(r, "ref weight", "ref_weight"),
            _field(r, "ref guidance", "ref_guidance"),
            "ref in uncond" if r.get("ref_in_uncond") else None,
            _field(r, "correction", "correction"),
            ref_range,
        ),
    ]
    return "\n".join(line for line in lines if line)


def _num(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _join(*parts: str | None) -> str:
    return " · ".join(p for p in parts if p)


def _field(r: Mapping, label: str, key: str) -> str | None:
    v = r.get(key)
    return f"{label} {_num(v)}" if v is not None and v != "" else None


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
            at=timestamp(r.get("at")),
            error=clip(str(r.get("error") or ""), _MAX_ERROR),
        )
        for r in last.values()
    ]
    out.sort(key=lambda f: (f.manifest_row if isinstance(f.manifest_row, int) else math.inf, f.item_id))
    return out


def clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def timestamp(v) -> str:
    if isinstance(v, dt.datetime):
        return v.strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return dt.datetime.fromtimestamp(v, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
    return "" if v is None else str(v)
