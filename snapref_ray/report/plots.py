"""Throughput plots of a batch job as standalone SVG files (no plotting library).

Three charts are drawn from the metadata table's timing columns:

- ``report/throughput.svg``: images per minute over time, from ``finished_at``;
- ``report/workers.svg``: per-worker utilisation (busy time over the job's span) and a
  timeline of each worker's busy intervals, from ``started_at``/``finished_at``;
- ``report/latency.svg``: histograms of the item latency (``finished_at - started_at``) and
  of the sampling time (``sample_s``).

The numbers behind each chart are computed by small public functions
(:func:`images_per_minute`, :func:`worker_utilisation`, :func:`histogram`) so they can be
checked on their own; the ``*_svg`` functions only draw. Every SVG carries its own
stylesheet (light and dark colour schemes) and works opened directly or through ``<img>``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from html import escape

__all__ = [
    "PLOT_KEYS",
    "format_duration",
    "histogram",
    "images_per_minute",
    "latency_svg",
    "nice_ticks",
    "throughput_svg",
    "time_ticks",
    "worker_utilisation",
    "workers_svg",
    "write_plots",
]

#: Plot name -> storage key, relative to the job's output root.
PLOT_KEYS: dict[str, str] = {
    "throughput": "report/throughput.svg",
    "workers": "report/workers.svg",
    "latency": "report/latency.svg",
}

# Bin widths a reader can count in: the throughput chart uses the first that needs at most
# `max_bins` bars, so a 20 s CPU test and a 10 h cluster job both get a readable chart.
_BIN_WIDTHS_S = (1, 2, 5, 10, 15, 20, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 28800, 86400)

_STYLE = """
svg { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; font-size: 12px; }
.bg { fill: #ffffff; }
text { fill: #1f2328; }
.title { font-size: 15px; font-weight: 600; }
.subtitle, .tick text, .note { fill: #59636e; }
.axis line, .axis path { stroke: #59636e; }
.grid line { stroke: #d1d9e0; stroke-dasharray: 2 3; }
.bar { fill: #3b82c4; }
.bar.sample { fill: #c8793b; }
.track { fill: #eef1f4; }
.busy { fill: #3b82c4; }
.mean { stroke: #c8453b; stroke-width: 1.5; stroke-dasharray: 6 4; }
.mean-label { fill: #c8453b; }
@media (prefers-color-scheme: dark) {
  .bg { fill: #16191d; }
  text { fill: #e6e8eb; }
  .subtitle, .tick text, .note { fill: #9aa4ae; }
  .axis line, .axis path { stroke: #9aa4ae; }
  .grid line { stroke: #343a42; }
  .bar, .busy { fill: #5aa2e0; }
  .bar.sample { fill: #e09a5a; }
  .track { fill: #262b31; }
  .mean { stroke: #f07a70; }
  .mean-label { fill: #f07a70; }
}
"""


# ----------------------------------------------------------------------------- numbers


def images_per_minute(
    finished_at: Sequence[float], start: float | None = None, max_bins: int = 60
) -> tuple[float, list[float]]:
    """Bin completion times into equal bins and return ``(bin_width_s, images_per_minute)``.

    Bins start at ``start`` (default: the first completion) and the width is the smallest of
    1 s, 2 s, 5 s, ... 1 day that needs at most ``max_bins`` bins. A completion exactly at the
    end of the span counts in the last bin. Rates are ``count * 60 / bin_width_s``.
    """
    times = [float(t) for t in finished_at if _finite(t)]
    if not times:
        return 1.0, []
    t0 = min(times) if start is None else float(start)
    span = max(max(times) - t0, 0.0)
    bin_s = next((float(w) for w in _BIN_WIDTHS_S if math.ceil(span / w) <= max_bins), None)
    if bin_s is None:  # longer than max_bins days: fall back to whole days per bin
        bin_s = 86400.0 * math.ceil(span / (86400.0 * max_bins))
    n_bins = max(1, math.ceil(span / bin_s))
    counts = [0] * n_bins
    for t in times:
        counts[min(max(int((t - t0) // bin_s), 0), n_bins - 1)] += 1
    return bin_s, [c * 60.0 / bin_s for c in counts]


@dataclass(frozen=True)
class WorkerUse:
    """Busy time of one worker over the job's span."""

    worker_id: str
    items: int
    busy_s: float
    utilisation: float  # busy_s / job span, in [0, 1]
    intervals: list[tuple[float, float]]  # merged busy intervals, seconds since job start


def worker_utilisation(
    worker_ids: Sequence[str | None],
    started_at: Sequence[float | None],
    finished_at: Sequence[float | None],
    merge_gap_s: float = 0.0,
) -> tuple[float, list[WorkerUse]]:
    """Per-worker busy time over the job's span; returns ``(span_s, uses)``, ordered by worker id
    with numbers compared as numbers (``w2`` before ``w10``).

    The span runs from the first ``started_at`` to the last ``finished_at`` of any worker.
    A worker's busy time is the length of the union of its items' ``[started_at,
    finished_at]`` intervals, so items sampled together in one batch are not double counted.
    Intervals closer than ``merge_gap_s`` are joined in ``intervals`` (a drawing aid: gaps
    narrower than a pixel); ``busy_s`` is always computed without that merging.
    """
    rows = [
        (str(w), float(s), float(f))
        for w, s, f in zip(worker_ids, started_at, finished_at, strict=True)
        if w is not None and _finite(s) and _finite(f) and f >= s
    ]
    if not rows:
        return 0.0, []
    t0 = min(s for _, s, _ in rows)
    span = max(f for _, _, f in rows) - t0
    by_worker: dict[str, list[tuple[float, float]]] = {}
    for w, s, f in rows:
        by_worker.setdefault(w, []).append((s - t0, f - t0))
    uses = []
    for w in sorted(by_worker, key=_natural_key):
        spans = sorted(by_worker[w])
        busy = sum(e - s for s, e in _merge(spans, 0.0))
        uses.append(
            WorkerUse(
                worker_id=w,
                items=len(spans),
                busy_s=busy,
                utilisation=busy / span if span > 0 else 1.0,
                intervals=_merge(spans, merge_gap_s),
            )
        )
    return span, uses


def histogram(values: Iterable[float | None], bins: int, lo: float, hi: float) -> list[int]:
    """Counts of ``values`` in ``bins`` equal bins over ``[lo, hi]`` (both ends included).

    Non-finite values are ignored; values outside the range are clipped into the end bins so
    the counts always sum to the number of finite values.
    """
    counts = [0] * bins
    # Scale before dividing so edges land exactly (4.0 is the start of bin 5 of 10 over [0, 8]).
    per_unit = bins / (hi - lo) if hi > lo else 0.0
    for v in values:
        if _finite(v):
            counts[min(max(math.floor((float(v) - lo) * per_unit), 0), bins - 1)] += 1
    return counts


def nice_ticks(lo: float, hi: float, target: int = 6, cover: bool = False) -> list[float]:
    """Round tick values (1, 2, 2.5 or 5 times a power of ten) inside ``[lo, hi]``.

    With ``cover`` the last tick is the first round value at or above ``hi``, so an axis
    that ends at it holds all the data (used for count and rate axes).
    """
    if not (_finite(lo) and _finite(hi)) or hi <= lo:
        return [lo]
    raw = (hi - lo) / max(target - 1, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * 0.999)
    return _ticks(lo, hi, step, cover)


def time_ticks(span_s: float, target: int = 6) -> list[float]:
    """Ticks on an elapsed-time axis ``[0, span_s]`` at clock-friendly steps (15 s, 5 min, 1 h...)."""
    if not _finite(span_s) or span_s <= 0:
        return [0.0]
    step = next((float(w) for w in _BIN_WIDTHS_S if span_s / w <= target), None)
    if step is None:
        step = 86400.0 * math.ceil(span_s / (86400.0 * target))
    return _ticks(0.0, span_s, step, cover=False)


def _ticks(lo: float, hi: float, step: float, cover: bool) -> list[float]:
    first = math.floor(lo / step + 1e-9) * step
    ticks = []
    k = 0
    while first + k * step <= hi + step * 1e-9:
        ticks.append(round(first + k * step, 10))
        k += 1
    if cover and ticks[-1] < hi - step * 1e-9:
        ticks.append(round(first + k * step, 10))
    return [t for t in ticks if t >= lo - step * 1e-9]


def format_duration(seconds: float) -> str:
    """``5.2 s``, ``3 min 20 s``, ``2 h 05 min``: a duration for labels and headers."""
    if not _finite(seconds):
        return "–"
    if seconds < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
    if seconds < 3600:
        m, s = divmod(round(seconds), 60)
        return f"{m} min {s:02d} s"
    h, rem = divmod(round(seconds), 3600)
    return f"{h} h {rem // 60:02d} min"


# ----------------------------------------------------------------------------- drawing


@dataclass(frozen=True)
class _Frame:
    """A plot area in pixels mapped onto a data rectangle."""

    left: float
    top: float
    width: float
    height: float
    x0: float
    x1: float
    y0: float
    y1: float

    def sx(self, x: float) -> float:
        return self.left + (x - self.x0) / (self.x1 - self.x0 or 1.0) * self.width

    def sy(self, y: float) -> float:
        return self.top + self.height - (y - self.y0) / (self.y1 - self.y0 or 1.0) * self.height

    @property
    def bottom(self) -> float:
        return self.top + self.height


def _document(width: int, height: int, title: str, subtitle: str, body: list[str]) -> str:
    return "\n".join(
        [
            '<?xml version="1.0" encoding="UTF-8"?>',
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">',
            f"<title>{escape(title)}</title>",
            f"<style>{_STYLE}</style>",
            f'<rect class="bg" x="0" y="0" width="{width}" height="{height}"/>',
            f'<text class="title" x="16" y="24">{escape(title)}</text>',
            f'<text class="subtitle" x="16" y="42">{escape(subtitle)}</text>',
            *body,
            "</svg>",
            "",
        ]
    )


def _x_axis(frame: _Frame, ticks: Sequence[float], fmt, label: str) -> list[str]:
    out = [
        f'<g class="axis x-axis"><line x1="{frame.left:.1f}" y1="{frame.bottom:.1f}" '
        f'x2="{frame.left + frame.width:.1f}" y2="{frame.bottom:.1f}"/>'
    ]
    for t in ticks:
        x = frame.sx(t)
        out.append(
            f'<g class="tick"><line x1="{x:.1f}" y1="{frame.bottom:.1f}" x2="{x:.1f}" '
            f'y2="{frame.bottom + 5:.1f}"/><text x="{x:.1f}" y="{frame.bottom + 18:.1f}" '
            f'text-anchor="middle">{escape(fmt(t))}</text></g>'
        )
    out.append(
        f'<text class="label" x="{frame.left + frame.width / 2:.1f}" y="{frame.bottom + 36:.1f}" '
        f'text-anchor="middle">{escape(label)}</text></g>'
    )
    return out


def _y_axis(frame: _Frame, ticks: Sequence[float], fmt, label: str) -> list[str]:
    out = ['<g class="grid">']
    out += [
        f'<line x1="{frame.left:.1f}" y1="{frame.sy(t):.1f}" x2="{frame.left + frame.width:.1f}" '
        f'y2="{frame.sy(t):.1f}"/>'
        for t in ticks
    ]
    out.append("</g>")
    out.append(
        f'<g class="axis y-axis"><line x1="{frame.left:.1f}" y1="{frame.top:.1f}" '
        f'x2="{frame.left:.1f}" y2="{frame.bottom:.1f}"/>'
    )
    for t in ticks:
        y = frame.sy(t)
        out.append(
            f'<g class="tick"><line x1="{frame.left - 5:.1f}" y1="{y:.1f}" x2="{frame.left:.1f}" '
            f'y2="{y:.1f}"/><text x="{frame.left - 8:.1f}" y="{y + 4:.1f}" '
            f'text-anchor="end">{escape(fmt(t))}</text></g>'
        )
    cy = frame.top + frame.height / 2
    out.append(
        f'<text class="label" x="{frame.left - 48:.1f}" y="{cy:.1f}" text-anchor="middle" '
        f'transform="rotate(-90 {frame.left - 48:.1f} {cy:.1f})">{escape(label)}</text></g>'
    )
    return out


def _no_data(title: str, why: str) -> str:
    return _document(640, 120, title, why, ['<text class="note" x="16" y="80">No data to plot.</text>'])


def _fmt_number(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 10 or float(v).is_integer():
        return f"{v:.0f}"
    return f"{v:.2g}" if abs(v) < 1 else f"{v:.1f}"


def _fmt_clock(seconds: float) -> str:
    """Elapsed time on a time axis: ``0:45``, ``12:30``, ``1:05:00``."""
    s = round(seconds)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def _fmt_seconds(v: float) -> str:
    return f"{_fmt_number(v)} s"


def throughput_svg(finished_at: Sequence[float], start: float | None = None, max_bins: int = 60) -> str:
    """Bar chart of images per minute over elapsed time, one ``rect.bar`` per bin."""
    title = "Images per minute over time"
    bin_s, rates = images_per_minute(finished_at, start, max_bins)
    if not rates:
        return _no_data(title, "no finished items")
    span = len(rates) * bin_s
    times = [float(t) for t in finished_at if _finite(t)]
    n = len(times)
    t0 = min(times) if start is None else float(start)
    elapsed = max(times) - t0
    mean = n / elapsed * 60 if elapsed > 0 else 0.0
    y_ticks = nice_ticks(0, max(max(rates), mean) or 1.0, cover=True)
    frame = _Frame(left=72, top=64, width=780, height=300, x0=0, x1=span, y0=0, y1=y_ticks[-1])
    body = _y_axis(frame, y_ticks, _fmt_number, "images / minute")
    bar_w = frame.width / len(rates)
    gap = min(2.0, bar_w * 0.15)
    body.append('<g class="bars">')
    for i, r in enumerate(rates):
        y = frame.sy(r)
        body.append(
            f'<rect class="bar" x="{frame.left + i * bar_w + gap / 2:.2f}" y="{y:.2f}" '
            f'width="{max(bar_w - gap, 0.5):.2f}" height="{frame.bottom - y:.2f}" data-value="{r:.6g}">'
            f"<title>{escape(_fmt_clock(i * bin_s))}–{escape(_fmt_clock((i + 1) * bin_s))}: "
            f"{r:.3g} images/min</title></rect>"
        )
    body.append("</g>")
    if mean > 0:
        ym = frame.sy(mean)
        body.append(
            f'<line class="mean" x1="{frame.left:.1f}" y1="{ym:.1f}" '
            f'x2="{frame.left + frame.width:.1f}" y2="{ym:.1f}"/>'
        )
        # The legend sits above the plot so it never hides a bar.
        lx = frame.left + frame.width
        body.append(
            f'<line class="mean" x1="{lx - 170:.1f}" y1="{frame.top - 14:.1f}" '
            f'x2="{lx - 144:.1f}" y2="{frame.top - 14:.1f}"/>'
        )
        body.append(
            f'<text class="mean-label" x="{lx - 138:.1f}" y="{frame.top - 10:.1f}">mean {mean:.3g} images / min</text>'
        )
    body += _x_axis(frame, time_ticks(span), _fmt_clock, "elapsed time (m:ss or h:mm:ss)")
    subtitle = f"{n} images in {format_duration(elapsed)}; bins of {format_duration(bin_s)}"
    return _document(880, 430, title, subtitle, body)


def workers_svg(
    worker_ids: Sequence[str | None],
    started_at: Sequence[float | None],
    finished_at: Sequence[float | None],
) -> str:
    """Per-worker utilisation bars (``rect.bar``, one per worker) and busy timelines."""
    title = "Worker utilisation"
    label_w, util_w, timeline_w, row_h = 140.0, 200.0, 460.0, 22.0
    timeline_left = 16 + label_w + util_w + 40
    span, uses = worker_utilisation(worker_ids, started_at, finished_at)
    if not uses:
        return _no_data(title, "no items with worker_id, started_at and finished_at")
    # Re-merge at pixel resolution so a 60,000-item job draws a few hundred rects per row.
    px_s = span / timeline_w if span > 0 else 0.0
    span, uses = worker_utilisation(worker_ids, started_at, finished_at, merge_gap_s=px_s)
    top = 84.0
    height = int(top + row_h * len(uses) + 56)
    util = _Frame(16 + label_w, top, util_w, row_h * len(uses), 0, 1, 0, 1)
    line = _Frame(timeline_left, top, timeline_w, row_h * len(uses), 0, span or 1.0, 0, 1)
    mean_util = sum(u.utilisation for u in uses) / len(uses)
    body = [
        f'<text class="label" x="{util.left:.1f}" y="{top - 10:.1f}">busy / job span</text>',
        f'<text class="label" x="{line.left:.1f}" y="{top - 10:.1f}">busy intervals</text>',
    ]
    for i, u in enumerate(uses):
        y = top + i * row_h
        shown = u.worker_id if len(u.worker_id) <= 20 else u.worker_id[:9] + "…" + u.worker_id[-9:]
        body.append(
            f'<g class="worker" data-worker-id="{escape(u.worker_id)}"><title>{escape(u.worker_id)}: '
            f"{u.items} items, busy {format_duration(u.busy_s)} of {format_duration(span)}</title>"
            f'<text x="{util.left - 8:.1f}" y="{y + row_h / 2 + 4:.1f}" text-anchor="end">{escape(shown)}</text>'
            f'<rect class="track" x="{util.left:.1f}" y="{y + 3:.1f}" width="{util_w:.1f}" height="{row_h - 6:.1f}"/>'
            f'<rect class="bar" x="{util.left:.1f}" y="{y + 3:.1f}" width="{util_w * u.utilisation:.2f}" '
            f'height="{row_h - 6:.1f}" data-value="{u.utilisation:.6g}"/>'
            f'<text x="{util.left + util_w + 6:.1f}" y="{y + row_h / 2 + 4:.1f}">{u.utilisation:.0%}</text>'
            f'<rect class="track" x="{line.left:.1f}" y="{y + 3:.1f}" width="{timeline_w:.1f}" '
            f'height="{row_h - 6:.1f}"/>'
        )
        body += [
            f'<rect class="busy" x="{line.sx(s):.2f}" y="{y + 3:.1f}" '
            f'width="{max(line.sx(e) - line.sx(s), 0.5):.2f}" height="{row_h - 6:.1f}"/>'
            for s, e in u.intervals
        ]
        body.append("</g>")
    body += _x_axis(line, time_ticks(span, 5), _fmt_clock, "elapsed time")
    body += _x_axis(util, [0, 0.25, 0.5, 0.75, 1.0], lambda v: f"{v:.0%}", "utilisation")
    subtitle = (
        f"{len(uses)} workers over {format_duration(span)}; "
        f"mean utilisation {mean_util:.0%} (union of each worker's started_at–finished_at)"
    )
    return _document(int(timeline_left + timeline_w + 30), height, title, subtitle, body)


def latency_svg(latency_s: Sequence[float | None], sample_s: Sequence[float | None], bins: int = 30) -> str:
    """Two histograms on one time axis: item latency and sampling time (``rect.bar``)."""
    title = "Latency per image"
    series = [
        ("latency", "end to end (finished_at − started_at)", [float(v) for v in latency_s if _finite(v)]),
        ("sample", "sampling (sample_s)", [float(v) for v in sample_s if _finite(v)]),
    ]
    series = [s for s in series if s[2]]
    if not series:
        return _no_data(title, "no timings")
    hi = max(max(vals) for _, _, vals in series)
    x_ticks = nice_ticks(0, hi if hi > 0 else 1.0, cover=True)
    x_hi = x_ticks[-1]
    panel_h, top = 180.0, 64.0
    body: list[str] = []
    for k, (name, label, vals) in enumerate(series):
        counts = histogram(vals, bins, 0.0, x_hi)
        y_ticks = nice_ticks(0, max(max(counts), 1), 4, cover=True)
        frame = _Frame(72, top + k * (panel_h + 80) + 22, 780, panel_h, 0, x_hi, 0, y_ticks[-1])
        p50, p90, p99 = (_quantile(vals, q) for q in (0.5, 0.9, 0.99))
        body.append(
            f'<text class="label" x="{frame.left:.1f}" y="{frame.top - 10:.1f}">{escape(label)}: '
            f"n={len(vals)}, p50 {_fmt_number(p50)} s, p90 {_fmt_number(p90)} s, "
            f"p99 {_fmt_number(p99)} s, max {_fmt_number(max(vals))} s</text>"
        )
        body += _y_axis(frame, y_ticks, _fmt_number, "images")
        bar_w = frame.width / bins
        body.append(f'<g class="bars" data-series="{name}">')
        for i, c in enumerate(counts):
            y = frame.sy(c)
            body.append(
                f'<rect class="bar {name}" data-series="{name}" data-value="{c}" '
                f'x="{frame.left + i * bar_w + 0.5:.2f}" y="{y:.2f}" width="{max(bar_w - 1, 0.5):.2f}" '
                f'height="{frame.bottom - y:.2f}"><title>{_fmt_number(i * x_hi / bins)}–'
                f"{_fmt_number((i + 1) * x_hi / bins)} s: {c}</title></rect>"
            )
        body.append("</g>")
        body += _x_axis(frame, x_ticks, _fmt_seconds, "seconds")
    height = int(top + len(series) * (panel_h + 80) + 20)
    return _document(880, height, title, f"{bins} bins of {_fmt_number(x_hi / bins)} s", body)


def write_plots(storage, table) -> dict[str, str]:
    """Draw the three charts from a metadata table and store them; returns name -> key.

    ``storage`` is a :class:`snapref_ray.storage.backends.Storage`; ``table`` a
    ``pyarrow.Table`` with the metadata columns (only ``worker_id``, ``started_at``,
    ``finished_at`` and ``sample_s`` are read; a missing column draws an empty chart).
    """

    def col(name: str) -> list:
        return table.column(name).to_pylist() if name in table.column_names else [None] * table.num_rows

    started, finished = col("started_at"), col("finished_at")
    latency = [f - s if _finite(s) and _finite(f) else None for s, f in zip(started, finished, strict=True)]
    starts = [s for s in started if _finite(s)]
    svgs = {
        "throughput": throughput_svg(finished, start=min(starts) if starts else None),
        "workers": workers_svg(col("worker_id"), started, finished),
        "latency": latency_svg(latency, col("sample_s")),
    }
    for name, svg in svgs.items():
        storage.put_bytes(PLOT_KEYS[name], svg.encode("utf-8"), content_type="image/svg+xml")
    return dict(PLOT_KEYS)


# ----------------------------------------------------------------------------- helpers


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _merge(spans: list[tuple[float, float]], gap: float) -> list[tuple[float, float]]:
    """Union of sorted intervals, joining those separated by at most ``gap``."""
    merged: list[tuple[float, float]] = []
    for s, e in spans:
        if merged and s <= merged[-1][1] + gap:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def _natural_key(s: str) -> list:
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", s) if p]


def _quantile(sorted_or_not: list[float], q: float) -> float:
    vals = sorted(sorted_or_not)
    pos = q * (len(vals) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)
