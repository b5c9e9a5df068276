"""The batch worker: a Ray actor per GPU that owns one resident Renderer.

It encodes references (the RefKV it returns is owned by the driver, so it outlives the
worker), renders batches with reference affinity through an on-device LRU of RefKVs, and
stores images itself so that PNG encoding and uploads overlap the next batch's sampling: the
actor runs two calls at once (`max_concurrency=2`), a lock keeps the device to one of them, and
the images go to an `OutputWriter`'s threads once the device is released (output_writer.py).
On a GPU it splits a batch to the largest that fits the resolution (batch_fit.py).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace

from snapref_ray.adapter.refkv import RefKV
from snapref_ray.adapter.refkv_cache import RefKVCache
from snapref_ray.cluster.batch_fit import BatchFitter
from snapref_ray.cluster.failures import LOST_REFKV_ERRORS, describe_out_of_memory
from snapref_ray.cluster.metrics import job_metrics
from snapref_ray.cluster.output_writer import OutputWriter
from snapref_ray.cluster.tasks import EncodeInfo, ItemOutcome, ReferenceTask, RenderTask, WorkerInfo
from snapref_ray.requests import RenderRequest
from snapref_ray.storage.backends import S3Options, open_storage, read_uri
from snapref_ray.storage.image_files import encode_rendered_image, make_thumbnail

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs to build its Renderer and write outputs (picklable)."""

    models: dict  # ModelPaths fields (models_dir and/or explicit files; local paths or s3:// URIs)
    adapter: str | None
    loras: tuple[tuple[str, float], ...] = ()
    device: str = "auto"
    dtype: str = "auto"
    refkv_cache_bytes: int = 8 * 2**30
    output_uri: str = "./output"
    s3: S3Options | None = None
    image_format: str = "png"
    warmup: bool = True
    model_cache_dir: str | None = None
    compile: bool = False  # DiT forward through torch.compile (models/compiled.py)
    warmup_sizes: tuple[tuple[int, int], ...] = ()  # (width, height) graphs compiled at start when compiling
    output_threads: int = 4  # encode/upload threads (output_writer.py); 0 = store inline, the device waits
    # Longest wait for a RefKV from the object store before encoding the reference here instead: a lost RefKV
    # is rebuilt through its creating actor (a node boot and a model load away), an encode is one forward.
    refkv_fetch_timeout_s: float = 30.0


def build_renderer(config: WorkerConfig):
    """The worker's Renderer, with s3:// model files fetched once per node into the local cache."""
    import torch

    from snapref_ray.engine import Renderer
    from snapref_ray.storage.jobspec import ModelPaths
    from snapref_ray.storage.model_cache import ensure_local, ensure_local_folder

    def local(uri: str | None) -> str | None:
        return None if uri is None else str(ensure_local(uri, config.model_cache_dir, config.s3))

    paths = ModelPaths(**config.models)
    folder = None
    if paths.models_dir is not None:
        folder = ensure_local_folder(paths.models_dir, config.model_cache_dir, config.s3)
    explicit = {name: local(getattr(paths, name)) for name in ("dit", "text_encoder", "vae")}
    for name in ("qwen_tokenizer", "t5_tokenizer"):
        value = getattr(paths, name)
        explicit[name] = None if value is None else str(ensure_local_folder(value, config.model_cache_dir, config.s3))
    files = paths.model_copy(update={k: v for k, v in explicit.items() if v is not None}).resolve(folder)
    adapter = local(config.adapter) if config.adapter else (str(files.adapter) if files.adapter else None)
    device = None if config.device == "auto" else config.device
    dtype = getattr(torch, config.dtype) if config.dtype != "auto" else None
    return Renderer(
        files,
        adapter=adapter,
        loras=[(local(p), s) for p, s in config.loras],
        device=device,
        dtype=dtype,
        compile=config.compile,
    )


