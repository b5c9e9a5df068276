"""Rendering replicas: one resident Renderer per replica (one per GPU), a RefKV cache, routing by
reference, and batching of compatible requests.

`ReplicaRenderer` is what a rendering replica holds. In the split topology it lives in a
`RendererDeployment` replica, which the ingress calls through a handle; in the fused topology the
ingress replica holds one itself and renders in-process (snapref_ray/serve/ingress.py).

A request's path through a replica:
1. Split topology only: `_advertise(key)` (`@serve.multiplexed`) tells Serve's router this replica
   holds the reference `key`, so later requests for it come here first (soft affinity). The key
   holds everything the K/V depends on: layout, file hashes, target size, ref_megapixels, caption.
2. The RefKV comes from the replica's `RefKVCache` (LRU bounded in bytes, on the device);
   a miss fetches the file from the ReferenceStore and encodes it. Concurrent misses on one
   key encode once; the others wait and count as hits.
3. `_submit` (`@serve.batch`): requests that arrive within `batch_wait_timeout_s` of each
   other (0 by default: none is held back) enter the device queue together (Serve splits them by reference id first).
4. One device loop renders the oldest waiting request together with every waiting request
   that can share its forward (same reference, same `RenderSettings.batch_key()`, same negative
   prompt), up to `max_batch_size` images. Requests that queued while the device was busy are
   merged this way too, which is where batching pays under load.

The multiplexed "model" is only a marker: the RefKVCache decides what is kept (by bytes), the
marker list sizes the routing table. `check_health` fails when the device has been busy
without progress for `stall_timeout_s`, so Serve replaces a hung replica.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

from ray import serve

from snapref_ray.requests import RenderSettings
from snapref_ray.serve.api import ApiError
from snapref_ray.serve.config import ServeConfig
from snapref_ray.serve.direct_ingress import over_this_replicas_transport

log = logging.getLogger(__name__)

# Reference ids one replica advertises to the router. The RefKVCache's byte budget decides what
# stays on the device; this only bounds the routing table Serve keeps per replica.
MAX_ADVERTISED_REFERENCES = 64


@dataclass(frozen=True)
class ReferenceSpec:
    """What a render's reference K/V is computed from."""

    layout: str  # "single" | "pair" (left, right)
    content_hashes: tuple[str, ...]
    reference_ids: tuple[str, ...]  # the public ids, for metadata
    ref_caption: str
    ref_megapixels: float
    width: int
    height: int

    @property
    def key(self) -> str:
        """The multiplexed id and cache key: every input of the RefKV, nothing else."""
        caption = hashlib.sha256(self.ref_caption.encode()).hexdigest()[:16]
        return (
            f"{self.layout}:{'+'.join(self.content_hashes)}:{self.width}x{self.height}:"
            f"{self.ref_megapixels!r}mp:{caption}"
        )


@dataclass(frozen=True)
class RenderJob:
    """One HTTP render request as the ingress hands it to a replica."""

    prompt: str
    seeds: tuple[int, ...]
    settings: RenderSettings
    reference: ReferenceSpec | None = None
    ref_megapixels_set: bool = False  # the request chose ref_megapixels (else the upload's value applies)

    def group_key(self) -> tuple:
        """Jobs with equal keys can share one batched forward."""
        return (
            self.reference.key if self.reference else None,
            self.settings.batch_key(),
            self.settings.negative_prompt,
        )


@dataclass
class RenderReply:
    """What a replica answers: PNG files and the metadata of how they were made."""

    pngs: list[bytes]
    seeds: list[int]
    timings: dict[str, float]
    batch_size: int
    batched_requests: int
    batch_id: str
    cache_hit: bool | None
    replica: str
    cache: dict[str, int] = field(default_factory=dict)


@dataclass
class _Pending:
    job: RenderJob
    refkv: object | None  # RefKV; typed loosely so this module imports without torch
    cache_hit: bool | None
    encode_s: float
    future: asyncio.Future
    arrived: float = field(default_factory=time.perf_counter)

    @property
    def images(self) -> int:
        return len(self.job.seeds)


