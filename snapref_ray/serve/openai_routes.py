"""The OpenAI-compatible routes of the ingress: POST /v1/images/generations and POST /v1/images/edits.

`OpenAIImageRoutes` is a base of the ingress (`Ingress`), so these handlers run on the same replica with
the same token check, body deadlines, limits, reference store and render path as /v1/references and
/v1/render (ingress.py); its routes live on `router`, which the ingress's app includes. An OpenAI request
becomes the `RenderBody` /v1/render would take (openai_images.py) and goes down that one path; an edit's
image files are stored exactly as uploads to /v1/references are, so the RefKV cache serves them alike.
Errors answer in OpenAI's shape (openai_errors.py), with the request's field names.
"""

# No `from __future__ import annotations`: FastAPI reads the route signatures (Request) at runtime.
import asyncio
import base64
import time
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError

from snapref_ray.requests import RenderSettings
from snapref_ray.serve.api import (
    FORM_OVERHEAD,
    ReferenceOptions,
    json_body_limit,
    parse_json_object,
    require_media_type,
    validation_error,
)
from snapref_ray.serve.errors import ApiError
from snapref_ray.serve.forms import MultipartForm
from snapref_ray.serve.openai_errors import OpenAIErrorResponse, renamed
from snapref_ray.serve.openai_images import (
    ADAPTER_FIELDS,
    MAX_REFERENCE_IMAGES,
    OPENAI_NAMES,
    ImageEditRequest,
    ImageGenerationRequest,
    ImageRequestFields,
    ImagesResponse,
    check_model,
    edit_field_names,
    encode_image,
    form_values,
    images_response,
    output_options,
    render_body,
)
from snapref_ray.serve.renderer import RenderReply, UploadedReference

router = APIRouter()

_ERRORS = {code: {"model": OpenAIErrorResponse} for code in (400, 401, 404, 408, 413, 415, 503, 504)}
_PROMPT_FIELDS = ("prompt", "negative_prompt", "ref_caption")
_SMALL_FIELD_BYTES = 1024  # a number, a name or a small JSON object
# Once an edit's files are the reference, the renderer's errors about "reference_id" are about them, and so
# are its refusals of their layout (several images of one character, which ArcAnima kinds do not read).
_EDIT_RENDER_NAMES = {**OPENAI_NAMES, "reference_id": "image", "layout": "image"}


def _with_settings(schema: dict) -> dict:
    """`schema` with the adapter's settings listed (they are accepted as extra fields under their own names)."""
    settings = RenderSettings.model_json_schema()
    properties = {**schema["properties"], **{n: settings["properties"][n] for n in ADAPTER_FIELDS}}
    defs = {**schema.get("$defs", {}), **settings.get("$defs", {})}
    return {**schema, "properties": properties, **({"$defs": defs} if defs else {})}


def _generation_openapi() -> dict:
    schema = _with_settings(ImageGenerationRequest.model_json_schema())
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _edit_openapi() -> dict:
    schema = _with_settings(ImageEditRequest.model_json_schema())
    image = {
        "description": f"The reference: one file (`image`), or up to {MAX_REFERENCE_IMAGES} as `image[]`"
        " (one character, or two with reference_layout 'pair').",
        "oneOf": [
            {"type": "string", "format": "binary"},
            {"type": "array", "items": {"type": "string", "format": "binary"}},
        ],
    }
    schema["properties"] = {"image": image, **schema["properties"]}
    schema["required"] = ["image", "prompt"]
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": schema}}}}