class RenderWorker:
    """Owns a Renderer on one device; see the module docstring."""

    def __init__(self, config: WorkerConfig, renderer_factory: Callable[[WorkerConfig], object] | None = None) -> None:
        import ray

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.config = config
        ctx = ray.get_runtime_context()
        self.node_id = ctx.get_node_id()
        self.worker_id = f"{self.node_id[:8]}-{os.getpid()}"
        self.renderer = (renderer_factory or build_renderer)(config)
        self.storage = open_storage(config.output_uri, config.s3)
        self.cache = RefKVCache(config.refkv_cache_bytes)
        self._device_lock = threading.Lock()
        self.writer = OutputWriter(config.output_threads)
        self.batch_fit = BatchFitter(getattr(self.renderer, "device", None))
        self._stored_references: set[str] = set()
        self.metrics = job_metrics()
        self.tags = {"worker": self.worker_id}
        if config.warmup:
            self._warm_up()

    def _warm_up(self) -> None:
        """One small step so that the first real batch does not pay for kernel selection and allocation."""
        from snapref_ray.requests import RenderSettings

        t0 = time.perf_counter()
        # A compiling worker builds the graphs of its job's sizes now (CFG rows, one image each);
        # other row layouts (batch sizes, reading rows) compile on their first batch.
        sizes = self.config.warmup_sizes if self.config.compile and self.config.warmup_sizes else ((256, 256),)
        with self._device_lock:
            for width, height in sizes:
                self.renderer.render(
                    [
                        RenderRequest(
                            prompt="warm-up",
                            settings=RenderSettings(
                                width=width,
                                height=height,
                                steps=1,
                                cfg=1.0 if not self.config.compile else 2.0,
                                sampler="euler",
                            ),
                        )
                    ]
                )
        log.info("worker %s warmed up in %.2f s", self.worker_id, time.perf_counter() - t0)

    # -- called by the driver ------------------------------------------------------------------
    def info(self) -> WorkerInfo:
        return WorkerInfo(
            self.worker_id,
            self.node_id,
            str(getattr(self.renderer, "device", "cpu")),
            os.getpid(),
            float(getattr(self.renderer, "load_seconds", 0.0)),
        )

    def pid(self) -> int:
        return os.getpid()

    def cached_references(self) -> list[tuple]:
        return self.cache.keys()

    def encode(self, task: ReferenceTask) -> tuple[RefKV, EncodeInfo]:
        """Encode a reference; called with `num_returns=2` (see `BatchScheduler`).

        The RefKV return goes to the object store, owned by the caller, so it outlives this
        worker; the small EncodeInfo return is what the driver waits on (never the RefKV, which
        would be pulled to the driver's node). The RefKV also stays in this worker's device cache.
        """
        kv, hit = self.cache.get_or_create(task.key, lambda: self._encode(task))
        return kv, EncodeInfo(task.reference_hash, kv.nbytes, kv.encode_seconds, self.worker_id, encoded=not hit)

    def render(self, task: RenderTask, refkv_handle: list | None = None) -> list[ItemOutcome]:
        """Render a batch and store its images; returns one outcome per item.

        `refkv_handle` is `[ObjectRef]` (wrapped so Ray does not fetch it eagerly): it is only
        read when the RefKV is not already in this worker's device cache.
        """
        started = time.time()
        try:
            kv, source, fetch_s, lost = self._refkv_with_source(task.reference, refkv_handle)
        except Exception as e:  # an unreadable reference fails its items, not the worker
            return self._failed(task, e, "encode")
        (self.metrics.cache_hits if source == "cache" else self.metrics.cache_misses).inc(1, self.tags)
        requests = [RenderRequest(prompt=i.prompt, seed=i.seed, settings=i.settings) for i in task.items]
        try:
            t0 = time.perf_counter()
            with self._device_lock:
                results, forward_batches = self._render_fitted(requests, kv)
                sample_wall = time.perf_counter() - t0
                if not self.writer.overlaps:  # no output threads: store while the device waits
                    stores = self._submit_stores(task, results, forward_batches, kv, started)
        except Exception as e:
            import torch

            if isinstance(e, torch.OutOfMemoryError):  # the driver splits the batch; not the items' fault
                device = getattr(self.renderer, "device", "cpu")
                return self._failed(task, e, "sample", source, out_of_memory=describe_out_of_memory(e, device))
            return self._failed(task, e, "sample", source)
        if self.writer.overlaps:  # encode + upload on the writer's threads; the next batch can sample
            stores = self._submit_stores(task, results, forward_batches, kv, started)
        steps = max(1, task.items[0].settings.steps)
        self.metrics.step_latency.observe(results[0].timings.get("sample_s", sample_wall) / steps, self.tags)
        outcomes = []
        for item, stored in zip(task.items, stores):
            try:
                outcomes.append(replace(stored.result(), refkv_source=source, fetch_seconds=fetch_s, refkv_lost=lost))
                self.metrics.images.inc(1, self.tags)
                self.metrics.image_latency.observe(time.time() - started, self.tags)
            except Exception as e:
                outcomes.append(ItemOutcome(item.item_id, error=_describe(e), stage="write", refkv_source=source))
        return outcomes

    def _render_fitted(self, requests: list[RenderRequest], kv: RefKV) -> tuple[list, list[int]]:
        """Render in chunks of the largest batch that fits this resolution on the device (CPU: all at once).

        Returns the results and, per result, how many images its forward rendered (the batch chosen)."""
        s = requests[0].settings
        rows = 1 + (s.cfg != 1.0) + (s.ref_guidance != 1.0 and s.ref_weight > 0)
        probe_request = RenderRequest(prompt="batch-size probe", settings=s.model_copy(update={"steps": 1}))
        limit = self.batch_fit.limit(
            s.width, s.height, rows, len(requests), probe=lambda: self.renderer.render([probe_request], refkv=kv)
        )
        results, forward_batches = [], []
        for start in range(0, len(requests), limit):
            chunk = requests[start : start + limit]
            results += self.renderer.render(chunk, refkv=kv)
            forward_batches += [len(chunk)] * len(chunk)
        return results, forward_batches

    def batch_limits(self) -> list[dict]:
        """The batch this worker chose per resolution (empty on a CPU worker)."""
        return [dataclasses.asdict(limit) for limit in self.batch_fit.limits.values()]

    def _submit_stores(
        self, task: RenderTask, results: list, forward_batches: list[int], kv: RefKV, started: float
    ) -> list:
        return self.writer.submit_all(
            [
                functools.partial(self._store, task, item, result, batch, kv, started)
                for item, result, batch in zip(task.items, results, forward_batches)
            ]
        )

    # -- internals -------------------------------------------------------------------------------
    def _encode(self, task: ReferenceTask) -> RefKV:
        images = [read_uri(uri, self.config.s3) for uri in task.uris]
        with self._device_lock:
            kv = self.renderer.encode_reference(
                images,
                layout=task.layout,
                ref_caption=task.ref_caption,
                ref_megapixels=task.ref_megapixels,
                width=task.width,
                height=task.height,
                sources=list(task.uris),
            )
        self.metrics.encodes.inc(1, self.tags)
        log.info(
            "worker %s encoded reference %s (%d tokens, %.1f MB) in %.2f s",
            self.worker_id,
            task.reference_hash[:12],
            kv.num_tokens,
            kv.nbytes / 1e6,
            kv.encode_seconds,
        )
        return kv

    def _refkv_for(self, ref: ReferenceTask, handle: list | None) -> tuple[RefKV, bool]:
        """(RefKV, was it already in this worker's device cache)."""
        kv, source, _, _ = self._refkv_with_source(ref, handle)
        return kv, source == "cache"

    def _refkv_with_source(self, ref: ReferenceTask, handle: list | None) -> tuple[RefKV, str, float, str]:
        """(RefKV, "cache" | "object_store" | "encoded", seconds spent fetching it from the object
        store, the class of the error that made the fetch give up or ""): the device LRU, else the
        driver's copy, else encode."""
        cached = self.cache.get(ref.key)
        if cached is not None:
            return cached, "cache", 0.0, ""
        source = "cache"  # stays so when another thread of this worker creates the entry first
        fetch_s = 0.0
        lost = ""

        def fetch_or_encode() -> RefKV:
            nonlocal source, fetch_s, lost
            if handle:
                import ray

                try:
                    # The driver hands out only finished RefKVs, so this never waits on an encode
                    # queued behind this very call (a deadlock with max_concurrency=2).
                    t0 = time.perf_counter()
                    shared = ray.get(handle[0], timeout=self.config.refkv_fetch_timeout_s)
                    fetch_s = time.perf_counter() - t0
                    kv = shared.to(getattr(self.renderer, "device", None))
                    if kv.kv_N2HLD.data_ptr() == shared.kv_N2HLD.data_ptr():
                        # Same device (CPU): the tensor still maps the object store's shared memory and
                        # would pin the object after the driver drops it; the LRU keeps a private copy.
                        kv = replace(shared, kv_N2HLD=shared.kv_N2HLD.clone())
                    source = "object_store"
                    return kv
                except LOST_REFKV_ERRORS as e:  # gone, or not to be had in time: encode it here
                    lost = type(e).__name__
                    log.warning(
                        "worker %s: RefKV of %s cannot be fetched (%s); re-encoding",
                        self.worker_id,
                        ref.reference_hash[:12],
                        lost,
                    )
            source = "encoded"
            return self._encode(ref)

        kv, _ = self.cache.get_or_create(ref.key, fetch_or_encode)
        self.metrics.cache_bytes.set(self.cache.nbytes, self.tags)
        return kv, source, fetch_s, lost

    def _store(self, task: RenderTask, item, result, forward_batch: int, kv: RefKV, started: float) -> ItemOutcome:
        t0 = time.perf_counter()
        s = result.request.settings  # as rendered: the adapter kind's defaults filled in
        fmt = self.config.image_format
        image_bytes = encode_rendered_image(
            result.image,
            prompt=item.prompt,
            seed=item.seed,
            settings=s.model_dump(),
            model=getattr(self.renderer, "model_id", ""),
            adapter=kv.adapter_id,
            reference_hash=item.reference_hash,
            item_id=item.item_id,
            fmt=fmt,
        )
        image_key = f"images/{item.item_id}.{'jpg' if fmt == 'jpeg' else fmt}"
        thumb_key = f"thumbs/{item.item_id}.jpg"
        self.storage.put_bytes(image_key, image_bytes)
        self.storage.put_bytes(thumb_key, make_thumbnail(result.image))
        reference_key = self._store_reference(task.reference)
        upload_s = time.perf_counter() - t0
        t = result.timings
        row = {
            "item_id": item.item_id,
            "manifest_row": item.manifest_row,
            "reference_uris": list(item.reference.uris),
            "reference_hash": item.reference_hash,
            "reference_image_key": reference_key,
            "prompt": item.prompt,
            "negative_prompt": s.negative_prompt,
            "seed": item.seed,
            "width": s.width,
            "height": s.height,
            "steps": s.steps,
            "cfg": s.cfg,
            "sampler": s.sampler,
            "scheduler": s.scheduler,
            "mode": s.mode,
            "ref_weight": s.ref_weight,
            "ref_guidance": s.ref_guidance,
            "ref_in_uncond": s.ref_in_uncond,
            "correction": s.correction,
            "ref_start": s.ref_start,
            "ref_end": s.ref_end,
            "ref_caption": s.ref_caption,
            "settings_json": s.model_dump_json(),
            "image_key": image_key,
            "image_uri": self.storage.uri_for(image_key),
            "thumb_key": thumb_key,
            "image_format": fmt,
            "adapter": kv.adapter_id,
            "model": getattr(self.renderer, "model_id", ""),
            "worker_id": self.worker_id,
            "node_id": self.node_id,
            "encode_s": kv.encode_seconds,
            "sample_s": t.get("sample_s", 0.0),
            "decode_s": t.get("decode_s", 0.0),
            "upload_s": upload_s,
            "forward_batch": forward_batch,
            "attempt": task.attempts.get(item.item_id, 1),
            "started_at": started,
            "finished_at": time.time(),
        }
        return ItemOutcome(item.item_id, row=row)

    def _store_reference(self, ref: ReferenceTask) -> str:
        """A small copy of the reference for the gallery, written once per worker and reference."""
        key = f"references/{ref.reference_hash}.jpg"
        if ref.reference_hash in self._stored_references:
            return key
        from snapref_ray.adapter.images import open_reference, stitch_side_by_side

        images = [open_reference(read_uri(u, self.config.s3), u) for u in ref.uris]
        image = stitch_side_by_side(*images) if ref.layout == "pair" else images[0]
        if not self.storage.exists(key):
            self.storage.put_bytes(key, make_thumbnail(image, max_side=512))
        self._stored_references.add(ref.reference_hash)
        return key

    def _failed(
        self, task: RenderTask, error: Exception, stage: str, source: str = "", *, out_of_memory: str = ""
    ) -> list[ItemOutcome]:
        message = out_of_memory or _describe(error)
        log.error(
            "worker %s: %s failed for %d item(s) (%s): %s",
            self.worker_id,
            stage,
            len(task.items),
            ", ".join(i.item_id for i in task.items[:4]),
            message,
        )
        self.metrics.errors.inc(len(task.items), {"stage": stage})
        return [
            ItemOutcome(i.item_id, error=message, stage=stage, refkv_source=source, out_of_memory=bool(out_of_memory))
            for i in task.items
        ]

    def evaluate(self, case: dict) -> dict:
        """Identity-gap loss grids of one held-out case (`pipelines/identity_eval.py` builds `case`).

        The right and the wrong reference go through this worker's RefKV cache, so each is
        encoded once per worker and target size however many cases and σ/seed draws use it; both
        grids share the case's σ values and noise seeds (`snapref_ray.evaluation.denoising_losses`).
        A failure is returned as {"case_id", "error"}: one bad image must not stop the evaluation.
        """
        from snapref_ray.evaluation import denoising_losses, prepare_target

        t0 = time.perf_counter()
        try:
            target = prepare_target(read_uri(case["target"], self.config.s3), case["target_megapixels"], case["target"])
            grids, hits = {}, {}
            for role in ("right", "wrong"):
                ref = ReferenceTask(
                    case[f"{role}_hash"],
                    tuple(case[f"{role}_uris"]),
                    case.get("layout", "single"),
                    case["ref_caption"],
                    case["ref_megapixels"],
                    target.width,
                    target.height,
                )
                kv, hits[role] = self._refkv_for(ref, None)
                with self._device_lock:
                    grids[role] = denoising_losses(
                        self.renderer,
                        target,
                        case["prompt"],
                        kv,
                        case["sigmas"],
                        case["noise_seeds"],
                        mode=case["mode"],
                        ref_weight=case["ref_weight"],
                    ).tolist()
        except Exception as e:
            log.error("worker %s: case %s failed: %s", self.worker_id, case.get("case_id"), _describe(e))
            return {"case_id": case.get("case_id"), "error": _describe(e)}
        adapter = getattr(self.renderer, "adapter", None)
        return {
            "case_id": case["case_id"],
            "loss_right": grids["right"],
            "loss_wrong": grids["wrong"],
            "width": target.width,
            "height": target.height,
            "right_cache_hit": hits["right"],
            "wrong_cache_hit": hits["wrong"],
            "seconds": time.perf_counter() - t0,
            "worker_id": self.worker_id,
            "model": getattr(self.renderer, "model_id", ""),
            "adapter": getattr(adapter, "identity", None),
            "device": str(getattr(self.renderer, "device", "cpu")),
            "dtype": str(getattr(self.renderer, "dtype", "")).removeprefix("torch."),
        }


def _describe(error: BaseException) -> str:
    last = traceback.extract_tb(error.__traceback__)[-1:] if error.__traceback__ else []
    where = f" (at {last[0].filename.rsplit('/', 1)[-1]}:{last[0].lineno})" if last else ""
    return f"{type(error).__name__}: {error}{where}"
