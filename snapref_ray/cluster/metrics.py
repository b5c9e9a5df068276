"""Ray metrics the dashboard and Prometheus scrape (ray.util.metrics), created lazily per process.

Metric objects register with the local Ray worker when constructed, so they are built on first
use inside the process that records them (driver or worker), never at import time.
"""

from __future__ import annotations

from functools import lru_cache

# Latency buckets in seconds: sub-second tiny-model steps up to minutes-long real images.
_LATENCY_BOUNDARIES = [0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300]


class JobMetrics:
    """Counters and histograms of a batch job; tags: worker (and stage for errors)."""

    def __init__(self) -> None:
        from ray.util.metrics import Counter, Gauge, Histogram

        self.images = Counter("snapref_images_rendered", "Images rendered and stored", tag_keys=("worker",))
        self.encodes = Counter(
            "snapref_references_encoded", "References run through the reference stream", tag_keys=("worker",)
        )
        self.cache_hits = Counter(
            "snapref_refkv_cache_hits", "Renders whose RefKV was already on the worker's device", tag_keys=("worker",)
        )
        self.cache_misses = Counter(
            "snapref_refkv_cache_misses", "Renders that had to fetch or encode a RefKV", tag_keys=("worker",)
        )
        self.errors = Counter("snapref_item_errors", "Items that failed an attempt", tag_keys=("stage",))
        self.step_latency = Histogram(
            "snapref_step_seconds", "Seconds per sampling step", boundaries=_LATENCY_BOUNDARIES, tag_keys=("worker",)
        )
        self.image_latency = Histogram(
            "snapref_image_seconds",
            "Seconds from batch start to stored image",
            boundaries=_LATENCY_BOUNDARIES,
            tag_keys=("worker",),
        )
        self.cache_bytes = Gauge(
            "snapref_refkv_cache_bytes", "Bytes of RefKV held on the worker's device", tag_keys=("worker",)
        )


@lru_cache(maxsize=1)
def job_metrics() -> JobMetrics:
    return JobMetrics()
