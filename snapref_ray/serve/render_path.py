"""The ingress's way to a rendered image: checks, the reference, the call to a renderer and its answer.

Every route that renders (/v1/render, and the OpenAI routes through their port, openai_routes.py) goes down
this one path, so a request's limits, timeout, overload answer and reference handling are the same
whichever route it came in by. Split topology: the call goes to a renderer replica through Serve's router,
which prefers one that holds the reference. Fused: this ingress replica's own `ReplicaRenderer` renders it,
admitting at most `max_ongoing_requests + max_queued_requests` renders and answering 503 past them, as the
split router would.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence

import ray
from ray.serve.exceptions import BackPressureError, RayServeException

from snapref_ray.serve.api import RenderBody, as_api_error, check_limits, check_reference_fields
from snapref_ray.serve.config import ServeConfig
from snapref_ray.serve.errors import ApiError
from snapref_ray.serve.renderer import RenderCall, RenderReply, UploadedReference
from snapref_ray.serve.uploads import ReferenceUploads


class RenderPath:
    """Renders a checked `RenderBody` with its reference. `renderer` is the renderer deployment's handle
    (split topology) or None, and then `local` is this replica's own `ReplicaRenderer` (fused)."""

    def __init__(self, config: ServeConfig, renderer, local, store) -> None:
        self._config = config
        self._renderer = renderer
        self._local = local
        # Fused: renders this replica admits (rendering, waiting for the device, forming a batch, queued);
        # the split topology's per-replica slots plus its router's queue.
        self._render_slots = config.max_ongoing_requests + config.max_queued_requests
        self._rendering = 0
        self._model_id: str | None = None
        self.uploads = ReferenceUploads(config.limits, store, self.call)

    # -- what the OpenAI routes' port asks for (openai_routes.RenderPort) -------------------------
    async def model_id(self) -> str:
        """The loaded model's id as GET /v1/models lists it (asked once: it does not change while serving)."""
        if self._model_id is None:
            self._model_id = (await self.info())["model"]
        return self._model_id

    def check(self, body: RenderBody) -> None:
        """What a render body must satisfy beyond its model: one way of naming the reference, the limits."""
        check_reference_fields(body)
        check_limits(body, self._config.limits)
        if body.seed + body.n > 2**63:
            raise ApiError(
                400, "seed", f"seed + n must stay below 2**63 (consecutive seeds), got {body.seed} + {body.n}"
            )

    async def reference(self, body: RenderBody) -> UploadedReference | None:
        """The reference `body` names (by id, or inline), None without one."""
        return await self.uploads.reference_of_body(body)

    async def upload(self, body: RenderBody, images: Sequence[bytes], layout: str) -> UploadedReference:
        """`images` stored as uploads are, then read together as `layout` for rendering `body`."""
        return await self.uploads.reference_of_files(body, images, layout)

    async def render(self, body: RenderBody, reference: UploadedReference | None, started: float) -> RenderReply:
        """`body` rendered with `reference`; `started` is when the request arrived (for total_s)."""
        settings = (
            body.settings(ref_caption=reference.key.ref_caption, ref_megapixels=reference.key.ref_megapixels)
            if reference
            else body.settings()
        )
        call = RenderCall(
            body.prompt,
            tuple(range(body.seed, body.seed + body.n)),
            settings,
            reference,
            ref_megapixels_set="ref_megapixels" in body.model_fields_set,
            judge=body.judge,
            contrast=await self.uploads.contrast_reference(body),
        )
        called = time.perf_counter()
        reply = await self.render_call(call)
        finished = time.perf_counter()
        # call_s - replica_s is the hop to the renderer and back; total_s - call_s the ingress's own work.
        reply.timings.update(call_s=finished - called, total_s=finished - started)
        return reply

    # -- the renderers ----------------------------------------------------------------------------
    async def info(self) -> dict:
        """One renderer's description (GET /v1/models): model, adapter, modes, memory fit, cache counters."""
        return await self.call(self._local.info() if self._local else self._renderer.info.remote())

    def check_health(self) -> None:
        """A fused replica is unhealthy when its device is stuck; a split ingress renders nothing."""
        if self._local is not None:
            self._local.check_health()

    async def render_call(self, call: RenderCall) -> RenderReply:
        if self._local is None:  # split: Serve's router picks a renderer, preferring one that holds the reference
            handle = self._renderer.options(multiplexed_model_id=call.reference.key.token() if call.reference else "")
            return await self.call(handle.render.remote(call))
        if self._rendering >= self._render_slots:
            raise self._at_capacity()
        self._rendering += 1
        try:
            return await self.call(self._local.render(call))
        finally:
            self._rendering -= 1

    async def call(self, response):
        """Await a deployment call (or, fused, a coroutine of this replica's renderer), translating
        overload, timeouts and replica errors into ApiErrors."""
        timeout_s = self._config.request_timeout_s
        try:
            result = await asyncio.wait_for(response, timeout=timeout_s)
        except TimeoutError:
            if hasattr(response, "cancel"):  # a deployment call; wait_for has cancelled a coroutine already
                response.cancel()
            raise ApiError(504, None, f"the render did not finish within request_timeout_s={timeout_s:g} s") from None
        except Exception as e:
            api_error = as_api_error(e)
            if api_error is not None:
                raise api_error from None
            if isinstance(e, BackPressureError) or isinstance(getattr(e, "cause", None), BackPressureError):
                raise self._at_capacity() from None
            if isinstance(e, (RayServeException, ray.exceptions.RayActorError)):  # overloaded, or its replica died
                raise ApiError(
                    503, None, f"renderer unavailable: {type(e).__name__}", headers=self._retry_after()
                ) from None
            raise
        if isinstance(result, ApiError):  # a replica answers bad input with a value, not a crash
            raise result
        return result

    def _at_capacity(self) -> ApiError:
        return ApiError(
            503, None, "the renderers are at capacity; retry after the Retry-After delay", headers=self._retry_after()
        )

    def _retry_after(self) -> dict[str, str]:
        return {"Retry-After": str(math.ceil(self._config.retry_after_s))}
