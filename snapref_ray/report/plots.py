"""Throughput plots of a batch job as standalone SVG files (drawn by report/svg_chart.py).

Three charts are drawn from the metadata table's timing columns:

- ``report/throughput.svg``: images per minute over time, from ``finished_at``;
- ``report/workers.svg``: per-worker utilisation (busy time over the job's span) and a
  timeline of each worker's busy intervals, from ``started_at``/``finished_at``;
- ``report/latency.svg``: histograms of the item latency (``finished_at - started_at``) and
  of the sampling time (``sample_s``).

The numbers behind each chart are computed by small public functions
(:func:`images_per_minute`, :func:`mean_images_per_minute`, :func:`worker_utilisation`,
:func:`histogram`) so they can be checked on their own; the ``*_svg`` functions only draw.
The drawn elements carry ids (``throughput-bar-3``, ``throughput-mean``, ``workers-bar-0``,
``latency-bar-7``...) so the charts can be read back and checked as drawn.

The SVG is written directly (report/svg_chart.py), not by a plotting library: importing one and
drawing three figures cost every job's driver about a CPU-second. Text stays text in the SVG, which
keeps the files small and searchable, and the same table gives the same bytes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from snapref_ray.report.svg_chart import (
    FONT_SIZE,
    Chart,
    LegendEntry,
    nice_step,
    nice_ticks,
    text_width,
    tick_labels,
)

__all__ = [
    "PLOT_KEYS",
    "bin_edges",
    "format_duration",
    "format_rate",
    "histogram",
    "images_per_minute",
    "job_start",
    "latency_svg",
    "mean_images_per_minute",
    "throughput_svg",
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
# `max_bins` bars, so a 20 s CPU test and a 10 h cluster job both get a readable chart. The
# same steps space the ticks of elapsed-time axes (15 s, 5 min, 1 h...).
_BIN_WIDTHS_S = (1, 2, 5, 10, 15, 20, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 28800, 86400)

_BAR = "#3b82c4"
_BAR_SAMPLE = "#c8793b"
_TRACK = "#eef1f4"
_MEAN = "#c8453b"
_MUTED = "#59636e"


# ----------------------------------------------------------------------------- numbers


def images_per_minute(
    finished_at: Sequence[float], start: float | None = None, max_bins: int = 60
) -> tuple[float, list[float]]:
    """Bin completion times and return ``(bin_width_s, images_per_minute)``, one rate per bin.

    Bins start at ``start`` (default: the first completion) and the width is the smallest of
    1 s, 2 s, 5 s, ... 1 day that needs at most ``max_bins`` bins. The last bin ends at the
    last completion: a remainder of at least half a bin is a bin of its own, a shorter one
    widens the bin before it, so the last bin is between half and one and a half bins wide
    (see :func:`bin_edges`). Each rate is the bin's count per minute of *its own* width, so
    the bars' time-weighted mean is :func:`mean_images_per_minute`.
    """
    times, t0 = _completions(finished_at, start)
    if not len(times):
        return 1.0, []
    span = max(float(times.max()) - t0, 0.0)
    bin_s = _bin_width(span, max_bins)
    edges = bin_edges(span, bin_s)
    n = len(edges) - 1
    counts = np.bincount(np.clip((times - t0) // bin_s, 0, n - 1).astype(np.int64), minlength=n).tolist()
    widths = [b - a for a, b in zip(edges, edges[1:])]
    return bin_s, [c * 60.0 / (w if w > 0 else bin_s) for c, w in zip(counts, widths)]


def bin_edges(span_s: float, bin_s: float) -> list[float]:
    """Edges ``[0, bin_s, 2 bin_s, ..., span_s]`` of the throughput bins over ``[0, span_s]``.

    Drawing the last, partial bin as a whole one would understate its rate and push the mean
    above every bar; so the last edge is the span itself (a zero span is one bin of ``bin_s``).
    """
    if span_s <= 0:
        return [0.0, bin_s]
    full = math.floor(span_s / bin_s + 1e-9)
    rest = span_s - full * bin_s
    n = full + 1 if full == 0 or rest >= bin_s / 2 else full
    return [i * bin_s for i in range(n)] + [span_s]


def mean_images_per_minute(finished_at: Sequence[float], start: float | None = None) -> float:
    """Images per minute from ``start`` (default: the first completion) to the last completion.

    This is the job's one throughput figure: the gallery's header shows it and the throughput
    chart draws it as its mean line. 0.0 when there is no time span to divide by.
    """
    times, t0 = _completions(finished_at, start)
    elapsed = float(times.max()) - t0 if len(times) else 0.0
    return len(times) / elapsed * 60 if elapsed > 0 else 0.0


def _completions(finished_at: Sequence[float], start: float | None) -> tuple[np.ndarray, float]:
    times = _finite_values(finished_at)
    return times, ((float(times.min()) if len(times) else 0.0) if start is None else float(start))


def _bin_width(span_s: float, max_bins: int) -> float:
    bin_s = next((float(w) for w in _BIN_WIDTHS_S if math.ceil(span_s / w) <= max_bins), None)
    if bin_s is None:  # longer than max_bins days: fall back to whole days per bin
        bin_s = 86400.0 * math.ceil(span_s / (86400.0 * max_bins))
    return bin_s


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
    starts, ends = _floats(started_at), _floats(finished_at)
    with np.errstate(invalid="ignore"):
        valid = np.isfinite(starts) & np.isfinite(ends) & (ends >= starts)
    index: dict[str, int] = {}
    # Each worker's number, -1 for a row without a worker (one Python step per row, not a sort of strings).
    codes = np.fromiter(
        (-1 if w is None else index.setdefault(str(w), len(index)) for w in worker_ids), np.int64, len(starts)
    )
    valid &= codes >= 0
    if not valid.any():
        return 0.0, []
    t0 = float(starts[valid].min())
    span = float(ends[valid].max()) - t0
    uses = []
    for w in sorted(index, key=_natural_key):
        rows = np.flatnonzero(valid & (codes == index[w]))
        if not len(rows):
            continue
        s_, e_ = starts[rows] - t0, ends[rows] - t0
        order = np.lexsort((e_, s_))  # by start, then end: the spans sorted as tuples
        s_, e_ = s_[order], e_[order]
        busy = sum(e - s for s, e in _merge(s_, e_, 0.0))
        uses.append(
            WorkerUse(
                worker_id=w,
                items=len(rows),
                busy_s=busy,
                utilisation=busy / span if span > 0 else 1.0,
                intervals=_merge(s_, e_, merge_gap_s),
            )
        )
    return span, uses


def histogram(values: Iterable[float | None], bins: int, lo: float, hi: float) -> list[int]:
    """Counts of ``values`` in ``bins`` equal bins over ``[lo, hi]`` (both ends included).

    Non-finite values are ignored; values outside the range are clipped into the end bins so
    the counts always sum to the number of finite values.
    """
    vals = _finite_values(values)
    # Scale before dividing so edges land exactly (4.0 is the start of bin 5 of 10 over [0, 8]).
    per_unit = bins / (hi - lo) if hi > lo else 0.0
    index = np.clip(np.floor((vals - lo) * per_unit), 0, bins - 1).astype(np.int64)
    return np.bincount(index, minlength=bins).tolist()


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


def format_rate(per_minute: float) -> str:
    """``0.5``, ``90``, ``21,540``: a rate with three significant digits below 100, whole above."""
    return f"{per_minute:,.0f}" if per_minute >= 100 else f"{per_minute:.3g}"


# ----------------------------------------------------------------------------- layout

_PT = 72.0  # points per inch: the figures keep the sizes they had in inches
_WIDTH = 8.8 * _PT
_RIGHT = 14.0  # right margin
_BOTTOM = 36.0  # x tick labels and the x axis label under a plot
_TITLED = 18.0  # room for a plot's own title (or legend) above it


def _auto_intervals(length_pt: float, per_tick_pt: float) -> int:
    """How many tick intervals fit an axis: one per label's room, 1 to 9."""
    return int(min(max(length_pt // per_tick_pt, 1), 9))


def _value_ticks(lo: float, hi: float, length_pt: float, *, vertical: bool, integer: bool = False, most: int = 9):
    """Round ticks inside ``[lo, hi]`` and their labels; vertical axes take a tick per 2 label heights."""
    step = nice_step(
        hi - lo, min(_auto_intervals(length_pt, 2 * FONT_SIZE if vertical else 3 * FONT_SIZE), most), integer
    )
    ticks = nice_ticks(lo, hi, step)
    return ticks, tick_labels(ticks, step)


def _left_margin(labels: Iterable[str], axis_label: bool = True) -> float:
    """Room left of a plot for its widest y tick label and, when it has one, the rotated axis label."""
    widest = max((text_width(s) for s in labels), default=0.0)
    return 7.2 + (FONT_SIZE * 1.2 + 4 if axis_label else 0) + widest + 7.0


def _stack(chart: Chart, n: int, gap: float) -> tuple[float, float]:
    """(top of the first, height of each) for ``n`` plots stacked under the band, each with a title above it."""
    top = chart.band + _TITLED
    height = (chart.height - top - _BOTTOM - (n - 1) * (gap + _TITLED)) / n
    return top, height


def _top_of(i: int, top: float, height: float, gap: float) -> float:
    return top + i * (height + gap + _TITLED)


def _clock_ticks(span_s: float) -> tuple[list[float], list[str]]:
    """Ticks at clock-friendly steps (the first of 1 s, 2 s, 5 s... 1 day giving at most 6), as m:ss."""
    step = next((float(w) for w in _BIN_WIDTHS_S if span_s / w <= 6), 86400.0 * math.ceil(span_s / (86400.0 * 6)))
    ticks = nice_ticks(0.0, span_s, step)
    return ticks, [_fmt_clock(t) for t in ticks]


def _no_data(title: str, why: str) -> str:
    chart = Chart(6.4 * _PT, 1.4 * _PT, title, why, muted=_MUTED)
    chart.text(7.2, chart.band + 0.6 * (chart.height - chart.band), "No data to plot.", colour=_MUTED)
    return chart.svg()


def _fmt_clock(seconds: float) -> str:
    """Elapsed time on a time axis: ``0:45``, ``12:30``, ``1:05:00``."""
    s = round(seconds)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


# ----------------------------------------------------------------------------- drawing


def throughput_svg(finished_at: Sequence[float], start: float | None = None, max_bins: int = 60) -> str:
    """Bar chart of images per minute over elapsed time (``throughput-bar-{i}``) and its mean line."""
    title = "Images per minute over time"
    bin_s, rates = images_per_minute(finished_at, start, max_bins)
    if not rates:
        return _no_data(title, "no finished items")
    times, t0 = _completions(finished_at, start)
    elapsed = float(times.max()) - t0
    edges = bin_edges(max(elapsed, 0.0), bin_s)
    mean = mean_images_per_minute(finished_at, start)
    chart = Chart(
        _WIDTH,
        4.0 * _PT,
        title,
        f"{len(times)} images in {format_duration(elapsed)}; bins of "
        f"{format_duration(bin_s)} (the last runs to the last image)",
        muted=_MUTED,
    )
    top = chart.band + _TITLED  # the legend sits above the plot so it never hides a bar
    height = chart.height - top - _BOTTOM
    y_hi = max(max(rates), mean) * 1.05  # a 5% margin over the tallest bar or the mean line
    y_ticks, y_labels = _value_ticks(0.0, y_hi, height, vertical=True)
    left = _left_margin(y_labels)
    plot = chart.plot(left, top, chart.width - left - _RIGHT, height, (0.0, edges[-1]), (0.0, y_hi))
    plot.y_grid(y_ticks)
    for i, (a, b, rate) in enumerate(zip(edges, edges[1:], rates)):
        plot.bar(a, b, 0.0, rate, _BAR, id=f"throughput-bar-{i}", edge=("#ffffff", 0.6))
    if mean > 0:
        plot.hline(mean, _MEAN, width=1.4, dash="8.4,5.6", id="throughput-mean")
        plot.legend([LegendEntry(f"mean {format_rate(mean)} images / min", _MEAN, dash="8.4,5.6", text_colour=_MEAN)])
    plot.x_axis(*_clock_ticks(edges[-1]), "elapsed time (m:ss or h:mm:ss)")
    plot.y_axis(y_ticks, y_labels, "images / minute")
    return chart.svg()


def workers_svg(
    worker_ids: Sequence[str | None],
    started_at: Sequence[float | None],
    finished_at: Sequence[float | None],
) -> str:
    """Per-worker utilisation bars (``workers-bar-{i}`` over a ``workers-track-{i}``) and busy timelines."""
    title = "Worker utilisation"
    span, uses = worker_utilisation(worker_ids, started_at, finished_at)
    if not uses:
        return _no_data(title, "no items with worker_id, started_at and finished_at")
    # Re-merge at the timeline's resolution (~400 pt wide) so a 60,000-item job draws a few hundred boxes a row.
    span, uses = worker_utilisation(worker_ids, started_at, finished_at, merge_gap_s=span / 400)
    mean_util = sum(u.utilisation for u in uses) / len(uses)
    subtitle = (
        f"{len(uses)} workers over {format_duration(span)}; "
        f"mean utilisation {mean_util:.0%} (union of each worker's started_at–finished_at)"
    )
    chart = Chart(_WIDTH, (1.4 + 0.28 * len(uses)) * _PT, title, subtitle, muted=_MUTED)
    shown = [u.worker_id if len(u.worker_id) <= 20 else u.worker_id[:9] + "…" + u.worker_id[-9:] for u in uses]
    left, top = _left_margin(shown, axis_label=False), chart.band + 8
    height = chart.height - top - _BOTTOM
    gap = 40.0  # the utilisation's percentages sit in it
    util_w = (chart.width - left - _RIGHT - gap) / 3.3  # widths 1 : 2.3
    rows = (-0.5, len(uses) - 0.5)  # the first worker on top
    util = chart.plot(left, top, util_w, height, (0.0, 1.0), rows, y_down=True)
    for i, u in enumerate(uses):
        util.bar(0.0, 1.0, i - 0.35, i + 0.35, _TRACK, id=f"workers-track-{i}")
        util.bar(0.0, u.utilisation, i - 0.35, i + 0.35, _BAR, id=f"workers-bar-{i}")
        util.text(1.02, i, f"{u.utilisation:.0%}", size=8)
    util.x_axis([0.0, 0.5, 1.0], ["0%", "50%", "100%"], "busy / job span")
    util.y_axis(list(range(len(uses))), shown)
    line = chart.plot(left + util_w + gap, top, 2.3 * util_w, height, (0.0, span or 1.0), rows, y_down=True)
    for i, u in enumerate(uses):
        # A busy box is at least 1/1200 of the span wide, so an instant's work still shows.
        boxes = [(s, s + max(e - s, span / 1200)) for s, e in u.intervals]
        line.group(f"workers-busy-{i}", lambda b=boxes, i=i: [line.bar(s, e, i - 0.35, i + 0.35, _BAR) for s, e in b])
    line.x_axis(*_clock_ticks(span), "elapsed time (busy intervals)")
    line.y_axis([], None)  # shares the rows of the utilisation plot: a spine, no labels
    return chart.svg()


def latency_svg(latency_s: Sequence[float | None], sample_s: Sequence[float | None], bins: int = 30) -> str:
    """Two histograms on one time axis: item latency and sampling time (``{series}-bar-{i}``)."""
    title = "Latency per image"
    series = [
        ("latency", "end to end (finished_at − started_at)", np.sort(_finite_values(latency_s)), _BAR),
        ("sample", "sampling (sample_s)", np.sort(_finite_values(sample_s)), _BAR_SAMPLE),
    ]
    series = [s for s in series if len(s[2])]
    if not series:
        return _no_data(title, "no timings")
    hi = max(float(vals[-1]) for _, _, vals, _ in series)
    # A round upper end (the first 1-2-2.5-5 tick at or above the slowest item, at most 6 intervals) so bins
    # have round edges.
    hi = hi if hi > 0 else 1.0
    x_hi = nice_ticks(0.0, hi, nice_step(hi, 6), cover=True)[-1]
    width = x_hi / bins
    chart = Chart(_WIDTH, (1.0 + 2.3 * len(series)) * _PT, title, f"{bins} bins of {width:.3g} s", muted=_MUTED)
    gap = 12.0  # a shared time axis: no tick labels between the plots
    top, height = _stack(chart, len(series), gap)
    counts = [histogram(vals, bins, 0.0, x_hi) for _, _, vals, _ in series]
    y_axes = [_value_ticks(0.0, max(c) * 1.05, height, vertical=True, integer=True, most=4) for c in counts]
    left = _left_margin(label for _, labels in y_axes for label in labels)
    x_ticks, x_labels = _value_ticks(0.0, x_hi, chart.width - left - _RIGHT, vertical=False)
    for k, ((name, label, vals, colour), c, (y_ticks, y_labels)) in enumerate(zip(series, counts, y_axes)):
        y_hi = max(c) * 1.05
        plot = chart.plot(
            left, _top_of(k, top, height, gap), chart.width - left - _RIGHT, height, (0.0, x_hi), (0, y_hi)
        )
        plot.y_grid(y_ticks)
        for i, count in enumerate(c):
            plot.bar(i * width, (i + 1) * width, 0.0, count, colour, id=f"{name}-bar-{i}", edge=("#ffffff", 0.5))
        p50, p90, p99 = (_quantile(vals, q) for q in (0.5, 0.9, 0.99))
        plot.title(
            f"{label}: n={len(vals)}, p50 {p50:.3g} s, p90 {p90:.3g} s, p99 {p99:.3g} s, max {float(vals[-1]):.3g} s"
        )
        last = k == len(series) - 1
        plot.x_axis(x_ticks, x_labels if last else None, "seconds" if last else None)
        plot.y_axis(y_ticks, y_labels, "images")
    return chart.svg()


def write_plots(storage, table) -> dict[str, str]:
    """Draw the three charts from a metadata table and store them; returns name -> key.

    ``storage`` is a :class:`snapref_ray.storage.backends.Storage`; ``table`` a
    ``pyarrow.Table`` with the metadata columns (only ``worker_id``, ``started_at``,
    ``finished_at`` and ``sample_s`` are read; a missing column draws an empty chart).
    """

    def floats(name: str) -> np.ndarray:  # null -> NaN, as float64 (a float32 column's values unchanged)
        if name not in table.column_names:
            return np.full(table.num_rows, np.nan)
        return table.column(name).to_numpy(zero_copy_only=False).astype(np.float64)

    started, finished = floats("started_at"), floats("finished_at")
    workers = table.column("worker_id").to_pylist() if "worker_id" in table.column_names else [None] * len(started)
    svgs = {
        "throughput": throughput_svg(finished, start=job_start(started)),
        "workers": workers_svg(workers, started, finished),
        "latency": latency_svg(finished - started, floats("sample_s")),
    }
    for name, svg in svgs.items():
        storage.put_bytes(PLOT_KEYS[name], svg.encode("utf-8"), content_type="image/svg+xml")
    return dict(PLOT_KEYS)


def job_start(started_at: Iterable[float | None]) -> float | None:
    """The first ``started_at`` (None when no item has one): where throughput is counted from."""
    starts = _finite_values(started_at)
    return float(starts.min()) if len(starts) else None


# ----------------------------------------------------------------------------- helpers


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _floats(values) -> np.ndarray:
    """`values` as float64, NaN where a value is not a finite number (None, a bool, a string)."""
    if isinstance(values, np.ndarray) and values.dtype.kind == "f":
        return values.astype(np.float64, copy=False)
    return np.fromiter((float(v) if _finite(v) else np.nan for v in values), np.float64)


def _finite_values(values) -> np.ndarray:
    """The finite numbers of `values`, in order, as float64 (a million of them without a Python step each
    when they come as a float array)."""
    vals = _floats(values)
    return vals[np.isfinite(vals)]


def _merge(starts: np.ndarray, ends: np.ndarray, gap: float) -> list[tuple[float, float]]:
    """Union of intervals sorted by start, joining those separated by at most ``gap``."""
    if not len(starts):
        return []
    reach = np.maximum.accumulate(ends)  # the end of the union so far: where the next interval must start
    first = np.flatnonzero(np.r_[True, starts[1:] > reach[:-1] + gap])
    last = np.r_[first[1:] - 1, len(starts) - 1]
    return list(zip(starts[first].tolist(), reach[last].tolist(), strict=True))


def _natural_key(s: str) -> list:
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", s) if p]


def _quantile(vals: np.ndarray, q: float) -> float:
    """The `q` quantile of sorted `vals`, linearly interpolated."""
    pos = q * (len(vals) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(vals) - 1)
    return float(vals[lo] + (vals[hi] - vals[lo]) * (pos - lo))
