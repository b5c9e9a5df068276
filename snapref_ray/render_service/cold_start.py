"""A worker's cold start, measured: model load, compile (built vs loaded from the cache), warm-up, first image.

A new GPU worker or Serve replica is useful only once its graphs exist for the work it will get; until
then the first request pays for them. `warm_up` renders the sizes and batch sizes the work will use
(a job's plan knows them; a serve config names them in `warmup_sizes`), so the graphs are built, or
loaded from the shared compile cache, before the worker reports ready. `ColdStart` is what that cost,
as the job summary and `GET /v1/models` report it per worker.
"""

from __future__ import annotations

import io
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from snapref_ray.requests import RenderRequest, RenderSettings

# One step, at the schedule's first sigma: the rows it runs are the rows of every step inside the reference
# window. (A window that starts later, with ref_outside="no_reference", leaves the reading layout to the
# first real batch; 1-step renders are also what benchmarks/e2e_timings.py counts apart from a job's.)
WARMUP_STEPS = 1


@dataclass(frozen=True)
class ColdStart:
    """Seconds from a worker's start to its first image, by phase (JSON via `as_dict`)."""

    model_load_s: float  # files read and weights on the device (s3:// fetches included when loaded by the service)
    compiled: bool
    compile_s: float  # forwards that produced a new graph: tracing plus the build or the cache load
    graphs_built: int  # graphs inductor compiled here
    graphs_loaded: int  # graphs loaded from a cache (the shared compile cache or the node's inductor cache)
    compile_cache_load_s: float  # reading the shared compile cache's artifacts
    compile_cache: str | None  # where graphs were looked for and published
    warmup_s: float | None  # the whole warm-up (None: not warmed)
    warmed: tuple[str, ...]  # what was warmed, "WxH xB" (with "+ref" when a reference was read)
    first_image_s: float | None  # from the start of the model load to the end of the first image

    def as_dict(self) -> dict:
        return {**asdict(self), "warmed": list(self.warmed)}


@dataclass
class ColdStartClock:
    """The producer of `ColdStart`: the service ticks it; `record(renderer)` reads compile figures live."""

    model_load_s: float
    started: float = field(default_factory=time.monotonic)  # when the service was built, after the load
    warmup_s: float | None = None
    warmed: list[str] = field(default_factory=list)
    first_image_s: float | None = None

    def render_done(self, renderer) -> None:
        """A device hold for a render ended: the first one that produced an image sets `first_image_s`
        (a batch-size probe that did not run, on the CPU, does not count)."""
        if self.first_image_s is None and getattr(renderer, "images_rendered", 1) > 0:
            self.first_image_s = self.model_load_s + time.monotonic() - self.started

    def record(self, renderer) -> ColdStart:
        forward = getattr(renderer, "forward", None)
        stats = getattr(forward, "stats", None)
        cache = getattr(forward, "cache", None)
        return ColdStart(
            model_load_s=round(self.model_load_s, 3),
            compiled=bool(getattr(renderer, "compiled", False)),
            compile_s=round(stats.compile_s, 3) if stats else 0.0,
            graphs_built=stats.built if stats else 0,
            graphs_loaded=stats.loaded if stats else 0,
            compile_cache_load_s=round(stats.cache_load_s, 3) if stats else 0.0,
            compile_cache=cache.location if cache is not None else None,
            warmup_s=None if self.warmup_s is None else round(self.warmup_s, 3),
            warmed=tuple(self.warmed),
            first_image_s=None if self.first_image_s is None else round(self.first_image_s, 3),
        )


def warmup_reference_png(size: int = 256) -> bytes:
    """A plain grey reference image: what a warm-up reads (its content does not select a graph)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (size, size), (128, 128, 128)).save(buffer, "PNG")
    return buffer.getvalue()


def warm_up(
    service,
    renderer,
    sizes: Sequence[tuple[int, int]],
    batch_sizes: Sequence[int] = (1,),
    settings: RenderSettings | None = None,
) -> list[str]:
    """Render with `renderer` (the service's own) every (width, height) x batch size once, with `settings` (the
    work's; one step).

    With a reference adapter loaded, each batch also reads a grey reference, so the reading rows' graphs
    are built too (their row count is static); the plain rows' graph is shared by every batch size.
    Returns what was warmed ("WxH xB[+ref]"). Holds the device for each render, as a real one does.
    """
    base = settings or RenderSettings()
    warmed = []
    # Read as a render's own reference (encoded for that call and dropped): nothing enters the RefKV cache,
    # and a job's accounting of its encodes sees none of the warm-up's.
    references = [warmup_reference_png()] if renderer.adapter is not None else None
    for width, height in sizes:
        s = service.resolve(base.model_copy(update={"width": width, "height": height, "steps": WARMUP_STEPS}))
        for batch in sorted(set(batch_sizes)):
            requests = [RenderRequest(prompt="warm-up", seed=i, settings=s) for i in range(batch)]
            with service.device("render"):
                renderer.render(requests, references=references)
            warmed.append(f"{width}x{height} x{batch}" + ("+ref" if references else ""))
    return warmed


__all__ = ["ColdStart", "ColdStartClock", "WARMUP_STEPS", "warm_up", "warmup_reference_png"]
