"""The render service: one device's Renderer with everything between a request and an image.

Every front door — a batch job's worker (cluster/worker.py), a Serve replica (serve/renderer.py), a
Ray Data actor (data/renderer.py) and the command line (cli.py) — holds one `RenderService` and keeps
only what is its own (the job's scheduling and storage, Serve's routing and HTTP, Ray Data's batches,
the CLI's flags). The service owns, once:

- the loaded model (`ModelSpec` -> `load_renderer`),
- the RefKV cache (`RefKVKey` -> RefKV, an LRU bounded in bytes, one set of hit/encode counters),
- settings resolved for the loaded adapter kind before anything is rendered or recorded,
- the memory fit: how many images one forward may hold at a resolution (memory.py), and splitting a
  forward that ran out of device memory,
- the device: one render or encode at a time, and the progress a health check reads,
- the judges (render_service/judges/): a render asked to be judged comes back with its scores and
  verdicts, computed here right after the decode, over the batch, where the images already are,
- the reference: a door hands it a `Reference` (render_service/references.py) and the service decides what the
  render reads: the images themselves with `recompute_reference_every_step` (that baseline runs the
  reference stream at every step), else a RefKV from the cache, from `Reference.fetch` or encoded here.

It knows nothing of Ray. What it returns (`RenderedImage`) is what `records.py` turns into image files and
metadata rows, so every front door records the same facts. One of them, `encode_s`, means the same at
every door: the seconds this render spent turning the reference's files into what it reads (decoding
and VAE-encoding the images and, unless it recomputes, the reference stream); 0 when its RefKV came from
the cache or from another worker, and 0 without a reference.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from PIL import Image

from snapref_ray.adapter.refkv import RefKV
from snapref_ray.engine import Renderer, RenderError
from snapref_ray.model_spec import ModelSpec
from snapref_ray.render_service.batching import rows_per_image
from snapref_ray.render_service.cold_start import ColdStart, ColdStartClock, warm_up
from snapref_ray.render_service.loading import load_renderer
from snapref_ray.render_service.memory import FitKey, MemoryFit, RenderOutOfMemory, describe_device_memory
from snapref_ray.render_service.references import Reference, reference_picture
from snapref_ray.render_service.refkv_cache import DEFAULT_REFKV_CACHE_BYTES, RefKVCache
from snapref_ray.requests import RenderRequest, RenderSettings
from snapref_ray.storage.backends import S3Options

if TYPE_CHECKING:
    from snapref_ray.render_service.judges.call import JudgeCall
    from snapref_ray.render_service.judges.registry import Judges
    from snapref_ray.render_service.judges.scores import Judgement

log = logging.getLogger(__name__)

ReferenceSource = Literal["cache", "fetched", "encoded", "recomputed"]


@dataclass
class RenderedImage:
    """One image and the facts every output records about it."""

    image: Image.Image
    request: RenderRequest  # the settings as rendered: the adapter kind's defaults filled in
    timings: dict[str, float]  # text_s, sample_s, decode_s, encode_s (the module docstring's meaning), steps
    forward_batch: int  # images in the forward that rendered it
    reference_hash: str | None
    skipped_forwards: int | None = None  # DiT forwards the step cache skipped for it (None: cache off)
    reference_source: ReferenceSource | None = None  # where what it read came from (None: no reference)
    latent_nonfinite: float | None = None  # fraction of its final latent that was NaN/inf (None: not measured)
    judgement: Judgement | None = None  # its judges' scores and verdicts (None: not judged)


@dataclass(frozen=True)
class ReferenceRead:
    """What a render reads of its reference, as the service decided (`RenderService.read_reference`).

    `source`: "cache" (this device's RefKV LRU), "fetched" (`Reference.fetch`), "encoded" (here, now) or
    "recomputed" (`recompute_reference_every_step`: `images` go to the engine, which runs the reference
    stream at every step). `encode_s` is the seconds this read spent encoding (0 unless "encoded").
    """

    reference: Reference
    source: ReferenceSource
    encode_s: float = 0.0
    refkv: RefKV | None = None
    images: tuple[bytes, ...] | None = None


@dataclass(frozen=True)
class DeviceDescription:
    """What a service renders on: the device, the dtype and the seconds its model took to load."""

    device: str
    dtype: str
    load_seconds: float


@dataclass(frozen=True)
class IdentityGapLosses:
    """The loss grids of one target read with its right and its wrong reference ([σ][seed] each), and whether
    each reference's RefKV came from the cache (`RenderService.identity_gap_losses`)."""

    loss_right: list[list[float]]
    loss_wrong: list[list[float]]
    right_cache_hit: bool
    wrong_cache_hit: bool


@dataclass
class _Health:
    busy_since: float | None = None
    last_progress: float = field(default_factory=time.monotonic)


class RenderService:
    """A Renderer on one device with its RefKV cache, memory fit and device lock (see the module docstring)."""

    def __init__(
        self,
        renderer: Renderer,
        *,
        refkv_cache_bytes: int = DEFAULT_REFKV_CACHE_BYTES,
        memory_budget_bytes: int | None = None,
        model_spec: ModelSpec | None = None,
    ) -> None:
        self._renderer = renderer  # private: a door asks the service, never the renderer behind it
        self.model_spec = model_spec
        self.cache = RefKVCache(refkv_cache_bytes)
        self.memory = MemoryFit.for_device(renderer.device, memory_budget_bytes)
        self._device = threading.Lock()
        self._health = _Health()
        self._cold_start = ColdStartClock(float(getattr(renderer, "load_seconds", 0.0)))
        self._judges: Judges | None = None

    @classmethod
    def load(
        cls,
        spec: ModelSpec,
        *,
        s3: S3Options | None = None,
        model_cache_dir: str | None = None,
        refkv_cache_bytes: int = DEFAULT_REFKV_CACHE_BYTES,
        memory_budget_bytes: int | None = None,
    ) -> RenderService:
        """Load `spec` (s3:// files through the node's model cache) into a service."""
        renderer = load_renderer(spec, s3=s3, cache_dir=model_cache_dir)
        return cls(
            renderer, refkv_cache_bytes=refkv_cache_bytes, memory_budget_bytes=memory_budget_bytes, model_spec=spec
        )

    # -- what is loaded --------------------------------------------------------------------------
    @property
    def model_id(self) -> str:
        return self._renderer.model_id

    @property
    def adapter_id(self) -> str | None:
        adapter = self._renderer.adapter
        return adapter.identity if adapter is not None else None

    @property
    def adapter_kind(self) -> str | None:
        return self._renderer.adapter_kind

    def resolve(self, settings: RenderSettings) -> RenderSettings:
        """`settings` as they render with the loaded adapter kind (a misfit raises RenderError naming the field)."""
        return self._renderer.resolve(settings)

    def describe(self) -> dict:
        """The loaded model, adapter, LoRAs, device and the figures behind its choices (for /v1/models, logs)."""
        r = self._renderer
        spec = self.model_spec
        adapter = r.adapter
        described = adapter.describe() if adapter is not None else None
        return {
            "model": r.model_id,
            "adapter": described,
            "loras": [{"file": _file_name(lora.path), "strength": lora.strength} for lora in spec.loras]
            if spec
            else [],
            "device": str(r.device),
            "dtype": str(r.dtype).removeprefix("torch."),
            "quantize": spec.quantize if spec else "none",
            "compile": bool(r.compiled),
            "refkv_cache": {
                **self.cache.stats.as_dict(),
                "entries": len(self.cache),
                "bytes": self.cache.nbytes,
                "max_bytes": self.cache.max_bytes,
            },
            "memory": self.memory.report(),
            "cold_start": self.cold_start().as_dict(),
        }

    # -- cold start ------------------------------------------------------------------------------
    def warmup(
        self,
        sizes: Sequence[tuple[int, int]],
        batch_sizes: Sequence[int] = (1,),
        settings: RenderSettings | None = None,
    ) -> ColdStart:
        """Build (or load from the compile cache) the graphs of these sizes and batch sizes now, so the
        first real request does not pay for them (render_service/cold_start.py); returns the cold start so far."""
        t0 = time.monotonic()
        warmed = warm_up(self, self._renderer, sizes, batch_sizes, settings)
        self._cold_start.warmup_s = (self._cold_start.warmup_s or 0.0) + time.monotonic() - t0
        self._cold_start.warmed += warmed
        log.info("warmed %s in %.1f s", ", ".join(warmed), time.monotonic() - t0)
        return self.cold_start()

    def cold_start(self) -> ColdStart:
        """Model load, compile (built vs loaded), warm-up and first-image seconds of this service."""
        return self._cold_start.record(self._renderer)

    def warm_up_image(self) -> None:
        """One small image (256x256, one step), so that the first real batch does not pay for kernel selection
        and allocation; it is the cold start's first image. Nothing on a CPU: there is no caching allocator to fill
        and no autotuning, and what a first call costs there is small against the whole image the warm-up would
        render (the tiny models' 256x256 image: ~0.5 CPU-s, paid by every CPU worker of a test or demo job)."""
        if str(self._renderer.device).startswith("cpu"):
            return
        settings = RenderSettings(width=256, height=256, steps=1, cfg=1.0)
        with self.device("render"):
            self._renderer.render([RenderRequest(prompt="warm-up", settings=settings)])

    def device_description(self) -> DeviceDescription:
        """The device, dtype and model load seconds this service renders with (what a door reports)."""
        r = self._renderer
        return DeviceDescription(
            str(r.device), str(getattr(r, "dtype", "")).removeprefix("torch."), float(getattr(r, "load_seconds", 0.0))
        )

    # -- references ------------------------------------------------------------------------------
    def private_refkv(self, shared: RefKV) -> RefKV:
        """`shared` (a RefKV read from another process, e.g. Ray's object store) on this device, as a copy the
        cache may keep: on the same device (CPU) the tensor still maps the store's shared memory and would pin
        the object after its owner drops it, so the cache keeps a private clone."""
        kv = shared.to(self._renderer.device)
        if kv.kv_N2HLD.data_ptr() == shared.kv_N2HLD.data_ptr():
            kv = replace(shared, kv_N2HLD=shared.kv_N2HLD.clone())
        return kv

    def reference_picture(self, reference: Reference) -> Image.Image:
        """The reference as one picture (a pair side by side), as the gallery shows it."""
        return reference_picture(reference.load(), reference.sources, reference.layout)

    def refkv(self, reference: Reference) -> tuple[RefKV, str]:
        """(RefKV of `reference`, where it came from: "cache", "fetched" or "encoded").

        The device LRU first; else `reference.fetch()` (a copy someone else holds, e.g. a job's object store;
        None when it is gone), else the reference stream over `reference.load()`. Concurrent callers asking
        for one missing key wait for a single encode.
        """
        kv, source, _ = self._refkv(reference)
        return kv, source

    def _refkv(self, reference: Reference) -> tuple[RefKV, ReferenceSource, float]:
        """`refkv`, and the wall seconds its encode took (read, decode, VAE, reference stream; 0 unless encoded)."""
        key, fetch, sources = reference.key, reference.fetch, reference.sources
        cached = self.cache.get(key)
        if cached is not None:
            return cached, "cache", 0.0
        source = "cache"  # stays so when another thread creates the entry first
        encode_s = 0.0

        def create() -> RefKV:
            nonlocal source, encode_s
            if fetch is not None:
                fetched = fetch()
                if fetched is not None:
                    source = "fetched"
                    return fetched
            t0 = time.perf_counter()
            images = list(reference.load())
            loaded_s = time.perf_counter() - t0
            with self.device("encode"):
                t0 = time.perf_counter()  # waiting for the device is not encoding
                kv = self._renderer.encode_reference(
                    images,
                    layout=reference.layout,
                    ref_caption=key.ref_caption,
                    ref_megapixels=key.ref_megapixels,
                    width=key.width,
                    height=key.height,
                    sources=list(sources) if sources else None,
                )
            source = "encoded"
            encode_s = loaded_s + time.perf_counter() - t0
            log.info(
                "encoded reference %s (%d tokens, %.1f MB) in %.2f s",
                key.reference_hash[:12],
                kv.num_tokens,
                kv.nbytes / 1e6,
                kv.encode_seconds,
            )
            return kv

        kv, _ = self.cache.get_or_create(key, create)
        return kv, source, encode_s

    def read_reference(self, reference: Reference, settings: RenderSettings) -> ReferenceRead:
        """What a render with `settings` reads of `reference` (the one place that decides it):
        with `recompute_reference_every_step` the images (loaded now), else the RefKV from the device cache,
        from `reference.fetch()`, or encoded here. A door that holds requests before rendering them (Serve's
        batching) reads each one's reference as it arrives and passes the read to `render`."""
        if self.resolve(settings).recompute_reference_every_step:
            return ReferenceRead(reference, "recomputed", images=tuple(reference.load()))
        kv, source, encode_s = self._refkv(reference)
        return ReferenceRead(reference, source, encode_s, refkv=kv)

    def cached_read(self, reference: Reference, settings: RenderSettings) -> ReferenceRead | None:
        """`read_reference` when it is answered from the device cache without loading anything; else None."""
        if self.resolve(settings).recompute_reference_every_step:
            return None
        kv = self.cache.get(reference.key)
        return ReferenceRead(reference, "cache", refkv=kv) if kv is not None else None

    # -- rendering -------------------------------------------------------------------------------
    def render(
        self,
        requests: Sequence[RenderRequest],
        *,
        reference: Reference | ReferenceRead | None = None,
        init_image: Image.Image | None = None,
        max_batch: int | None = None,
        progress: Callable[[int, int], None] | None = None,
        judge: JudgeCall | Sequence[JudgeCall | None] | None = None,
    ) -> list[RenderedImage]:
        """Render requests that may share a forward (same settings but prompts and seeds), in forwards of
        the largest batch that fits, at most `max_batch` images each.

        `reference` is read as `read_reference` decides (a `ReferenceRead` a door made earlier is used as
        it is). A forward that runs out of device memory is split in half and retried, down to one image,
        and the smaller batch is kept for that resolution; one image that does not fit raises
        `RenderOutOfMemory`.

        `judge` (one `JudgeCall` for every request, or one per request, None for those not judged): the
        images come back with `judgement` set, scored right after the batch's decode (judges/registry.py).
        """
        requests = [r.model_copy(update={"settings": self.resolve(r.settings)}) for r in requests]
        if not requests:
            return []
        calls = _judge_calls(judge, len(requests))
        if any(calls):
            from snapref_ray.render_service.judges.call import check_call

            for call in {id(c): c for c in calls if c is not None}.values():
                check_call(call, reference is not None)
        s = requests[0].settings
        for i, r in enumerate(requests[1:], start=1):
            if r.settings.batch_key() != s.batch_key():
                raise RenderError(f"requests[{i}].settings differ from requests[0]; render them in separate batches")
        read = self.read_reference(reference, s) if isinstance(reference, Reference) else reference
        if read is not None and (read.source == "recomputed") != s.recompute_reference_every_step:
            raise RenderError(
                "the reference was read for other settings than these (recompute_reference_every_step differs)",
                field="recompute_reference_every_step",
            )
        reads = read is not None
        key = FitKey(s.width, s.height, rows_per_image(s, reads), reads)
        refkv = read.refkv if read is not None else None
        images = list(read.images) if read is not None and read.images is not None else None
        layout = read.reference.layout if read is not None else "single"

        def forward(chunk: list[RenderRequest], on_step=progress):
            return self._renderer.render(
                chunk, refkv=refkv, references=images, layout=layout, init_image=init_image, progress=on_step
            )

        probe = RenderRequest(prompt="batch-size probe", settings=s.model_copy(update={"steps": 1}))
        requested = min(len(requests), max_batch or len(requests))
        with self.device("render"):
            batch = self.memory.limit(key, requested, lambda: forward([probe], on_step=None))
        read_s = read.encode_s if read is not None else 0.0
        results: list[RenderedImage] = []
        start = 0
        while start < len(requests):
            chunk = requests[start : start + batch]
            try:
                with self.device("render"):
                    outputs = self.memory.run(key, len(chunk), lambda chunk=chunk: forward(chunk))
            except Exception as e:
                if not _is_out_of_memory(e):
                    raise
                if len(chunk) == 1:
                    raise self._out_of_memory(s, key, e) from None
                batch = max(1, len(chunk) // 2)
                self.memory.cap(key, batch)
                log.warning(
                    "out of device memory at %dx%d with %d images per forward: retrying with %d",
                    s.width,
                    s.height,
                    len(chunk),
                    batch,
                )
                continue
            results += [
                RenderedImage(
                    image=out.image,
                    request=out.request,
                    # encode_s (the module docstring): this read's encode, plus the engine's preparation of the
                    # images when it recomputes (0 when it reads a RefKV).
                    timings={**out.timings, "encode_s": read_s + out.timings.get("encode_s", 0.0)},
                    forward_batch=len(chunk),
                    reference_hash=read.reference.hash if read is not None else None,
                    skipped_forwards=getattr(out, "skipped_forwards", None),
                    reference_source=read.source if read is not None else None,
                    latent_nonfinite=getattr(out, "latent_nonfinite", None),
                )
                for out in outputs
            ]
            start += len(chunk)
        if any(calls):
            self._judge(results, calls, read.reference if read is not None else None)
        return results

    def _judge(self, results: list[RenderedImage], calls: list[JudgeCall | None], reference: Reference | None) -> None:
        """Set each judged result's `judgement`: the results of one call are scored as one batch."""
        from snapref_ray.render_service.judges.registry import Judges, JudgeTarget

        if self._judges is None:
            self._judges = Judges(
                self._renderer,
                lambda ref: self._refkv(ref)[0],
                lambda: self.device("judge"),
            )
        groups: dict[int, list[int]] = {}
        for i, call in enumerate(calls):
            if call is not None:
                groups.setdefault(id(call), []).append(i)
        for indices in groups.values():
            call = calls[indices[0]]
            targets = [
                JudgeTarget(r.image, r.request.prompt, r.request.settings, r.latent_nonfinite)
                for r in (results[i] for i in indices)
            ]
            for i, judgement in zip(indices, self._judges.judge(targets, call, reference)):
                results[i].judgement = judgement

    def _out_of_memory(self, s: RenderSettings, key: FitKey, error: BaseException) -> RenderOutOfMemory:
        device = self._renderer.device
        fit = "; ".join(
            f"one image peaked at {limit['image_peak_bytes'] / 2**30:.2f} GiB"
            f" with {limit['available_bytes'] / 2**30:.2f} GiB available"
            for limit in self.memory.report()
            if (limit["width"], limit["height"]) == (s.width, s.height) and limit["image_peak_bytes"]
        )
        figures = "; ".join(f for f in (describe_device_memory(device), fit) if f)
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        return RenderOutOfMemory(
            f"one {s.width}x{s.height} image ({key.rows_per_image} row(s) per image) does not fit {device}:"
            f" {type(error).__name__}: {first_line}" + (f" [{figures}]" if figures else ""),
            field="width",
        )

    # -- evaluation ------------------------------------------------------------------------------
    def identity_gap_losses(
        self,
        target: Image.Image,
        prompt: str,
        right: Reference,
        wrong: Reference,
        sigmas: Sequence[float],
        noise_seeds: Sequence[int],
        *,
        mode: str,
        ref_weight: float,
    ) -> IdentityGapLosses:
        """Flow-matching loss grids of `target` under `prompt` read with the right and with the wrong reference
        (`snapref_ray.evaluation.denoising_losses`): both share `sigmas` and `noise_seeds`, and each reference
        goes through the RefKV cache, so it is encoded once per target size however many cases use it."""
        from snapref_ray.evaluation import denoising_losses

        grids, hits = {}, {}
        for role, reference in (("right", right), ("wrong", wrong)):
            kv, source, _ = self._refkv(reference)
            hits[role] = source == "cache"
            with self.device("evaluate"):
                grids[role] = denoising_losses(
                    self._renderer, target, prompt, kv, sigmas, noise_seeds, mode=mode, ref_weight=ref_weight
                ).tolist()
        return IdentityGapLosses(grids["right"], grids["wrong"], hits["right"], hits["wrong"])

    # -- the device ------------------------------------------------------------------------------
    @contextmanager
    def device(self, what: str):
        """Hold the device for one render or encode; the health check sees it busy meanwhile."""
        with self._device:
            self._health.busy_since = self._health.last_progress = time.monotonic()
            try:
                yield
                if what == "render":
                    self._cold_start.render_done(self._renderer)
            finally:
                self._health.busy_since = None
                self._health.last_progress = time.monotonic()

    def tick(self, step: int = 0, total: int = 0) -> None:
        """Progress: a sampling step finished (the callback a front door passes on to `render`)."""
        self._health.last_progress = time.monotonic()

    def stalled_for(self) -> float:
        """Seconds the device has been busy without progress (0 while it is idle)."""
        if self._health.busy_since is None:
            return 0.0
        return time.monotonic() - self._health.last_progress


def _judge_calls(judge, n: int) -> list:
    """`render`'s `judge` as one entry per request."""
    if judge is None or not isinstance(judge, Sequence):
        return [judge] * n
    if len(judge) != n:
        raise ValueError(f"judge: {len(judge)} calls for {n} requests")
    return list(judge)


def _is_out_of_memory(error: BaseException) -> bool:
    """A device allocation that failed: CUDA's OutOfMemoryError, or the CPU allocator's refusal."""
    import torch

    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(error)


def _file_name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]
