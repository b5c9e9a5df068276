"""Report plots: the numbers behind each chart, and the charts read back from the SVG drawn.

The charts' bars and lines carry ids (``throughput-bar-3``, ``throughput-mean``...); a value is read
back through the drawn axis: the y tick labels and their tick marks' positions give the point-to-value
scale (report/svg_chart.py: a ``<g class="axes">`` per plot, a ``<g class="ytick">`` per tick).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pyarrow as pa
import pytest

from snapref_ray.report.plots import (
    PLOT_KEYS,
    format_duration,
    histogram,
    images_per_minute,
    latency_svg,
    throughput_svg,
    worker_utilisation,
    workers_svg,
    write_plots,
)
from snapref_ray.storage.backends import open_storage

SVG = "{http://www.w3.org/2000/svg}"
T0 = 1_700_000_000.0


def parse(svg: str) -> ET.Element:
    """The SVG document as XML (which fails on anything left unescaped)."""
    root = ET.fromstring(svg.encode("utf-8"))
    assert root.tag == f"{SVG}svg"
    return root


def bars(svg: str, series: str | None = None) -> list[ET.Element]:
    """The drawn bars (``{series}-bar-{i}``), in index order."""
    found = []
    for el in parse(svg).iter():
        m = re.fullmatch(r"(\w+)-bar-(\d+)", el.get("id", ""))
        if m and (series is None or m.group(1) == series):
            found.append((m.group(1), int(m.group(2)), el))
    return [el for _, _, el in sorted(found, key=lambda t: (t[0], t[1]))]


def box(element: ET.Element) -> tuple[float, float, float, float]:
    """(x0, y0, x1, y1) in points of a ``<rect>`` or ``<line>`` (y grows downwards)."""
    if element.tag == f"{SVG}line":
        xs, ys = (float(element.get(k)) for k in ("x1", "x2")), (float(element.get(k)) for k in ("y1", "y2"))
        (x0, x1), (y0, y1) = sorted(xs), sorted(ys)
        return x0, y0, x1, y1
    assert element.tag == f"{SVG}rect", element.tag
    x, y, w, h = (float(element.get(k)) for k in ("x", "y", "width", "height"))
    return x, y, x + w, y + h


def y_ticks(axes: ET.Element) -> list[tuple[float, ET.Element]]:
    """(y of the tick mark, its label) of each y tick of a plot."""
    ticks = []
    for g in axes.iter(f"{SVG}g"):
        if g.get("class") == "ytick":
            ticks.append((float(next(g.iter(f"{SVG}line")).get("y1")), next(g.iter(f"{SVG}text"))))
    return ticks


def y_scale(svg: str, element_id: str):
    """point y -> data value on the y axis of the plot that holds ``element_id``, from its tick labels."""
    root = parse(svg)
    axes = next(
        g for g in root.iter(f"{SVG}g") if g.get("class") == "axes" and g.find(f".//*[@id='{element_id}']") is not None
    )
    ticks = [(y, float(label.text.replace("\u2212", "-"))) for y, label in y_ticks(axes)]
    (ya, va), (yb, vb) = ticks[0], ticks[-1]
    return lambda y: va + (y - ya) * (vb - va) / (yb - ya)


def bar_values(svg: str, series: str) -> list[float]:
    """The value of each vertical bar of ``series``, read through its axis."""
    found = bars(svg, series)
    value = y_scale(svg, found[0].get("id"))
    return [value(box(g)[1]) for g in found]


def mean_line_value(svg: str) -> float:
    value = y_scale(svg, "throughput-mean")
    mean = next(el for el in parse(svg).iter() if el.get("id") == "throughput-mean")
    x0, y0, x1, y1 = box(mean)
    assert y0 == y1  # horizontal
    return value(y0)


def test_images_per_minute_bins_and_rates():
    finished = [T0 + t for t in (1, 2, 3, 61, 62, 130)]
    # 130 s in bins of 60 s: the 10 s left over widen the last bin to 60-130 s, which holds 3 images.
    # (Drawn as a whole minute, that remainder was the bug that put the mean line above every bar.)
    bin_s, rates = images_per_minute(finished, start=T0, max_bins=3)
    assert bin_s == 60.0 and rates == pytest.approx([3.0, 3 * 60 / 70])
    # 100 s: the 40 s left over are at least half a bin, so they are a bin of their own (3 images in 40 s).
    bin_s, rates = images_per_minute([T0 + t for t in (1, 2, 3, 61, 62, 100)], start=T0, max_bins=3)
    assert bin_s == 60.0 and rates == pytest.approx([3.0, 3 * 60 / 40])
    # 130 s needs 26 bins of 5 s to stay within 60 bars; each image in a 5 s bin is 12 / min.
    bin_s, rates = images_per_minute(finished, start=T0)
    assert bin_s == 5.0 and len(rates) == 26
    assert rates[0] == 36.0 and rates[12] == 24.0 and rates[25] == 12.0 and sum(rates) == 6 * 12.0
    assert images_per_minute([], start=None) == (1.0, [])


def test_throughput_svg_has_one_bar_per_bin():
    finished = [T0 + 0.5 * i for i in range(240)]  # 2 images per second for 2 minutes
    bin_s, rates = images_per_minute(finished)
    assert bin_s == 2.0 and len(rates) == 60
    svg = throughput_svg(finished)
    assert len(bars(svg)) == 60
    assert bar_values(svg, "throughput") == pytest.approx(rates, rel=1e-3)
    assert rates[:-1] == [120.0] * 59  # the last bin also holds the image at exactly 119.5 s
    assert rates[-1] == pytest.approx(4 * 60 / 1.5)  # 118-119.5 s: 4 images in 1.5 s
    # The last bar is drawn 1.5 s wide, three quarters of the others.
    widths = [box(g)[2] - box(g)[0] for g in bars(svg)]
    assert widths[-1] / widths[0] == pytest.approx(0.75, rel=1e-3)


def test_throughput_mean_line_is_the_time_weighted_mean_of_the_bars():
    """The chart's mean line lies inside its bars: the bars' mean over the drawn time is the mean line.

    206 images, one every 0.1 s from the first start, span 20.5 s in bins of 1 s: the last half
    second (6 images) drawn as a whole second showed 360 / min under a mean of 603 / min, with
    every bar (600 / min) below the mean line.
    """
    finished = [T0 + i / 10 for i in range(206)]
    svg = throughput_svg(finished, start=T0)
    mean = mean_line_value(svg)
    assert mean == pytest.approx(206 / 20.5 * 60, rel=1e-3)  # images over the time from start to the last
    values = bar_values(svg, "throughput")
    widths = [box(g)[2] - box(g)[0] for g in bars(svg, "throughput")]
    weighted = sum(v * w for v, w in zip(values, widths)) / sum(widths)
    assert weighted == pytest.approx(mean, rel=2e-3)
    assert min(values) <= mean <= max(values)
    assert "mean 603 images / min" in svg


def test_worker_utilisation_is_union_of_busy_intervals_over_job_span():
    workers = ["a", "a", "b", None]
    started = [T0, T0 + 5, T0 + 20, T0]
    finished = [T0 + 10, T0 + 15, T0 + 30, T0 + 99]  # the row without a worker is ignored
    span, uses = worker_utilisation(workers, started, finished)
    assert span == 30.0
    assert [(u.worker_id, u.items, u.busy_s) for u in uses] == [("a", 2, 15.0), ("b", 1, 10.0)]
    assert [u.utilisation for u in uses] == pytest.approx([0.5, 1 / 3])
    assert uses[0].intervals == [(0.0, 15.0)]


def test_workers_svg_one_bar_per_worker_in_natural_order_with_escaped_ids():
    workers = ["w1<&>", "w10", "w10", "w9"]
    started = [T0, T0, T0 + 10, T0 + 5]
    finished = [T0 + 20, T0 + 5, T0 + 20, T0 + 10]
    svg = workers_svg(workers, started, finished)
    root = parse(svg)  # well-formed XML: the id's <&> is escaped
    rects = bars(svg)
    assert len(rects) == 3
    # Ordered w1<&>, w9, w10 from the top: numbers in ids compare as numbers. A bar's share of its track
    # is the utilisation.
    tracks = {el.get("id"): el for el in root.iter() if el.get("id", "").startswith("workers-track-")}
    shares = [
        (box(r)[2] - box(r)[0]) / (box(tracks[f"workers-track-{i}"])[2] - box(tracks[f"workers-track-{i}"])[0])
        for i, r in enumerate(rects)
    ]
    assert shares == pytest.approx([1.0, 0.25, 0.75], rel=1e-3)
    assert [box(r)[1] for r in rects] == sorted(box(r)[1] for r in rects)  # first worker on top
    util_axes = next(g for g in root.iter(f"{SVG}g") if g.get("class") == "axes")
    assert [label.text for _, label in sorted(y_ticks(util_axes), key=lambda t: t[0])] == ["w1<&>", "w9", "w10"]
    assert "w1&lt;&amp;&gt;" in svg


def test_histogram_counts_and_clipping():
    assert histogram([0.0, 0.5, 1.0, 2.5, 9.0, None, float("nan"), -1.0], bins=3, lo=0.0, hi=3.0) == [3, 1, 2]


def test_latency_svg_two_series_of_bars():
    latency = [1.0, 2.0, 2.5, 4.0, 8.0]
    sample = [0.8, 1.5, 2.0, 3.5, None]
    svg = latency_svg(latency, sample, bins=10)
    lat, smp = bars(svg, "latency"), bars(svg, "sample")
    assert len(lat) == 10 and len(smp) == 10
    # 8 s spans [0, 8]: bins of 0.8 s.
    assert [round(v, 3) for v in bar_values(svg, "latency")] == [0, 1, 1, 1, 0, 1, 0, 0, 0, 1]
    assert [round(v, 3) for v in bar_values(svg, "sample")] == [0, 2, 1, 0, 1, 0, 0, 0, 0, 0]
    assert box(lat[-1])[2] == pytest.approx(box(smp[-1])[2])  # one time axis


def test_durations():
    assert [format_duration(s) for s in (4.25, 42.0, 200.0, 7500.0)] == ["4.2 s", "42 s", "3 min 20 s", "2 h 05 min"]


def test_write_plots_stores_three_svgs(tmp_path):
    storage = open_storage(str(tmp_path / "job"))
    table = pa.table(
        {
            "worker_id": ["w0", "w1", "w0", "w1"],
            "started_at": [T0, T0, T0 + 4, T0 + 3],
            "finished_at": [T0 + 4, T0 + 3, T0 + 8, T0 + 6],
            "sample_s": [3.5, 2.5, 3.5, 2.5],
        }
    )
    assert write_plots(storage, table) == PLOT_KEYS
    svgs = {name: storage.get_bytes(key).decode("utf-8") for name, key in PLOT_KEYS.items()}
    assert len(bars(svgs["throughput"])) == 8  # 8 s of completions in 1 s bins
    assert len(bars(svgs["workers"])) == 2
    assert len(bars(svgs["latency"], "latency")) == 30 and len(bars(svgs["latency"], "sample")) == 30


def test_write_plots_with_no_rows_draws_empty_charts(tmp_path):
    storage = open_storage(str(tmp_path / "job"))
    empty = pa.table(
        {
            "worker_id": pa.array([], pa.string()),
            "started_at": pa.array([], pa.float64()),
            "finished_at": pa.array([], pa.float64()),
            "sample_s": pa.array([], pa.float64()),
        }
    )
    write_plots(storage, empty)
    for key in PLOT_KEYS.values():
        svg = storage.get_bytes(key).decode("utf-8")
        assert bars(svg) == [] and "No data to plot." in svg
