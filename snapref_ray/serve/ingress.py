"""The HTTP ingress: FastAPI on Ray Serve. Auth, body limits, validation, references, rendering.

This module is the routes: each checks the token, reads its request and hands it on. Uploads are
uploads.py's, the render path (checks, the reference, the call to a renderer) render_path.py's, the
OpenAPI document openapi_doc.py's. The OpenAI-compatible routes (`/v1/images/generations`,
`/v1/images/edits`) are served by `OpenAIImages` (openai_routes.py) over the render path; their errors take
OpenAI's shape (openai_errors.py).

Every other answer that is not a success is `{"error": {"field": ..., "message": ...}}`: 400 bad input,
401 no valid token, 404 unknown reference, 413 body or file too large, 503 (+ Retry-After) when
the renderers' queue is full, 504 when a render outlives `request_timeout_s`.

Two topologies (`ServeConfig.topology`). Split: the ingress does only cheap work (parsing, one
decode of an uploaded image to validate it) and calls the renderer replicas, where images are
rendered and PNG-encoded. Fused: each ingress replica holds a `ReplicaRenderer` and renders
in-process, one hop less (render_path.py).
"""

# No `from __future__ import annotations`: FastAPI reads the route signatures (Request) at runtime.
import base64
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from snapref_ray.serve import openapi_doc
from snapref_ray.serve.api import (
    ECHO_CHARS,
    ErrorResponse,
    HealthResponse,
    ImageOut,
    ModelsResponse,
    ReferenceInfo,
    ReferenceOptions,
    RenderBody,
    RenderResponse,
    UploadJSON,
    decode_base64,
    echo,
    json_body_limit,
    require_media_type,
    validate_strict,
)
from snapref_ray.serve.auth import BearerAuth
from snapref_ray.serve.bodies import BodyReceiver
from snapref_ray.serve.config import ServeConfig
from snapref_ray.serve.direct_ingress import over_this_replicas_transport
from snapref_ray.serve.errors import ApiError
from snapref_ray.serve.openai_errors import error_response
from snapref_ray.serve.openai_images import ImagesResponse, model_cards
from snapref_ray.serve.openai_routes import ERRORS as OPENAI_ERRORS
from snapref_ray.serve.openai_routes import OpenAIImages
from snapref_ray.serve.render_path import RenderPath
from snapref_ray.serve.renderer import RenderReply, ReplicaRenderer, UploadedReference
from snapref_ray.validation import error_message, field_path

log = logging.getLogger(__name__)

_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 408, 413, 415, 503, 504)}
_READ = ["GET", "HEAD"]  # every GET route answers HEAD too (same headers, no body)

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


@serve.deployment(name="SnapRefIngress")
@serve.ingress(app)
class Ingress:
    """One ingress replica; the renderer and store handles come from `build_app`. `renderer` None:
    the fused topology, in which this replica renders itself."""

    def __init__(self, config: ServeConfig, renderer, store) -> None:
        config.check_security(_proxy_host() or config.host)  # refuse to start exposed without a token
        self._config = config
        self._limits = config.limits
        local = ReplicaRenderer(config, store) if renderer is None else None
        renderer = over_this_replicas_transport(renderer) if renderer is not None else None
        self._path = RenderPath(config, renderer, local, over_this_replicas_transport(store))
        self._auth = BearerAuth(config.resolved_token())
        self._bodies = BodyReceiver(config)
        self._openai = OpenAIImages(self._path, self._auth, self._bodies, config.limits)
        self._openapi: dict | None = None
        self._started = int(time.time())  # when this replica loaded the model (GET /v1/models' `created`)

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
        info = await self._path.info()
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
        return HTMLResponse(openapi_doc.docs_page(self._openapi_spec()))

    @app.post(
        "/v1/references",
        response_model=ReferenceInfo,
        responses=_ERRORS,
        openapi_extra=openapi_doc.upload_body(),
        summary="Upload a reference image (multipart field `file`, or JSON with base64 `image`)",
    )
    async def upload_reference(self, request: Request) -> ReferenceInfo:
        self._auth.check(request.headers.get("authorization"))
        content_type = request.headers.get("content-type", "")
        media = content_type.partition(";")[0].strip().lower()
        if media == "multipart/form-data":
            field = "file"
            data, options = await self._path.uploads.read_form(self._bodies, request, content_type)
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
        return await self._path.uploads.store(data, options, field)

    @app.post(
        "/v1/render",
        responses={**_ERRORS, 200: {"model": RenderResponse, "content": {"image/png": {}}}},
        openapi_extra=openapi_doc.render_body(),
        response_class=Response,
        summary="Render a scene with a reference: image/png, or JSON with base64 images and metadata",
    )
    async def render(self, request: Request) -> Response:
        started = time.perf_counter()
        self._auth.check(request.headers.get("authorization"))
        content_type = request.headers.get("content-type", "")
        require_media_type(content_type, "application/json", "/v1/render")
        raw = await self._bodies.read(request, json_body_limit(self._limits.max_upload_bytes), "body")
        body = validate_strict(RenderBody, raw, self._limits)
        self._path.check(body)
        fmt = self._response_format(body, request.headers.get("accept", ""))
        reference = await self._path.reference(body)
        reply = await self._path.render(body, reference, started)
        if fmt == "png":
            return Response(reply.pngs[0], media_type="image/png", headers=self._metadata_headers(reply, reference))
        # pydantic's own serializer: ~5x faster than JSONResponse's json.dumps on the base64 images
        # (0.24 ms against 1.1 ms for one 160 kB PNG), the same JSON.
        return Response(self._json_reply(body, reference, reply).model_dump_json(), media_type="application/json")

    @app.post(
        "/v1/images/generations",
        response_model=ImagesResponse,
        responses=OPENAI_ERRORS,
        openapi_extra=openapi_doc.generation_body(),
        summary="OpenAI images API: render from a prompt (with an uploaded reference by id, or none)",
    )
    async def images_generations(self, request: Request) -> Response:
        return await self._openai.generations(request)

    @app.post(
        "/v1/images/edits",
        response_model=ImagesResponse,
        responses=OPENAI_ERRORS,
        openapi_extra=openapi_doc.edit_body(),
        summary="OpenAI images API: render with the uploaded image(s) as the reference",
    )
    async def images_edits(self, request: Request) -> Response:
        return await self._openai.edits(request)

    def check_health(self) -> None:
        """Serve's health check: a fused replica is unhealthy when its device is stuck."""
        self._path.check_health()

    # -- docs -------------------------------------------------------------------------------
    def _docs_auth(self, request: Request) -> None:
        if not self._config.public_docs:
            self._auth.check(request.headers.get("authorization"))

    def _openapi_spec(self) -> dict:
        if self._openapi is None:
            self._openapi = openapi_doc.openapi_document(app, bearer=self._auth.enabled)
        return self._openapi

    # -- answers ----------------------------------------------------------------------------
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
