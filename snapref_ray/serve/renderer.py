"""Rendering replicas: one `RenderService` per replica (one per GPU), routing by reference, and batching of
compatible requests.

What lies between a request and an image (the model, the RefKV cache, settings, the memory fit) is the
render service's (snapref_ray/render_service/). What is Serve's own lives here: `ReplicaRenderer` is what a
rendering replica holds. In the split topology it lives in a `RendererDeployment` replica, which the
ingress calls through a handle; in the fused topology the ingress replica holds one itself and renders
in-process (snapref_ray/serve/ingress.py).

A request's path through a replica:
1. Split topology only: `_advertise(key)` (`@serve.multiplexed`) tells Serve's router this replica
   holds the reference `key` (its `RefKVKey` as a string), so later requests for it come here first
   (soft affinity).
2. The settings are resolved for the loaded adapter kind (a misfit is a 400 naming the field), so is the
   reference's layout (`check_reference`, as at every door: ArcAnima kinds refuse `multi`), and the
   service reads the request's reference as it decides (`RenderService.read_reference`): the RefKV from
   its cache, or on a miss the files fetched from the ReferenceStore and encoded (concurrent misses on
   one key encode once; the others wait and count as hits); with `recompute_reference_every_step` the
   files themselves. Each request's read is its own, so its `cache_hit` and `encode_s` are too.
3. `_submit` (`@serve.batch`): requests that arrive within `batch_wait_timeout_s` of each other (0 by
   default: none is held back) enter the device queue together (Serve splits them by reference id first).
4. One device loop renders the oldest waiting request together with every waiting request that can
   share its forward (`service.batching.batch_key`), up to `max_batch` images; the service cuts
   that into the forwards that fit in memory. Requests that queued while the device was busy are
   merged this way too, which is where batching pays under load.

The multiplexed "model" is only a marker: the RefKV cache decides what is kept (by bytes), the marker
list sizes the routing table. `check_health` fails when the device has been busy without progress for
`stall_timeout_s`, so Serve replaces a hung replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ray import serve

from snapref_ray.render_service.batching import batch_key, take_batch
from snapref_ray.render_service.judges.spec import JudgeSpec
from snapref_ray.render_service.references import (
    Reference,
    ReferenceIdentity,
    ReferenceImageError,
    RefKVKey,
    check_reference,
)
from snapref_ray.requests import RenderSettings
from snapref_ray.serve.config import ServeConfig
from snapref_ray.serve.direct_ingress import over_this_replicas_transport
from snapref_ray.serve.errors import ApiError

log = logging.getLogger(__name__)

# Reference ids one replica advertises to the router. The RefKV cache's byte budget decides what
# stays on the device; this only bounds the routing table Serve keeps per replica.
MAX_ADVERTISED_REFERENCES = 64


@dataclass(frozen=True)
class UploadedReference:
    """A render's reference as the endpoint names it: uploaded files, their layout, and its RefKV key."""

    identity: ReferenceIdentity  # the layout and the files' content hashes (the ReferenceStore's keys)
    reference_ids: tuple[str, ...]  # the public ids, for metadata
    key: RefKVKey  # caption, size and target grid: what the RefKV is cached and routed by


@dataclass(frozen=True)
class RenderCall:
    """One HTTP render request as the ingress hands it to a replica."""

    prompt: str
    seeds: tuple[int, ...]
    settings: RenderSettings
    reference: UploadedReference | None = None
    ref_megapixels_set: bool = False  # the request chose ref_megapixels (else the upload's value applies)
    judge: JudgeSpec | None = None  # judge its images (render_service/judges/)
    contrast: UploadedReference | None = None  # the identity gap's other reference (judge.identity_gap)

    def batch_key(self) -> tuple:
        """Calls with equal keys can share one batched forward."""
        return batch_key(self.reference.key if self.reference else None, self.settings)


@dataclass
class RenderReply:
    """What a replica answers: image files and the facts of how they were made."""

    pngs: list[bytes]
    seeds: list[int]
    settings: RenderSettings  # as rendered: the adapter kind's defaults filled in
    timings: dict[str, float]
    batch_size: int
    batched_requests: int
    batch_id: str
    cache_hit: bool | None
    replica: str
    cache: dict[str, int] = field(default_factory=dict)
    judgements: list = field(default_factory=list)  # per image, its Judgement when the call set `judge`


@dataclass
class _Waiting:
    call: RenderCall
    read: object | None  # the service's ReferenceRead; typed loosely so this module imports without torch
    future: asyncio.Future
    arrived: float = field(default_factory=time.perf_counter)
    judge: object | None = None  # the service's JudgeCall for its images (None: not judged)

    @property
    def images(self) -> int:
        return len(self.call.seeds)


