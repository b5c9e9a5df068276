"""A judged job's report (docs/judging.md): what was kept and rejected, by reference and by check, what the kept
images cost, and one histogram per score — the charts a threshold is chosen from.

Read from the metadata alone (the judged columns of every committed row, the first row per item_id as every
reader keeps it), so it describes the output, whichever runs made it. Writes ``report/scores.svg`` (bars of kept
and rejected renders stacked per bin, ids ``score-<name>-kept-<i>`` / ``score-<name>-rejected-<i>``) and
``report/judging.json`` (the counts).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from snapref_ray.report.plots import _MUTED, _PT, _RIGHT, _WIDTH, _left_margin, _no_data, _stack, _top_of, _value_ticks
from snapref_ray.report.svg_chart import Chart, LegendEntry
from snapref_ray.storage.metadata import first_row_per_id, read_table_columns

SCORES_KEY = "report/scores.svg"
JUDGING_KEY = "report/judging.json"

# The score columns drawn, with the axis each is read on.
SCORE_AXES = {
    "score_near_duplicate": "Hamming bits to the nearest kept image of its reference",
    "score_sanity_std": "std of the most varied channel (0-255)",
    "score_sanity_luminance": "mean luminance (0-255)",
    "score_sanity_clipped": "fraction of values at 0 or 255",
    "score_identity_gap": "identity gap (loss with another reference - with its own)",
    "score_embedding": "embedding similarity to its reference",
}
_READ = ["item_id", "render_of", "reference_hash", "accepted", "rejected_by", "sample_s", "decode_s", "forward_batch"]
_KEPT, _REJECTED = "#3b82c4", "#c8453b"


@dataclass
class JudgeReport:
    """The counts of a judged output (`judging.json`; the gallery header shows the totals and the cost)."""

    renders: int
    kept: int
    rejected: int
    items: int  # items (render_of) with at least one render
    renders_per_kept_image: float | None
    gpu_seconds_per_kept_image: float | None
    rejected_by: dict[str, int] = field(default_factory=dict)  # per check
    references: list[dict] = field(default_factory=list)  # reference_hash, renders, kept, rejected


def read_judged(storage) -> pa.Table | None:
    """The judged columns of the committed rows (first per item_id); None when the output was not judged."""
    table = read_table_columns(storage, [*_READ, *SCORE_AXES])
    if not table.num_rows or "render_of" not in table.column_names:
        return None
    table = table.filter(pc.is_valid(table.column("render_of")))
    if not table.num_rows:
        return None
    return first_row_per_id(table)


def judge_report(table: pa.Table) -> JudgeReport:
    """Kept vs rejected per reference and per check, and the cost per kept image, from `read_judged`'s table."""
    accepted = pc.fill_null(table.column("accepted").cast(pa.bool_()), False)
    kept = int(pc.sum(accepted).as_py() or 0)
    renders = table.num_rows
    checks: dict[str, int] = {}
    for text in table.column("rejected_by").drop_null().to_pylist():
        for check in text.split(","):
            checks[check] = checks.get(check, 0) + 1
    seconds = pc.add(
        pc.fill_null(table.column("sample_s").cast(pa.float64()), 0.0),
        pc.fill_null(table.column("decode_s").cast(pa.float64()), 0.0),
    )
    batch = pc.max_element_wise(pc.fill_null(table.column("forward_batch").cast(pa.float64()), 1.0), 1.0)
    gpu_seconds = float(pc.sum(pc.divide(seconds, batch)).as_py() or 0.0)
    per_ref = (
        table.select(["reference_hash"])
        .append_column("kept", accepted.cast(pa.int64()))
        .group_by("reference_hash", use_threads=False)
        .aggregate([("kept", "sum"), ("kept", "count")])
    )
    references = [
        {"reference_hash": h, "renders": n, "kept": k, "rejected": n - k}
        for h, k, n in zip(
            per_ref.column("reference_hash").to_pylist(),
            per_ref.column("kept_sum").to_pylist(),
            per_ref.column("kept_count").to_pylist(),
            strict=True,
        )
    ]
    return JudgeReport(
        renders=renders,
        kept=kept,
        rejected=renders - kept,
        items=len(pc.unique(table.column("render_of"))),
        renders_per_kept_image=round(renders / kept, 4) if kept else None,
        gpu_seconds_per_kept_image=round(gpu_seconds / kept, 4) if kept else None,
        rejected_by=dict(sorted(checks.items())),
        references=sorted(references, key=lambda r: r["reference_hash"]),
    )


