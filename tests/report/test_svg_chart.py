"""The SVG chart writer (report/svg_chart.py): tick choice, the data-to-point mapping, escaping and ids."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pyarrow as pa
import pytest

from snapref_ray.report.judging import scores_svg
from snapref_ray.report.plots import latency_svg, throughput_svg, workers_svg
from snapref_ray.report.svg_chart import Chart, LegendEntry, nice_step, nice_ticks, tick_labels
from tests.report.test_plots import box, parse, y_scale

SVG = "{http://www.w3.org/2000/svg}"


def element(root: ET.Element, element_id: str) -> ET.Element:
    return next(el for el in root.iter() if el.get("id") == element_id)


@pytest.mark.parametrize(
    ("span", "intervals", "integer", "step"),
    [
        (8.0, 6, False, 2.0),  # 0 2 4 6 8: a latency axis up to 8 s (1 s would need 8 intervals)
        (8.34, 6, False, 2.0),
        (126.0, 9, False, 20.0),  # 14 per interval rounds up to 20, not to 25 (2.5 comes before 5)
        (0.9, 4, False, 0.25),
        (1.05, 4, True, 1.0),  # counts: never a step of 0.5 or 0.25
        (37.0, 4, True, 10.0),
        (3e-4, 6, False, 5e-5),
        (0.0, 4, False, 1.0),  # nothing to split: a unit step, not a zero one
    ],
)
def test_nice_step_is_the_smallest_round_step_within_the_intervals(span, intervals, integer, step):
    assert nice_step(span, intervals, integer) == pytest.approx(step, rel=1e-12)


def test_nice_ticks_inside_and_covering():
    assert nice_ticks(0.0, 8.34, 2.0) == [0.0, 2.0, 4.0, 6.0, 8.0]
    assert nice_ticks(0.0, 8.34, 2.0, cover=True)[-1] == 10.0  # the latency axis's round upper end
    assert nice_ticks(0.0, 8.0, 2.0, cover=True)[-1] == 8.0  # already round: not a step further
    assert nice_ticks(-0.255, 0.955, 0.2) == pytest.approx([-0.2, 0.0, 0.2, 0.4, 0.6, 0.8])
    # A tick a rounding error past the end is still in (3 x 0.1 is 0.30000000000000004).
    assert len(nice_ticks(0.0, 0.3, 0.1)) == 4


def test_tick_labels_share_the_decimals_of_the_step_and_use_a_true_minus():
    assert tick_labels([0.0, 0.25, 0.5], 0.25) == ["0.00", "0.25", "0.50"]
    assert tick_labels([-0.2, 0.0, 0.2], 0.2) == ["\u22120.2", "0.0", "0.2"]
    assert tick_labels([0.0, 20.0, 40.0], 20.0) == ["0", "20", "40"]
    assert tick_labels([-1e-17], 0.1) == ["0.0"]  # never "-0.0"


def test_plot_maps_data_to_points_and_reads_back_through_its_axis():
    chart = Chart(200, 150, "t", "s")
    plot = chart.plot(40, 50, 100, 80, (0.0, 2.0), (0.0, 4.0))
    plot.bar(0.0, 1.0, 0.0, 2.0, "#000", id="b-bar-0")
    plot.hline(3.0, "#f00", dash="2,2", id="line")
    plot.y_axis([0.0, 2.0, 4.0], ["0", "2", "4"], "value")
    svg = chart.svg()
    root = parse(svg)
    assert box(element(root, "b-bar-0")) == (40.0, 90.0, 90.0, 130.0)  # left half, lower half
    assert box(element(root, "line")) == (40.0, 70.0, 140.0, 70.0)
    assert y_scale(svg, "line")(70.0) == pytest.approx(3.0)
    rows = Chart(200, 150, "t", "s").plot(0, 0, 100, 100, (0, 1), (-0.5, 1.5), y_down=True)
    assert rows.y(0) == 25.0 and rows.y(1) == 75.0  # the first row on top


def test_text_and_ids_are_escaped_and_read_back_as_written():
    nasty = "w<1> & \"q\" 'x'"
    chart = Chart(300, 120, f"title {nasty}", f"sub {nasty}")
    plot = chart.plot(60, 50, 200, 40, (0.0, 1.0), (0.0, 1.0))
    plot.bar(0.0, 1.0, 0.0, 1.0, "#000", id=f"id-{nasty}")
    plot.title(nasty)
    plot.legend([LegendEntry(nasty, "#f00", dash="4,2"), LegendEntry("kept", "#00f")])
    plot.y_axis([0.0], [nasty], nasty)
    root = parse(chart.svg())  # well-formed XML
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert f"title {nasty}" in texts and f"sub {nasty}" in texts and texts.count(nasty) == 4
    assert element(root, f"id-{nasty}").tag == f"{SVG}rect"


def test_charts_are_the_same_bytes_for_the_same_table():
    finished = [1_700_000_000.0 + 0.37 * i for i in range(50)]
    started = [f - 1.3 for f in finished]
    workers = [f"w{i % 3}" for i in range(50)]
    first = (throughput_svg(finished), workers_svg(workers, started, finished), latency_svg([1.3] * 50, [0.9] * 50))
    again = (throughput_svg(finished), workers_svg(workers, started, finished), latency_svg([1.3] * 50, [0.9] * 50))
    assert first == again


def test_latency_axis_ends_at_a_round_value_and_bins_share_it():
    svg = latency_svg([1.0, 8.34], [0.5], bins=10)  # 8.34 s rounds up to 10 s: bins of 1 s
    assert "10 bins of 1 s" in svg
    root = parse(svg)
    x0 = box(element(root, "latency-bar-0"))[0]
    x_end = box(element(root, "latency-bar-9"))[2]
    assert box(element(root, "latency-bar-1"))[0] - x0 == pytest.approx((x_end - x0) / 10, rel=1e-3)


def ids(svg: str) -> set[str]:
    return {el.get("id") for el in parse(svg).iter() if el.get("id") and not el.get("id").startswith("axes-")}


def test_charts_carry_the_ids_readers_look_up():
    """Exactly the ids tests, the judge loop's checks and readers of the SVG find the drawn elements by."""
    t0 = 1_700_000_000.0
    finished = [t0 + 1, t0 + 2, t0 + 3]  # 3 s in 1 s bins
    assert ids(throughput_svg(finished, start=t0)) == {"throughput-bar-0", "throughput-bar-1", "throughput-bar-2"} | {
        "throughput-mean"
    }
    assert ids(workers_svg(["a", "b"], [t0, t0 + 1], [t0 + 2, t0 + 3])) == {
        f"workers-{part}-{i}" for part in ("track", "bar", "busy") for i in (0, 1)
    }
    assert ids(latency_svg([1.0, 2.0], [0.5], bins=3)) == {
        f"{s}-bar-{i}" for s in ("latency", "sample") for i in range(3)
    }
    table = pa.table({"accepted": [True, False], "score_sanity_std": [10.0, 50.0]})
    assert ids(scores_svg(table, bins=2)) == {f"score-sanity_std-{k}-{i}" for k in ("kept", "rejected") for i in (0, 1)}