def _as_bad_request(e: ValueError, job: RenderJob) -> ApiError | None:
    """The engine's input errors (a bad reference image, an impossible setting) as a 400; None for others."""
    from snapref_ray.adapter.images import ReferenceImageError
    from snapref_ray.engine import RenderError

    if isinstance(e, ReferenceImageError):
        # The upload was checked at its own ref_megapixels, so a reference that fails now fails at the
        # size this request asked for.
        return ApiError(400, "ref_megapixels" if job.ref_megapixels_set else "reference_id", str(e))
    if isinstance(e, RenderError):
        return ApiError(400, e.field, str(e))
    return None


def local_model_paths(config: ServeConfig) -> tuple[str, str | None]:
    """(models folder, adapter file) on this node: s3:// ones are fetched into the per-node model cache
    once (the same cache and locking as the batch workers), local ones are used as they are."""
    from snapref_ray.storage.model_cache import ensure_local, ensure_local_folder

    s3 = config.s3_options()
    models_dir = str(ensure_local_folder(config.models_dir, config.model_cache_dir, s3))
    adapter = config.adapter
    if adapter is not None and adapter.startswith("s3://"):
        adapter = str(ensure_local(adapter, config.model_cache_dir, s3))
    return models_dir, adapter


class _Evicted(Exception):
    """The reference left the cache between the check and the encode; fetch its file and retry."""


