"""The HTTP ingress: FastAPI on Ray Serve. Auth, body limits, validation, references, rendering.

The OpenAI-compatible routes (`/v1/images/generations`, `/v1/images/edits`) are openai_routes.py's,
included here and rendered down the same path; their errors take OpenAI's shape (openai_errors.py).

Every other answer that is not a success is `{"error": {"field": ..., "message": ...}}`: 400 bad input,
401 no valid token, 404 unknown reference, 413 body or file too large, 503 (+ Retry-After) when
the renderers' queue is full, 504 when a render outlives `request_timeout_s`.

Two topologies (`ServeConfig.topology`). Split: the ingress does only cheap work (parsing, one
decode of an uploaded image to validate it) and calls the renderer replicas, where images are
rendered and PNG-encoded; Serve's router picks the replica by reference and queues for all of them.
Fused: each ingress replica holds a `ReplicaRenderer` and renders in-process, one hop less; it
admits at most `max_ongoing_requests + max_queued_requests` renders and answers 503 past them, as
the split router would.
"""

# No `from __future__ import annotations`: FastAPI reads the route signatures (Request) at runtime.
import asyncio
import base64
import copy
import json
import logging
import math
import time
from collections import OrderedDict
from contextlib import aclosing

import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import ValidationError
from ray import serve
from ray.serve.exceptions import BackPressureError, RayServeException
from starlette.exceptions import HTTPException as StarletteHTTPException

from snapref_ray.geometry import token_grid
from snapref_ray.render_service.references import ReferenceIdentity, RefKVKey
from snapref_ray.serve.api import (
    ECHO_CHARS,
    FORM_OVERHEAD,
    ErrorResponse,
    HealthResponse,
    ImageOut,
    ModelsResponse,
    ReferenceInfo,
    ReferenceOptions,
    RenderBody,
    RenderResponse,
    UploadJSON,
    as_api_error,
    check_limits,
    check_reference_fields,
    decode_base64,
    echo,
    json_body_limit,
    reference_id_for,
    require_media_type,
    validate_strict,
    validation_error,
)
from snapref_ray.serve.auth import BearerAuth
from snapref_ray.serve.bodies import BodyReceiver
from snapref_ray.serve.config import ServeConfig
from snapref_ray.serve.direct_ingress import over_this_replicas_transport
from snapref_ray.serve.errors import ApiError
from snapref_ray.serve.forms import MultipartForm
from snapref_ray.serve.openai_errors import error_response
from snapref_ray.serve.openai_images import model_cards
from snapref_ray.serve.openai_routes import OpenAIImageRoutes
from snapref_ray.serve.openai_routes import router as openai_router
from snapref_ray.serve.renderer import RenderCall, RenderReply, ReplicaRenderer, UploadedReference
from snapref_ray.validation import error_message, field_path

log = logging.getLogger(__name__)

_INFO_CACHE_SIZE = 100_000  # reference infos kept by an ingress (~1 kB each)
_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 408, 413, 415, 503, 504)}
_READ = ["GET", "HEAD"]  # every GET route answers HEAD too (same headers, no body)
# Text fields of a multipart upload: a caption of max_prompt_chars characters is at most 4 bytes each in
# UTF-8; a number needs a few dozen.
_MEGAPIXELS_BYTES = 64
_BEARER = "bearerAuth"
_SWAGGER_JS = "https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"
_SWAGGER_CSS = "https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css"

app = FastAPI(
    title="snapref-ray",
    version="1",
    description="SnapRef on Anima: upload a character reference once, then render scenes with it.",
    # Served by the ingress itself (below), so they can require the token.
    docs_url=None,
    openapi_url=None,
    # Starlette's slash redirect builds its Location from the Host header (an open redirect, before
    # auth): unknown paths, with or without a trailing slash, are a JSON 404 instead.
    redirect_slashes=False,
)
app.include_router(openai_router)