def scores_svg(table: pa.Table, bins: int = 24) -> str:
    """One histogram per score a check recorded, kept and rejected renders stacked."""
    title = "Judge scores (kept and rejected renders)"
    accepted = pc.fill_null(table.column("accepted").cast(pa.bool_()), False).to_numpy(zero_copy_only=False)
    series = []
    for name, axis in SCORE_AXES.items():
        if name not in table.column_names:
            continue
        values = table.column(name).cast(pa.float64()).to_numpy(zero_copy_only=False)
        finite = np.isfinite(values)
        if finite.any():
            series.append((name, axis, values, finite))
    if not series:
        return _no_data(title, "no scores recorded")
    chart = Chart(
        _WIDTH,
        (0.6 + 2.2 * len(series)) * _PT,
        title,
        f"{len(accepted)} renders; blue kept, red rejected",
        muted=_MUTED,
    )
    gap = 36.0  # each score has its own axis: tick labels and the axis label between the plots
    top, height = _stack(chart, len(series), gap)
    drawn = []
    for name, axis, values, finite in series:
        lo, hi = float(values[finite].min()), float(values[finite].max())
        if hi <= lo:
            hi = lo + 1.0
        edges = np.linspace(lo, hi, bins + 1)
        kept, _ = np.histogram(values[finite & accepted], edges)
        rejected, _ = np.histogram(values[finite & ~accepted], edges)
        y_hi = float((kept + rejected).max()) * 1.05
        drawn.append((name, axis, finite, edges, kept, rejected, y_hi, _value_ticks(0.0, y_hi, height, vertical=True)))
    left = _left_margin(label for *_, (_, labels) in drawn for label in labels)
    width = chart.width - left - _RIGHT
    for k, (name, axis, finite, edges, kept, rejected, y_hi, (y_ticks, y_labels)) in enumerate(drawn):
        margin = 0.05 * (edges[-1] - edges[0])  # bars off the axes' ends, as a plotting library's autoscale leaves them
        x_lim = (float(edges[0]) - margin, float(edges[-1]) + margin)
        plot = chart.plot(left, _top_of(k, top, height, gap), width, height, x_lim, (0.0, y_hi))
        short = name.removeprefix("score_")
        for i, (a, b, n_kept, n_rejected) in enumerate(zip(edges, edges[1:], kept, rejected)):
            plot.bar(float(a), float(b), 0.0, float(n_kept), _KEPT, id=f"score-{short}-kept-{i}")
            plot.bar(
                float(a),
                float(b),
                float(n_kept),
                float(n_kept + n_rejected),
                _REJECTED,
                id=f"score-{short}-rejected-{i}",
            )
        plot.title(f"{name}: n={int(finite.sum())}, kept {int((finite & accepted).sum())}")
        if k == 0:
            plot.legend([LegendEntry("kept", _KEPT), LegendEntry("rejected", _REJECTED)])
        plot.x_axis(*_value_ticks(*x_lim, width, vertical=False), axis)
        plot.y_axis(y_ticks, y_labels, "renders")
    return chart.svg()


def write_judging(storage, table: pa.Table) -> JudgeReport:
    """Store ``report/scores.svg`` and ``report/judging.json``; returns the counts."""
    report = judge_report(table)
    storage.put_bytes(SCORES_KEY, scores_svg(table).encode("utf-8"), content_type="image/svg+xml")
    storage.put_bytes(JUDGING_KEY, json.dumps(asdict(report), indent=1).encode(), content_type="application/json")
    return report


__all__ = ["JUDGING_KEY", "SCORES_KEY", "JudgeReport", "judge_report", "read_judged", "scores_svg", "write_judging"]
