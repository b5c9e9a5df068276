"""Reports of a batch job's output: the HTML gallery and throughput plots (SVG)."""

from snapref_ray.report.gallery import errors_page_key, failed_items, page_key, write_gallery
from snapref_ray.report.plots import PLOT_KEYS, write_plots
from snapref_ray.report.report import NoJobOutputError, write_report

__all__ = [
    "PLOT_KEYS",
    "NoJobOutputError",
    "errors_page_key",
    "failed_items",
    "page_key",
    "write_gallery",
    "write_plots",
    "write_report",
]