@app.exception_handler(ApiError)
async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return error_response(request, exc)


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request", "type": "value_error"}
    field = field_path(tuple(p for p in first["loc"] if p != "body")) or None
    return error_response(request, ApiError(400, field, error_message(first, echo_limit=ECHO_CHARS)))


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(request, ApiError(exc.status_code, None, str(exc.detail), getattr(exc, "headers", None)))


@app.exception_handler(Exception)
async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:  # a bug: log it whole
    log.exception("unexpected error in %s %s", request.method, request.url.path)
    return error_response(request, ApiError(500, None, f"internal error: {type(exc).__name__}"))


def _proxy_host() -> str | None:
    """The address Serve's HTTP proxy really binds (the config may not say, e.g. under `serve deploy`)."""
    try:
        from ray.serve.context import _get_global_client

        return _get_global_client().http_config.host
    except Exception:  # not in a Serve cluster (unit use) or the controller is unreachable: fall back to the config
        return None


def _form_number(text: str, field: str) -> float:
    """A number sent as form text: finite, and spelled as a number (not 'nan', 'inf' or 'true')."""
    try:
        value = float(text)
    except ValueError:
        raise ApiError(400, field, f"not a number: {echo(text)}") from None
    if not math.isfinite(value):
        raise ApiError(
            400,
            field,
            f"{'NaN' if math.isnan(value) else 'Infinity'} is not a number this API accepts; send a finite number",
        )
    return value


def _upload_openapi() -> dict:
    multipart = {
        "type": "object",
        "required": ["file"],
        "properties": {
            "file": {"type": "string", "format": "binary", "description": "The reference image file."},
            **ReferenceOptions.model_json_schema()["properties"],
        },
    }
    return {
        "requestBody": {
            "required": True,
            "content": {
                "multipart/form-data": {"schema": multipart},
                "application/json": {"schema": UploadJSON.model_json_schema()},
            },
        }
    }


def _render_openapi() -> dict:
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": RenderBody.model_json_schema()}}}
    }


def _inspect_image(data: bytes, megapixels: float, field: str) -> tuple[int, int, str]:
    """(width, height at `megapixels`, content hash); a 400 naming `field` for anything not a usable image."""
    from snapref_ray.adapter.images import ReferenceImageError, content_hash, fit_megapixels, open_reference

    try:
        img = open_reference(data, field)
        fitted = fit_megapixels(img, megapixels)
    except ReferenceImageError as e:
        raise ApiError(400, field, str(e)) from None
    return fitted.width, fitted.height, content_hash(data)