def _as_api_error(e: ValueError, call: RenderCall) -> ApiError | None:
    """The service's input errors (a bad reference image, an impossible setting, an image that does not
    fit) as the answer they deserve; None for others."""
    from snapref_ray.engine import RenderError
    from snapref_ray.render_service import RenderOutOfMemory

    if isinstance(e, ReferenceImageError):
        # The upload was checked at its own ref_megapixels, so a reference that fails now fails at the
        # size this request asked for.
        return ApiError(400, "ref_megapixels" if call.ref_megapixels_set else "reference_id", str(e))
    if isinstance(e, RenderOutOfMemory):
        # One image of this size does not fit a replica (they are alike): not a retry later, a smaller request.
        return ApiError(413, e.field, str(e))
    if isinstance(e, RenderError):
        return ApiError(400, e.field, str(e))
    return None


class ReplicaRenderer:
    """One resident RenderService with batching and a device loop: what a replica that renders holds,
    whether it is a renderer replica (split topology) or an ingress that renders itself (fused topology).
    `store` is the ReferenceStore's handle, for cache misses."""

    def __init__(self, config: ServeConfig, store) -> None:
        import torch

        from snapref_ray.render_service import RenderService

        self._config = config
        self._store = over_this_replicas_transport(store)
        device = config.model.device
        if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
            torch.set_num_threads(max(1, int(config.cpus_per_replica)))
        self.service = RenderService.load(
            config.model,
            s3=config.s3_options(),
            model_cache_dir=config.model_cache_dir,
            refkv_cache_bytes=config.refkv_cache_bytes,
            # What the replica asked Ray for (serve_app.build_app resolves it): the CPU batch fit stays inside it.
            memory_budget_bytes=config.memory_per_replica or None,
        )
        if config.model.compile and config.warmup_sizes:  # ready (this constructor returns) only once warm
            self.service.warmup(config.warmup_sizes, range(1, config.max_batch + 1))
        # Encodes and renders run in these threads so the event loop stays free for routing,
        # batching and health checks; the service keeps the device to one of them at a time.
        self._pool = ThreadPoolExecutor(
            max_workers=config.max_ongoing_requests + 2, thread_name_prefix="snapref-device"
        )
        self._waiting: list[_Waiting] = []
        self._wakeup: asyncio.Event | None = None
        self._device_task: asyncio.Task | None = None
        # The window admits everything the replica may hold; the device loop forms forwards of at most
        # max_batch images from it. (Capping the window at max_batch would push requests of
        # other groups into the next window and reorder them.)
        self._submit.set_max_batch_size(config.max_ongoing_requests)
        self._submit.set_batch_wait_timeout_s(config.batch_wait_timeout_s)
        try:
            self._replica = serve.get_replica_context().replica_id.unique_id
        except Exception:  # outside Serve (unit use)
            self._replica = "local"
        described = self.service.device_description()
        log.info("renderer replica %s ready on %s in %.1f s", self._replica, described.device, described.load_seconds)

    async def render(self, call: RenderCall) -> RenderReply | ApiError:
        """The rendered images; bad input is answered with an ApiError *value*, so that Serve does not
        log a client's mistake as a failed request with a traceback."""
        read = None
        try:
            call = dataclasses.replace(call, settings=self.service.resolve(call.settings))
            judge = self._judge_call(call)
            if call.reference is not None:
                # The layout check every door runs (render_service/references.py), before the files are fetched.
                check_reference((), call.reference.identity.layout, (), self.service.adapter_kind)
                read = await self._read_reference(call.reference, call.settings)
            loop = asyncio.get_running_loop()
            waiting = await self._submit(_Waiting(call, read, loop.create_future(), judge=judge))
            return await waiting.future
        except ApiError as e:
            return e
        except ValueError as e:
            api_error = _as_api_error(e, call)
            if api_error is None:
                raise
            return api_error

    async def info(self) -> dict:
        """The loaded model, adapter, LoRAs, device, dtype and memory fit (GET /v1/models)."""
        described = self.service.describe()
        adapter = described["adapter"]
        return {**described, "modes": list(adapter.get("modes", [])) if adapter else []}

    def check_health(self) -> None:
        """Raise (Serve then restarts the replica) if the device is stuck: busy with no progress."""
        stalled = self.service.stalled_for()
        if stalled > self._config.stall_timeout_s:
            raise RuntimeError(
                f"renderer stalled: the device has made no progress for {stalled:.0f} s"
                f" (stall_timeout_s={self._config.stall_timeout_s})"
            )

    def _judge_call(self, call: RenderCall):
        """The service's JudgeCall for `call` (None when it asks for no judge), checked before any device work."""
        if call.judge is None:
            return None
        from snapref_ray.render_service.judges.call import JudgeCall, check_call

        contrast = self._stored(call.contrast) if call.contrast is not None else None
        judge = JudgeCall(call.judge, contrast=contrast)
        check_call(judge, call.reference is not None)
        return judge

    # -- references -------------------------------------------------------------------------
    def _stored(self, uploaded: UploadedReference) -> Reference:
        """`uploaded` as the service takes a reference: its files fetched from the ReferenceStore when the service
        asks for them (on its thread, through this replica's event loop)."""
        loop = asyncio.get_running_loop()
        return Reference(
            uploaded.key,
            uploaded.identity.layout,
            tuple(f"reference {h[:12]}" for h in uploaded.identity.member_hashes),
            lambda: asyncio.run_coroutine_threadsafe(self._fetch(uploaded), loop).result(),
        )

    async def _read_reference(self, uploaded: UploadedReference, settings: RenderSettings):
        """The service's ReferenceRead of `uploaded` for `settings`; the files are fetched from the ReferenceStore
        only if the service asks for them."""
        loop = asyncio.get_running_loop()
        reference = self._stored(uploaded)
        read = self.service.cached_read(reference, settings)
        if read is not None:  # the common case, answered on the event loop without a thread hop
            return read
        return await loop.run_in_executor(self._pool, self.service.read_reference, reference, settings)

    async def _fetch(self, reference: UploadedReference) -> list[bytes]:
        files = await self._store.get_bytes.remote(list(reference.identity.member_hashes))
        for data, public_id in zip(files, reference.reference_ids):
            if data is None:
                raise ApiError(404, "reference_id", f"reference {public_id} is no longer stored; upload it again")
        return files

    # -- batching ---------------------------------------------------------------------------
    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.0)  # both set from the config in __init__
    async def _submit(self, waiting: list[_Waiting]) -> list[_Waiting]:
        """Requests that arrived within the wait window join the device queue together."""
        self._waiting.extend(waiting)
        if self._device_task is None or self._device_task.done():
            self._wakeup = asyncio.Event()
            self._device_task = asyncio.get_running_loop().create_task(self._device_loop())
        self._wakeup.set()
        return waiting

    def _take_group(self) -> list[_Waiting]:
        """The oldest waiting request plus every compatible one behind it, up to max_batch images."""
        self._waiting = [w for w in self._waiting if not w.future.done()]  # drop cancelled requests
        group, self._waiting = take_batch(
            self._waiting, lambda w: w.call.batch_key(), self._config.max_batch, lambda w: w.images
        )
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
                for w in group:
                    if not w.future.done():
                        w.future.set_exception(e)
                continue
            for w, reply in zip(group, replies):
                if not w.future.done():
                    w.future.set_result(reply)

    def _render_group(self, group: list[_Waiting]) -> list[RenderReply]:
        from snapref_ray.render_service.records import encode_output
        from snapref_ray.requests import RenderRequest

        requests = [
            RenderRequest(prompt=w.call.prompt, seed=seed, settings=w.call.settings)
            for w in group
            for seed in w.call.seeds
        ]
        started = time.perf_counter()
        read = group[0].read  # the group shares its reference key (batch_key), so one read serves it
        judge = [w.judge for w in group for _ in w.call.seeds]
        rendered = self.service.render(requests, reference=read, progress=self.service.tick, judge=judge)
        batch_id = uuid.uuid4().hex[:12]
        replies, i = [], 0
        for w in group:
            mine = rendered[i : i + w.images]
            i += w.images
            t0 = time.perf_counter()
            reference = w.call.reference
            extra = {
                "reference_ids": list(reference.reference_ids) if reference else [],
                "content_hashes": list(reference.identity.member_hashes) if reference else [],
            }
            pngs = [
                encode_output(r, model=self.service.model_id, adapter=self.service.adapter_id, extra_info=extra)
                for r in mine
            ]
            timings = {k: v for k, v in mine[0].timings.items() if k.endswith("_s")}
            # encode_s is each request's own: its read's encode, plus what the forward spent preparing the
            # images when it recomputes (the service's one meaning of encode_s).
            forward_s = mine[0].timings.get("encode_s", 0.0) - (read.encode_s if read is not None else 0.0)
            timings.update(
                encode_s=(w.read.encode_s if w.read is not None else 0.0) + forward_s,
                png_s=time.perf_counter() - t0,
                queue_s=started - w.arrived,
                replica_s=time.perf_counter() - w.arrived,
            )
            replies.append(
                RenderReply(
                    pngs,
                    [r.request.seed for r in mine],
                    mine[0].request.settings,
                    timings,
                    len(requests),
                    len(group),
                    batch_id,
                    w.read.source == "cache" if w.read is not None else None,
                    self._replica,
                    self._cache_stats(),
                    [r.judgement for r in mine],
                )
            )
        return replies

    def _cache_stats(self) -> dict[str, int]:
        cache = self.service.cache
        return {**cache.stats.as_dict(), "entries": len(cache), "bytes": cache.nbytes}


@serve.deployment(name="Renderer")
class RendererDeployment:
    """A renderer replica of the split topology: the ingress calls `render` through a handle whose
    multiplexed id is the reference's RefKV key, and `_advertise` tells Serve's router which references
    this replica holds (see the module docstring)."""

    def __init__(self, config: ServeConfig, store) -> None:
        self._core = ReplicaRenderer(config, store)

    async def render(self, call: RenderCall) -> RenderReply | ApiError:
        if call.reference is not None:
            await self._advertise(call.reference.key.token())
        return await self._core.render(call)

    async def info(self) -> dict:
        return await self._core.info()

    def check_health(self) -> None:
        self._core.check_health()

    @serve.multiplexed(max_num_models_per_replica=MAX_ADVERTISED_REFERENCES)
    async def _advertise(self, key: str) -> str:
        return key
