"""Report plots: the numbers behind each chart and the SVG they draw."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pyarrow as pa
import pytest

from snapref_ray.report.plots import (
    PLOT_KEYS,
    format_duration,
    histogram,
    images_per_minute,
    latency_svg,
    nice_ticks,
    throughput_svg,
    worker_utilisation,
    workers_svg,
    write_plots,
)
from snapref_ray.storage.backends import open_storage

SVG = "{http://www.w3.org/2000/svg}"
T0 = 1_700_000_000.0


def bars(svg: str, series: str | None = None) -> list[ET.Element]:
    """The ``rect.bar`` elements of an SVG document (parsing it as XML on the way)."""
    root = ET.fromstring(svg.encode("utf-8"))
    assert root.tag == f"{SVG}svg"
    return [
        r
        for r in root.iter(f"{SVG}rect")
        if "bar" in r.get("class", "").split() and (series is None or r.get("data-series") == series)
    ]


def test_images_per_minute_bins_and_rates():
    finished = [T0 + t for t in (1, 2, 3, 61, 62, 130)]
    assert images_per_minute(finished, start=T0, max_bins=3) == (60.0, [3.0, 2.0, 1.0])
    # 130 s needs 26 bins of 5 s to stay within 60 bars; each image in a 5 s bin is 12 / min.
    bin_s, rates = images_per_minute(finished, start=T0)
    assert bin_s == 5.0 and len(rates) == 26
    assert rates[0] == 36.0 and rates[12] == 24.0 and rates[25] == 12.0 and sum(rates) == 6 * 12.0
    assert images_per_minute([], start=None) == (1.0, [])


def test_throughput_svg_has_one_bar_per_bin():
    finished = [T0 + 0.5 * i for i in range(240)]  # 2 images per second for 2 minutes
    bin_s, rates = images_per_minute(finished)
    assert bin_s == 2.0 and len(rates) == 60
    rects = bars(throughput_svg(finished))
    assert len(rects) == 60
    assert [float(r.get("data-value")) for r in rects] == pytest.approx(rates)
    assert rates[:-1] == [120.0] * 59  # the last bin also holds the image at exactly 119.5 s


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
    rects = bars(svg)
    assert len(rects) == 3
    # Ordered w1<&>, w9, w10: numbers in ids compare as numbers.
    assert [float(r.get("data-value")) for r in rects] == pytest.approx([1.0, 0.25, 0.75])
    assert 'data-worker-id="w1&lt;&amp;&gt;"' in svg


def test_histogram_counts_and_clipping():
    assert histogram([0.0, 0.5, 1.0, 2.5, 9.0, None, float("nan"), -1.0], bins=3, lo=0.0, hi=3.0) == [3, 1, 2]


def test_latency_svg_two_series_of_bars():
    latency = [1.0, 2.0, 2.5, 4.0, 8.0]
    sample = [0.8, 1.5, 2.0, 3.5, None]
    svg = latency_svg(latency, sample, bins=10)
    lat, smp = bars(svg, "latency"), bars(svg, "sample")
    assert len(lat) == 10 and len(smp) == 10
    assert [int(r.get("data-value")) for r in lat] == [0, 1, 1, 1, 0, 1, 0, 0, 0, 1]  # 8 s spans [0, 8]
    assert sum(int(r.get("data-value")) for r in smp) == 4


def test_nice_ticks_and_durations():
    assert nice_ticks(0, 7.3) == [0, 2, 4, 6]
    assert nice_ticks(0, 1.0) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(0, 12.0, 4) == [0, 5, 10]
    assert nice_ticks(0, 3600) == [0, 1000, 2000, 3000]
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