class OpenAIImageRoutes:
    """The OpenAI images routes, as methods of the ingress (which provides `_auth`, `_bodies`, `_limits`,
    `_store_reference`, `_uploaded_reference`, `_reference_of`, `_check_body`, `_render_with`, `_model_id`)."""

    @router.post(
        "/v1/images/generations",
        response_model=ImagesResponse,
        responses=_ERRORS,
        openapi_extra=_generation_openapi(),
        summary="OpenAI images API: render from a prompt (with an uploaded reference by id, or none)",
    )
    async def images_generations(self, request: Request) -> Response:
        started = time.perf_counter()
        try:
            self._auth.check(request.headers.get("authorization"))
            content_type = request.headers.get("content-type", "")
            require_media_type(content_type, "application/json", "/v1/images/generations")
            raw = await self._bodies.read(request, json_body_limit(self._limits.max_upload_bytes), "body")
            req = _validated(ImageGenerationRequest, parse_json_object(raw, set(ImageGenerationRequest.model_fields)))
            references = {
                f: getattr(req, f)
                for f in ("reference_id", "left_reference_id", "right_reference_id")
                if getattr(req, f) is not None
            }
            body = render_body(req, references)
            output = output_options(req)
            if req.model is not None:
                check_model(req.model, await self._model_id())
            self._check_body(body)
            reference = await self._uploaded_reference(body)
            reply = await self._render_with(body, reference, started)
            return await _answer(reply, reference, output)
        except ApiError as e:
            raise renamed(e, OPENAI_NAMES) from None

    @router.post(
        "/v1/images/edits",
        response_model=ImagesResponse,
        responses=_ERRORS,
        openapi_extra=_edit_openapi(),
        summary="OpenAI images API: render with the uploaded image(s) as the reference",
    )
    async def images_edits(self, request: Request) -> Response:
        started = time.perf_counter()
        try:
            self._auth.check(request.headers.get("authorization"))
            content_type = request.headers.get("content-type", "")
            require_media_type(content_type, "multipart/form-data", "/v1/images/edits")
            images, texts = await self._read_edit_form(request, content_type)
            req = _validated(ImageEditRequest, form_values(texts))
            body = render_body(req)
            output = output_options(req)
        except ApiError as e:
            raise renamed(e, OPENAI_NAMES) from None
        try:
            if req.model is not None:
                check_model(req.model, await self._model_id())
            layout = _layout(req, len(images))
            self._check_body(body)
            options = ReferenceOptions(ref_caption=body.ref_caption, ref_megapixels=body.ref_megapixels)
            infos = [await self._store_reference(data, options, "image") for data in images]
            reference = self._reference_of(infos, layout, body)
            reply = await self._render_with(body, reference, started)
            return await _answer(reply, reference, output)
        except ApiError as e:
            raise renamed(e, _EDIT_RENDER_NAMES) from None

    async def _read_edit_form(self, request: Request, content_type: str) -> tuple[list[bytes], dict[str, str]]:
        """The edit's image files (in order) and its text fields, parsed as the body streams in."""
        limits = self._limits
        part_limits = {name: _SMALL_FIELD_BYTES for name in edit_field_names()}
        part_limits.update({name: 4 * limits.max_prompt_chars for name in _PROMPT_FIELDS})
        part_limits.update({"image": limits.max_upload_bytes, "image[]": limits.max_upload_bytes})
        part_limits["mask"] = limits.max_upload_bytes  # read, to be refused by name below
        form = MultipartForm(
            content_type,
            part_limits,
            # Each name comes once (image[] up to MAX_REFERENCE_IMAGES times), so this bounds nothing a
            # valid form needs; a flood of parts still stops at its first extra one.
            max_parts=len(part_limits) + MAX_REFERENCE_IMAGES,
            max_header_bytes=limits.max_part_header_bytes,
            too_large_status={"image": 413, "image[]": 413},
            repeatable={"image[]": MAX_REFERENCE_IMAGES},
        )
        body_limit = MAX_REFERENCE_IMAGES * limits.max_upload_bytes + 3 * 4 * limits.max_prompt_chars + FORM_OVERHEAD
        async with aclosing(self._bodies.chunks(request, body_limit, "image")) as chunks:
            await form.feed(chunks)
        if "mask" in form.parts:
            raise ApiError(400, "mask", "masks are not served: the image is a character reference, not a canvas")
        if "image" in form.parts and "image[]" in form.parts:
            raise ApiError(400, "image", "send the reference as 'image' or as 'image[]' parts, not both")
        files = form.repeated.get("image[]") or ([form.parts["image"]] if "image" in form.parts else [])
        if not files:
            raise ApiError(400, "image", f"the multipart body has no 'image' part ({form.count} parts)")
        texts = {name: form.text(name) for name in form.parts if name not in ("image", "image[]")}
        return [bytes(f.data) for f in files], texts

    async def _model_id(self) -> str:
        """The loaded model's id as GET /v1/models lists it (asked once: it does not change while serving)."""
        model_id = getattr(self, "_served_model", None)
        if model_id is None:
            info = await self._call(self._local.info() if self._local else self._renderer.info.remote())
            model_id = self._served_model = info["model"]
        return model_id


def _validated(model: type[ImageRequestFields], values: dict) -> ImageRequestFields:
    try:
        return model.model_validate(values, strict=True)
    except ValidationError as e:
        raise validation_error(e, set(model.model_fields), model) from None


def _layout(req: ImageEditRequest, count: int) -> str:
    if req.reference_layout == "pair" and count != 2:
        raise ApiError(400, "reference_layout", f"'pair' is two characters: send two images, not {count}")
    if count == 1:
        return "single"
    return req.reference_layout or "multi"


async def _answer(reply: RenderReply, reference: UploadedReference | None, output) -> Response:
    if output.format == "png":
        files = reply.pngs
    else:  # re-encoding is CPU work: off the event loop
        files = await asyncio.gather(*(asyncio.to_thread(encode_image, png, output) for png in reply.pngs))
    images = [base64.b64encode(f).decode("ascii") for f in files]
    answer = images_response(reply, list(reference.reference_ids) if reference else [], images, output)
    return Response(answer.model_dump_json(), media_type="application/json")