class ReplicaRenderer:
    """One resident Renderer with its RefKV cache, batching and device loop: what a replica that
    renders holds, whether it is a SnapRefRenderer (split topology) or an ingress that renders
    itself (fused topology). `store` is the ReferenceStore's handle, for cache misses."""

    def __init__(self, config: ServeConfig, store) -> None:
        import torch

        from snapref_ray.adapter.refkv_cache import RefKVCache
        from snapref_ray.engine import Renderer

        self._config = config
        self._store = over_this_replicas_transport(store)
        device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cpu":
            torch.set_num_threads(max(1, int(config.cpus_per_replica)))
        models_dir, adapter = local_model_paths(config)
        self._renderer = Renderer.from_folder(models_dir, adapter=adapter, device=device, compile=config.compile)
        self._cache = RefKVCache(config.refkv_cache_bytes)
        # Encodes and renders run in these threads so the event loop stays free for routing,
        # batching and health checks; `_device_lock` keeps the device to one of them at a time.
        self._pool = ThreadPoolExecutor(
            max_workers=config.max_ongoing_requests + 2, thread_name_prefix="snapref-device"
        )
        self._device_lock = threading.Lock()
        self._busy_since: float | None = None
        self._last_progress = time.monotonic()
        self._waiting: list[_Pending] = []
        self._wakeup: asyncio.Event | None = None
        self._device_task: asyncio.Task | None = None
        # The window admits everything the replica may hold; the device loop forms forwards of at most
        # max_batch_size images from it. (Capping the window at max_batch_size would push requests of
        # other groups into the next window and reorder them.)
        self._submit.set_max_batch_size(config.max_ongoing_requests)
        self._submit.set_batch_wait_timeout_s(config.batch_wait_timeout_s)
        try:
            self._replica = serve.get_replica_context().replica_id.unique_id
        except Exception:  # outside Serve (unit use)
            self._replica = "local"
        log.info("renderer replica %s ready on %s in %.1f s", self._replica, device, self._renderer.load_seconds)

    async def render(self, job: RenderJob) -> RenderReply | ApiError:
        """The rendered images; bad input is answered with an ApiError *value*, so that Serve does not
        log a client's mistake as a failed request with a traceback."""
        refkv, hit, encode_s = None, None, 0.0
        try:
            if job.reference is not None:
                refkv, hit, encode_s = await self._reference_kv(job.reference)
            loop = asyncio.get_running_loop()
            pending = await self._submit(_Pending(job, refkv, hit, encode_s, loop.create_future()))
            return await pending.future
        except ApiError as e:
            return e
        except ValueError as e:
            bad_request = _as_bad_request(e, job)
            if bad_request is None:
                raise
            return bad_request

    async def info(self) -> dict:
        r = self._renderer
        adapter = None
        if r.adapter is not None:
            meta = r.adapter.adapter.meta
            adapter = {
                "identity": r.adapter.identity,
                "base_model": meta.base_model,
                "num_blocks": meta.num_blocks,
                "modes": list(meta.modes),
            }  # not the file path: clients need not know the server's disk
        return {
            "model": r.model_id,
            "adapter": adapter,
            "modes": adapter["modes"] if adapter else [],
            "device": str(r.device),
            "dtype": str(r.dtype).removeprefix("torch."),
        }

    def check_health(self) -> None:
        """Raise (Serve then restarts the replica) if the device is stuck: busy with no progress."""
        busy_since = self._busy_since
        if busy_since is None:
            return
        idle_for = time.monotonic() - self._last_progress
        if idle_for > self._config.stall_timeout_s:
            raise RuntimeError(
                f"renderer stalled: the device has made no progress for {idle_for:.0f} s"
                f" (stall_timeout_s={self._config.stall_timeout_s})"
            )

    # -- references -------------------------------------------------------------------------
    async def _reference_kv(self, spec: ReferenceSpec):
        """(RefKV, cache_hit, encode seconds) for `spec`, encoding it on a miss."""
        kv = self._cache.get(spec.key)
        if kv is not None:  # the common case, answered on the event loop without a thread hop
            self._cache.stats.hits += 1
            return kv, True, 0.0
        data = await self._fetch(spec)
        for _ in range(2):
            timing: dict[str, float] = {}

            def create(data=data, timing=timing):
                if data is None:
                    raise _Evicted
                with self._device("encode"):
                    t0 = time.perf_counter()
                    kv = self._renderer.encode_reference(
                        list(data),
                        layout=spec.layout,
                        ref_caption=spec.ref_caption,
                        ref_megapixels=spec.ref_megapixels,
                        width=spec.width,
                        height=spec.height,
                        sources=[f"reference {h[:12]}" for h in spec.content_hashes],
                    )
                    timing["encode_s"] = time.perf_counter() - t0
                return kv

            try:
                kv, hit = await asyncio.get_running_loop().run_in_executor(
                    self._pool, self._cache.get_or_create, spec.key, create
                )
                return kv, hit, timing.get("encode_s", 0.0)
            except _Evicted:
                data = await self._fetch(spec)
        raise RuntimeError(f"reference {spec.key} was evicted twice while being encoded")

    async def _fetch(self, spec: ReferenceSpec) -> list[bytes]:
        files = await self._store.get_bytes.remote(list(spec.content_hashes))
        for data, public_id in zip(files, spec.reference_ids):
            if data is None:
                raise ApiError(404, "reference_id", f"reference {public_id} is no longer stored; upload it again")
        return files

    # -- batching ---------------------------------------------------------------------------
    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.0)  # both set from the config in __init__
    async def _submit(self, pending: list[_Pending]) -> list[_Pending]:
        """Requests that arrived within the wait window join the device queue together."""
        self._waiting.extend(pending)
        if self._device_task is None or self._device_task.done():
            self._wakeup = asyncio.Event()
            self._device_task = asyncio.get_running_loop().create_task(self._device_loop())
        self._wakeup.set()
        return pending

    def _take_group(self) -> list[_Pending]:
        """The oldest waiting request plus every compatible one behind it, up to max_batch_size images."""
        self._waiting = [p for p in self._waiting if not p.future.done()]  # drop cancelled requests
        if not self._waiting:
            return []
        key = self._waiting[0].job.group_key()
        group, rest, images = [], [], 0
        for p in self._waiting:
            if p.job.group_key() == key and images + p.images <= self._config.max_batch_size:
                group.append(p)
                images += p.images
            else:
                rest.append(p)
        self._waiting = rest
        return group

    async def _device_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            group = self._take_group()
            if not group:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                replies = await loop.run_in_executor(self._pool, self._render_group, group)
            except Exception as e:  # one failed forward fails its requests, never the loop
                for p in group:
                    if not p.future.done():
                        p.future.set_exception(e)
                continue
            for p, reply in zip(group, replies):
                if not p.future.done():
                    p.future.set_result(reply)

    def _render_group(self, group: list[_Pending]) -> list[RenderReply]:
        from snapref_ray.requests import RenderRequest

        requests = [
            RenderRequest(prompt=p.job.prompt, seed=seed, settings=p.job.settings)
            for p in group
            for seed in p.job.seeds
        ]
        started = time.perf_counter()
        with self._device("render"):
            results = self._renderer.render(requests, refkv=group[0].refkv, progress=self._tick)
        batch_id = uuid.uuid4().hex[:12]
        replies, i = [], 0
        for p in group:
            mine = results[i : i + p.images]
            i += p.images
            t0 = time.perf_counter()
            pngs = [self._png(r, p.job) for r in mine]
            timings = {k: v for k, v in mine[0].timings.items() if k.endswith("_s")}
            timings.update(
                encode_s=p.encode_s,
                png_s=time.perf_counter() - t0,
                queue_s=started - p.arrived,
                replica_s=time.perf_counter() - p.arrived,
            )
            replies.append(
                RenderReply(
                    pngs,
                    [r.request.seed for r in mine],
                    timings,
                    len(requests),
                    len(group),
                    batch_id,
                    p.cache_hit,
                    self._replica,
                    self._cache_stats(),
                )
            )
        return replies

    def _png(self, result, job: RenderJob) -> bytes:
        from snapref_ray.storage.image_files import encode_rendered_image

        reference = job.reference
        adapter = self._renderer.adapter.identity if self._renderer.adapter is not None else None
        return encode_rendered_image(
            result.image,
            prompt=job.prompt,
            seed=result.request.seed,
            settings=job.settings.model_dump(),
            model=self._renderer.model_id,
            adapter=adapter,
            reference_hash=_reference_hash(reference) if reference else None,
            extra_info={
                "reference_ids": list(reference.reference_ids) if reference else [],
                "content_hashes": list(reference.content_hashes) if reference else [],
            },
        )

    # -- device bookkeeping -----------------------------------------------------------------
    @contextmanager
    def _device(self, what: str):
        with self._device_lock:
            self._busy_since = self._last_progress = time.monotonic()
            try:
                yield
            finally:
                self._busy_since = None
                self._last_progress = time.monotonic()

    def _tick(self, step: int, total: int) -> None:
        self._last_progress = time.monotonic()

    def _cache_stats(self) -> dict[str, int]:
        s = self._cache.stats
        return {
            "hits": s.hits,
            "misses": s.misses,
            "encodes": s.encodes,
            "evictions": s.evictions,
            "entries": len(self._cache),
            "bytes": self._cache.nbytes,
        }


@serve.deployment(name="SnapRefRenderer")
class RendererDeployment:
    """A renderer replica of the split topology: the ingress calls `render` through a handle whose
    multiplexed id is the reference key, and `_advertise` tells Serve's router which references this
    replica holds (see the module docstring)."""

    def __init__(self, config: ServeConfig, store) -> None:
        self._core = ReplicaRenderer(config, store)

    async def render(self, job: RenderJob) -> RenderReply | ApiError:
        if job.reference is not None:
            await self._advertise(job.reference.key)
        return await self._core.render(job)

    async def info(self) -> dict:
        return await self._core.info()

    def check_health(self) -> None:
        self._core.check_health()

    @serve.multiplexed(max_num_models_per_replica=MAX_ADVERTISED_REFERENCES)
    async def _advertise(self, key: str) -> str:
        return key


def _reference_hash(reference: ReferenceSpec) -> str:
    """The hash a batch job gives the same reference: the file's content hash, or the pair's combined hash."""
    from snapref_ray.storage.work_items import combined_reference_hash

    if reference.layout == "single" and len(reference.content_hashes) == 1:
        return reference.content_hashes[0]
    return combined_reference_hash(reference.layout, reference.content_hashes)
