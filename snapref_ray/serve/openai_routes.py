"""The OpenAI-compatible routes of the ingress: POST /v1/images/generations and POST /v1/images/edits.

`OpenAIImages` serves them over one narrow port, `RenderPort` (the ingress's render path, render_path.py):
the model's id, the checks of a render body, its reference (by id, or an edit's image files stored exactly
as uploads to /v1/references are, so the RefKV cache serves them alike) and the render. It reads the
request body itself with the ingress's `BodyReceiver` and limits. An OpenAI request becomes the
`RenderBody` /v1/render would take (openai_images.py) and goes down that one path. Errors answer in
OpenAI's shape (openai_errors.py), with the request's field names.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Sequence
from contextlib import aclosing
from typing import Protocol

from fastapi.responses import Response
from pydantic import ValidationError
from starlette.requests import Request

from snapref_ray.serve.api import (
    FORM_OVERHEAD,
    RenderBody,
    json_body_limit,
    parse_json_object,
    require_media_type,
    validation_error,
)
from snapref_ray.serve.auth import BearerAuth
from snapref_ray.serve.bodies import BodyReceiver
from snapref_ray.serve.config import ServeLimits
from snapref_ray.serve.errors import ApiError
from snapref_ray.serve.forms import MultipartForm
from snapref_ray.serve.openai_errors import OpenAIErrorResponse, renamed
from snapref_ray.serve.openai_images import (
    MAX_REFERENCE_IMAGES,
    OPENAI_NAMES,
    ImageEditRequest,
    ImageGenerationRequest,
    ImageRequestFields,
    check_model,
    edit_field_names,
    encode_image,
    form_values,
    images_response,
    output_options,
    render_body,
)
from snapref_ray.serve.renderer import RenderReply, UploadedReference

ERRORS = {code: {"model": OpenAIErrorResponse} for code in (400, 401, 404, 408, 413, 415, 503, 504)}
_PROMPT_FIELDS = ("prompt", "negative_prompt", "ref_caption")
_SMALL_FIELD_BYTES = 1024  # a number, a name or a small JSON object
# Once an edit's files are the reference, the renderer's errors about "reference_id" are about them, and so
# are its refusals of their layout (several images of one character, which ArcAnima kinds do not read).
_EDIT_RENDER_NAMES = {**OPENAI_NAMES, "reference_id": "image", "layout": "image"}


class RenderPort(Protocol):
    """What the OpenAI routes need of the server besides reading the request: all of it is the render path's."""

    async def model_id(self) -> str:
        """The loaded model's id, as GET /v1/models lists it."""

    def check(self, body: RenderBody) -> None:
        """The server's checks of a render body (limits, one way of naming the reference): ApiError if not."""

    async def reference(self, body: RenderBody) -> UploadedReference | None:
        """The uploaded reference `body` names by id (None without one)."""

    async def upload(self, body: RenderBody, images: Sequence[bytes], layout: str) -> UploadedReference:
        """`images` stored as uploads, read together as `layout`, for rendering `body`."""

    async def render(self, body: RenderBody, reference: UploadedReference | None, started: float) -> RenderReply:
        """`body` rendered with `reference`; `started` is when the request arrived."""


class OpenAIImages:
    """The two OpenAI image routes: the request read and translated here, rendered through `port`."""

    def __init__(self, port: RenderPort, auth: BearerAuth, bodies: BodyReceiver, limits: ServeLimits) -> None:
        self._port = port
        self._auth = auth
        self._bodies = bodies
        self._limits = limits

    async def generations(self, request: Request) -> Response:
        """POST /v1/images/generations: a prompt, with an uploaded reference by id or none."""
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
            body = render_body(req, self._limits, references)
            output = output_options(req)
            if req.model is not None:
                check_model(req.model, await self._port.model_id())
            self._port.check(body)
            reference = await self._port.reference(body)
            reply = await self._port.render(body, reference, started)
            return await _answer(reply, reference, output)
        except ApiError as e:
            raise renamed(e, OPENAI_NAMES) from None

    async def edits(self, request: Request) -> Response:
        """POST /v1/images/edits: the uploaded image file(s) are the reference."""
        started = time.perf_counter()
        try:
            self._auth.check(request.headers.get("authorization"))
            content_type = request.headers.get("content-type", "")
            require_media_type(content_type, "multipart/form-data", "/v1/images/edits")
            images, texts = await self._read_edit_form(request, content_type)
            req = _validated(ImageEditRequest, form_values(texts))
            body = render_body(req, self._limits)
            output = output_options(req)
        except ApiError as e:
            raise renamed(e, OPENAI_NAMES) from None
        try:
            if req.model is not None:
                check_model(req.model, await self._port.model_id())
            layout = _layout(req, len(images))
            self._port.check(body)
            reference = await self._port.upload(body, images, layout)
            reply = await self._port.render(body, reference, started)
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