@serve.deployment(name="SnapRefIngress")
@serve.ingress(app)
class Ingress(OpenAIImageRoutes):
    """One ingress replica; the renderer and store handles come from `build_app`. `renderer` None:
    the fused topology, in which this replica renders itself. Its OpenAI-compatible routes are
    `OpenAIImageRoutes`'."""

    def __init__(self, config: ServeConfig, renderer, store) -> None:
        config.check_security(_proxy_host() or config.host)  # refuse to start exposed without a token
        self._config = config
        self._limits = config.limits
        self._store = over_this_replicas_transport(store)
        self._renderer = over_this_replicas_transport(renderer) if renderer is not None else None
        self._local = ReplicaRenderer(config, store) if renderer is None else None
        # Fused: renders this replica admits (rendering, waiting for the device, forming a batch, queued);
        # the split topology's per-replica slots plus its router's queue.
        self._render_slots = config.max_ongoing_requests + config.max_queued_requests
        self._rendering = 0
        self._auth = BearerAuth(config.resolved_token())
        self._bodies = BodyReceiver(config)
        self._openapi: dict | None = None
        self._started = int(time.time())  # when this replica loaded the model (GET /v1/models' `created`)
        # Reference infos by id. An id is a content hash, so its info never changes: caching it saves
        # a store round trip per render. If the store has evicted the file meanwhile, the replica
        # that needs to encode it answers 404.
        self._infos: OrderedDict[str, ReferenceInfo] = OrderedDict()

    # -- endpoints --------------------------------------------------------------------------
    @app.api_route(
        "/v1/health", methods=_READ, response_model=HealthResponse, summary="Liveness of the ingress (no token needed)"
    )
    async def health(self) -> dict:
        return {"status": "ok"}

    @app.api_route(
        "/v1/models",
        methods=_READ,
        response_model=ModelsResponse,
        responses=_ERRORS,
        summary="The loaded model and adapter, the modes and this server's limits",
    )
    async def models(self, request: Request) -> dict:
        self._auth.check(request.headers.get("authorization"))
        # Asked each time (one replica's figures: the memory fit and cache counters change as it works).
        info = await self._call(self._local.info() if self._local else self._renderer.info.remote())
        # `object` and `data`: the list shape OpenAI clients read (`models.list()`), next to today's fields.
        return {
            **info,
            "limits": self._limits,
            "max_batch": self._config.max_batch,
            "object": "list",
            "data": model_cards(info, self._started),
        }

    @app.api_route("/openapi.json", methods=_READ, include_in_schema=False)
    async def openapi(self, request: Request) -> JSONResponse:
        self._docs_auth(request)
        return JSONResponse(self._openapi_spec())

    @app.api_route("/docs", methods=_READ, include_in_schema=False)
    async def docs(self, request: Request) -> HTMLResponse:
        self._docs_auth(request)
        # The spec is inlined: with a token configured the browser could not fetch /openapi.json itself.
        spec = json.dumps(self._openapi_spec()).replace("</", "<\\/")
        return HTMLResponse(f"""<!doctype html><html><head><title>snapref-ray API</title>
<link rel="stylesheet" href="{_SWAGGER_CSS}"></head><body><div id="swagger-ui"></div>
<script src="{_SWAGGER_JS}"></script>
<script>SwaggerUIBundle({{spec: {spec}, dom_id: "#swagger-ui", persistAuthorization: true}});</script>
</body></html>""")

    @app.post(
        "/v1/references",
        response_model=ReferenceInfo,
        responses=_ERRORS,
        openapi_extra=_upload_openapi(),
        summary="Upload a reference image (multipart field `file`, or JSON with base64 `image`)",
    )
    async def upload_reference(self, request: Request) -> ReferenceInfo:
        self._auth.check(request.headers.get("authorization"))
        content_type = request.headers.get("content-type", "")
        media = content_type.partition(";")[0].strip().lower()
        if media == "multipart/form-data":
            field = "file"
            data, options = await self._read_form(request, content_type)
        elif media == "application/json":
            field = "image"
            raw = await self._bodies.read(request, json_body_limit(self._limits.max_upload_bytes), field)
            upload = validate_strict(UploadJSON, raw)
            data = decode_base64(upload.image, field)
            options = ReferenceOptions(ref_caption=upload.ref_caption, ref_megapixels=upload.ref_megapixels)
        else:
            raise ApiError(
                415, "Content-Type", f"expected multipart/form-data or application/json, got {echo(content_type)}"
            )
        return await self._store_reference(data, options, field)

    @app.post(
        "/v1/render",
        responses={**_ERRORS, 200: {"model": RenderResponse, "content": {"image/png": {}}}},
        openapi_extra=_render_openapi(),
        response_class=Response,
        summary="Render a scene with a reference: image/png, or JSON with base64 images and metadata",
    )
    async def render(self, request: Request) -> Response:
        started = time.perf_counter()
        self._auth.check(request.headers.get("authorization"))
        content_type = request.headers.get("content-type", "")
        require_media_type(content_type, "application/json", "/v1/render")
        raw = await self._bodies.read(request, json_body_limit(self._limits.max_upload_bytes), "body")
        body = validate_strict(RenderBody, raw)
        self._check_body(body)
        fmt = self._response_format(body, request.headers.get("accept", ""))
        reference = await self._uploaded_reference(body)
        reply = await self._render_with(body, reference, started)
        if fmt == "png":
            return Response(reply.pngs[0], media_type="image/png", headers=self._metadata_headers(reply, reference))
        # pydantic's own serializer: ~5x faster than JSONResponse's json.dumps on the base64 images
        # (0.24 ms against 1.1 ms for one 160 kB PNG), the same JSON.
        return Response(self._json_reply(body, reference, reply).model_dump_json(), media_type="application/json")

    # -- the render path (every route that renders) -----------------------------------------
    def _check_body(self, body: RenderBody) -> None:
        """What a render body must satisfy beyond its model: one way of naming the reference, the limits."""
        check_reference_fields(body)
        check_limits(body, self._limits)
        if body.seed + body.n > 2**63:
            raise ApiError(
                400, "seed", f"seed + n must stay below 2**63 (consecutive seeds), got {body.seed} + {body.n}"
            )

    async def _render_with(self, body: RenderBody, reference: UploadedReference | None, started: float) -> RenderReply:
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
            contrast=await self._contrast_reference(body),
        )
        called = time.perf_counter()
        reply = await self._render(call)
        finished = time.perf_counter()
        # call_s - replica_s is the hop to the renderer and back; total_s - call_s the ingress's own work.
        reply.timings.update(call_s=finished - called, total_s=finished - started)
        return reply

    async def _contrast_reference(self, body: RenderBody) -> UploadedReference | None:
        """The identity-gap judge's other reference, named here by its reference_id (None when not asked)."""
        gap = body.judge.identity_gap if body.judge is not None else None
        if gap is None or gap.contrast_reference is None:
            return None
        infos = await self._describe([gap.contrast_reference], ["judge.identity_gap.contrast_reference"])
        return self._reference_of(infos, "single", body)

    # -- docs -------------------------------------------------------------------------------
    def _docs_auth(self, request: Request) -> None:
        if not self._config.public_docs:
            self._auth.check(request.headers.get("authorization"))

    def _openapi_spec(self) -> dict:
        """FastAPI's spec plus the bearer scheme on every operation that checks the token."""
        if self._openapi is None:
            spec = copy.deepcopy(app.openapi())
            if self._auth.enabled:
                spec.setdefault("components", {})["securitySchemes"] = {
                    _BEARER: {
                        "type": "http",
                        "scheme": "bearer",
                        "description": "The server's token: `Authorization: Bearer <token>`.",
                    }
                }
                for path, operations in spec["paths"].items():
                    if path != "/v1/health":
                        for operation in operations.values():
                            operation["security"] = [{_BEARER: []}]
            self._openapi = spec
        return self._openapi

    # -- uploads ----------------------------------------------------------------------------
    async def _read_form(self, request: Request, content_type: str) -> tuple[bytes, ReferenceOptions]:
        """The multipart upload, parsed as it streams in: (file bytes, options)."""
        limits = self._limits
        form = MultipartForm(
            content_type,
            {
                "file": limits.max_upload_bytes,
                "ref_caption": 4 * limits.max_prompt_chars,
                "ref_megapixels": _MEGAPIXELS_BYTES,
            },
            max_parts=limits.max_form_parts,
            max_header_bytes=limits.max_part_header_bytes,
            too_large_status={"file": 413},
        )
        async with aclosing(self._bodies.chunks(request, limits.max_upload_bytes + FORM_OVERHEAD, "file")) as chunks:
            await form.feed(chunks)
        if "file" not in form.parts:
            raise ApiError(400, "file", f"the multipart body has no 'file' part ({form.count} parts)")
        values: dict = {}
        caption = form.text("ref_caption")
        if caption is not None:
            values["ref_caption"] = caption
        megapixels = form.text("ref_megapixels")
        if megapixels is not None:
            values["ref_megapixels"] = _form_number(megapixels, "ref_megapixels")
        try:
            options = ReferenceOptions(**values)
        except ValidationError as e:
            raise validation_error(e, set(ReferenceOptions.model_fields)) from None
        return bytes(form.parts["file"].data), options

    # -- references -------------------------------------------------------------------------
    async def _store_reference(self, data: bytes, options: ReferenceOptions, field: str) -> ReferenceInfo:
        limit = self._limits.max_upload_bytes
        if len(data) > limit:
            raise ApiError(413, field, f"the image is {len(data)} bytes, more than the {limit} accepted")
        if options.ref_megapixels > self._limits.max_megapixels:
            raise ApiError(
                400,
                "ref_megapixels",
                f"{options.ref_megapixels} MP, more than the {self._limits.max_megapixels} allowed",
            )
        if len(options.ref_caption) > self._limits.max_prompt_chars:
            raise ApiError(
                400,
                "ref_caption",
                f"{len(options.ref_caption)} characters, more than the {self._limits.max_prompt_chars} allowed",
            )
        # Decoding validates the file (corrupt, empty, bomb) and gives the encoded size; off the event loop.
        width, height, content_hash = await asyncio.to_thread(_inspect_image, data, options.ref_megapixels, field)
        info = ReferenceInfo(
            reference_id=reference_id_for(content_hash, options),
            content_hash=content_hash,
            width=width,
            height=height,
            ref_megapixels=options.ref_megapixels,
            ref_caption=options.ref_caption,
            bytes=len(data),
        )
        info = await self._call(self._store.put.remote(info, data))
        self._remember(info)
        return info

    def _remember(self, info: ReferenceInfo) -> None:
        self._infos[info.reference_id] = info
        self._infos.move_to_end(info.reference_id)
        while len(self._infos) > _INFO_CACHE_SIZE:
            self._infos.popitem(last=False)

    async def _uploaded_reference(self, body: RenderBody) -> UploadedReference | None:
        if body.reference_image is not None:
            data = decode_base64(body.reference_image, "reference_image")
            options = ReferenceOptions(ref_caption=body.ref_caption, ref_megapixels=body.ref_megapixels)
            infos = [await self._store_reference(data, options, "reference_image")]
            fields = ["reference_image"]
        elif body.left_reference_id is not None:
            fields = ["left_reference_id", "right_reference_id"]
            infos = await self._describe([body.left_reference_id, body.right_reference_id], fields)
        elif body.reference_id is not None:
            fields = ["reference_id"]
            infos = await self._describe([body.reference_id], fields)
        else:
            return None
        return self._reference_of(infos, "pair" if len(infos) == 2 else "single", body)

    @staticmethod
    def _reference_of(infos: list[ReferenceInfo], layout: str, body: RenderBody) -> UploadedReference:
        """The reference of stored uploads `infos`, read as `layout`, for rendering `body`."""
        first = infos[0]
        # The upload's caption and size apply unless this request sets them (the pair takes the left's).
        caption = body.ref_caption if "ref_caption" in body.model_fields_set else first.ref_caption
        megapixels = body.ref_megapixels if "ref_megapixels" in body.model_fields_set else first.ref_megapixels
        identity = ReferenceIdentity(layout, tuple(i.content_hash for i in infos))
        return UploadedReference(
            identity=identity,
            reference_ids=tuple(i.reference_id for i in infos),
            key=RefKVKey(identity.hash, caption, megapixels, *token_grid(height=body.height, width=body.width)),
        )

    async def _describe(self, ids: list[str], fields: list[str]) -> list[ReferenceInfo]:
        missing = [r for r in ids if r not in self._infos]
        if missing:
            for info in await self._call(self._store.describe.remote(missing)):
                if info is not None:
                    self._remember(info)
        for reference_id, field in zip(ids, fields):
            if reference_id not in self._infos:
                raise ApiError(
                    404,
                    field,
                    f"unknown reference id {echo(reference_id)}: upload the image to"
                    " /v1/references first (ids are kept while the server has room)",
                )
        for reference_id in ids:
            self._infos.move_to_end(reference_id)
        return [self._infos[r] for r in ids]

    # -- rendering, calls and answers -------------------------------------------------------
    def check_health(self) -> None:
        """Serve's health check: a fused replica is unhealthy when its device is stuck."""
        if self._local is not None:
            self._local.check_health()

    async def _render(self, call: RenderCall) -> RenderReply:
        if self._local is None:  # split: Serve's router picks a renderer, preferring one that holds the reference
            handle = self._renderer.options(multiplexed_model_id=call.reference.key.token() if call.reference else "")
            return await self._call(handle.render.remote(call))
        if self._rendering >= self._render_slots:
            raise self._at_capacity()
        self._rendering += 1
        try:
            return await self._call(self._local.render(call))
        finally:
            self._rendering -= 1

    def _at_capacity(self) -> ApiError:
        return ApiError(
            503, None, "the renderers are at capacity; retry after the Retry-After delay", headers=self._retry_after()
        )

    def _retry_after(self) -> dict[str, str]:
        return {"Retry-After": str(math.ceil(self._config.retry_after_s))}

    async def _call(self, response):
        """Await a deployment call (or, fused, a coroutine of this replica's renderer), translating
        overload, timeouts and replica errors into ApiErrors."""
        try:
            result = await asyncio.wait_for(response, timeout=self._config.request_timeout_s)
        except TimeoutError:
            if hasattr(response, "cancel"):  # a deployment call; wait_for has cancelled a coroutine already
                response.cancel()
            raise ApiError(
                504, None, f"the render did not finish within request_timeout_s={self._config.request_timeout_s:g} s"
            ) from None
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

    @staticmethod
    def _response_format(body: RenderBody, accept: str) -> str:
        fmt = body.response_format
        if fmt is None:
            wants_json = "application/json" in accept and "image/png" not in accept
            fmt = "json" if wants_json or body.n > 1 else "png"
        if fmt == "png" and body.n > 1:
            raise ApiError(
                400,
                "n",
                f"image/png carries one image, {body.n} were asked for: use response_format 'json' for several",
            )
        return fmt

    @staticmethod
    def _metadata_headers(reply: RenderReply, reference: UploadedReference | None) -> dict[str, str]:
        headers = {
            "X-Seed": str(reply.seeds[0]),
            "X-Batch-Size": str(reply.batch_size),
            "X-Batch-Id": reply.batch_id,
            "X-Replica": reply.replica,
            "X-Timings": ",".join(f"{k}={v:.4f}" for k, v in sorted(reply.timings.items())),
        }
        if reference is not None:
            headers["X-Reference-Ids"] = ",".join(reference.reference_ids)
            headers["X-Cache-Hit"] = "true" if reply.cache_hit else "false"
        return headers

    @staticmethod
    def _json_reply(body: RenderBody, reference: UploadedReference | None, reply: RenderReply) -> RenderResponse:
        images = [
            ImageOut(
                seed=seed,
                width=reply.settings.width,
                height=reply.settings.height,
                png_base64=base64.b64encode(png).decode("ascii"),
                judgement=judgement,
            )
            for seed, png, judgement in zip(reply.seeds, reply.pngs, reply.judgements or [None] * len(reply.pngs))
        ]
        return RenderResponse(
            images=images,
            prompt=body.prompt,
            seeds=reply.seeds,
            settings=reply.settings,
            reference_ids=list(reference.reference_ids) if reference else [],
            timings=reply.timings,
            batch_size=reply.batch_size,
            batched_requests=reply.batched_requests,
            batch_id=reply.batch_id,
            cache_hit=reply.cache_hit,
            replica=reply.replica,
            cache=reply.cache,
        )
