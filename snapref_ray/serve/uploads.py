"""Uploaded references on the ingress: reading an upload, checking it, storing it, and finding it again by id.

An upload (POST /v1/references, a render's inline `reference_image`, an OpenAI edit's image files) is
checked as every front door checks a reference (the render service's `check_reference`: it decodes, and
fits at its ref_megapixels), then put in the ReferenceStore under its content hash. A reference id names
the upload's hash and options, so its info never changes: the ingress keeps the infos it has seen, which
saves a store round trip per render. If the store has evicted the file meanwhile, the replica that needs
to encode it answers 404.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from contextlib import aclosing

from pydantic import ValidationError
from starlette.requests import Request

from snapref_ray.render_service.references import (
    ReferenceIdentity,
    ReferenceImageError,
    RefKVKey,
    check_reference,
)
from snapref_ray.serve.api import (
    FORM_OVERHEAD,
    ReferenceInfo,
    ReferenceOptions,
    RenderBody,
    decode_base64,
    echo,
    reference_id_for,
    validation_error,
)
from snapref_ray.serve.bodies import BodyReceiver
from snapref_ray.serve.config import ServeLimits
from snapref_ray.serve.errors import ApiError, non_finite_refusal
from snapref_ray.serve.forms import MultipartForm
from snapref_ray.serve.renderer import UploadedReference

_INFO_CACHE_SIZE = 100_000  # reference infos kept by an ingress (~1 kB each)
# Text fields of a multipart upload: a caption of max_prompt_chars characters is at most 4 bytes each in
# UTF-8; a number needs a few dozen.
_MEGAPIXELS_BYTES = 64


class ReferenceUploads:
    """The ingress's uploads: `store` is the ReferenceStore's handle, `call` awaits a call to it (with the
    request timeout and the overload answers of the render path)."""

    def __init__(self, limits: ServeLimits, store, call: Callable[[Awaitable], Awaitable]) -> None:
        self._limits = limits
        self._store = store
        self._call = call
        self._infos: OrderedDict[str, ReferenceInfo] = OrderedDict()

    async def read_form(self, bodies: BodyReceiver, request: Request, content_type: str):
        """The multipart upload of POST /v1/references, parsed as it streams in: (file bytes, options)."""
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
        async with aclosing(bodies.chunks(request, limits.max_upload_bytes + FORM_OVERHEAD, "file")) as chunks:
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

    async def store(self, data: bytes, options: ReferenceOptions, field: str) -> ReferenceInfo:
        """`data` checked (a 400 or 413 naming `field` otherwise) and stored; its info."""
        limits = self._limits
        if len(data) > limits.max_upload_bytes:
            raise ApiError(
                413, field, f"the image is {len(data)} bytes, more than the {limits.max_upload_bytes} accepted"
            )
        if options.ref_megapixels > limits.max_megapixels:
            raise ApiError(
                400, "ref_megapixels", f"{options.ref_megapixels} MP, more than the {limits.max_megapixels} allowed"
            )
        if len(options.ref_caption) > limits.max_prompt_chars:
            raise ApiError(
                400,
                "ref_caption",
                f"{len(options.ref_caption)} characters, more than the {limits.max_prompt_chars} allowed",
            )
        # Decoding validates the file (corrupt, empty, bomb) and gives the encoded size; off the event loop.
        checked = await asyncio.to_thread(_check_upload, data, options.ref_megapixels, field)
        info = ReferenceInfo(
            reference_id=reference_id_for(checked.content_hash, options),
            content_hash=checked.content_hash,
            width=checked.width,
            height=checked.height,
            ref_megapixels=options.ref_megapixels,
            ref_caption=options.ref_caption,
            bytes=len(data),
        )
        info = await self._call(self._store.put.remote(info, data))
        self._remember(info)
        return info

    async def reference_of_body(self, body: RenderBody) -> UploadedReference | None:
        """The reference a render body names: an inline image (stored first), a pair of ids, one id; or None."""
        if body.reference_image is not None:
            data = decode_base64(body.reference_image, "reference_image")
            options = ReferenceOptions(ref_caption=body.ref_caption, ref_megapixels=body.ref_megapixels)
            infos = [await self.store(data, options, "reference_image")]
        elif body.left_reference_id is not None:
            fields = ["left_reference_id", "right_reference_id"]
            infos = await self._describe([body.left_reference_id, body.right_reference_id], fields)
        elif body.reference_id is not None:
            infos = await self._describe([body.reference_id], ["reference_id"])
        else:
            return None
        return _reference_of(infos, "pair" if len(infos) == 2 else "single", body)

    async def contrast_reference(self, body: RenderBody) -> UploadedReference | None:
        """The identity-gap judge's other reference, named by its reference_id (None when not asked)."""
        gap = body.judge.identity_gap if body.judge is not None else None
        if gap is None or gap.contrast_reference is None:
            return None
        infos = await self._describe([gap.contrast_reference], ["judge.identity_gap.contrast_reference"])
        return _reference_of(infos, "single", body)

    async def reference_of_files(self, body: RenderBody, images: Sequence[bytes], layout: str) -> UploadedReference:
        """`images` (an OpenAI edit's files, field `image`) stored, then read together as `layout`."""
        options = ReferenceOptions(ref_caption=body.ref_caption, ref_megapixels=body.ref_megapixels)
        infos = [await self.store(data, options, "image") for data in images]
        return _reference_of(infos, layout, body)

    def _remember(self, info: ReferenceInfo) -> None:
        self._infos[info.reference_id] = info
        self._infos.move_to_end(info.reference_id)
        while len(self._infos) > _INFO_CACHE_SIZE:
            self._infos.popitem(last=False)

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
        key=RefKVKey.for_size(identity.hash, caption, megapixels, width=body.width, height=body.height),
    )


def _check_upload(data: bytes, megapixels: float, field: str):
    """The render service's check of one uploaded image (a 400 naming `field` when it is not usable)."""
    try:
        (checked,) = check_reference([data], "single", [field], None, megapixels=megapixels)
    except ReferenceImageError as e:
        raise ApiError(400, field, str(e)) from None
    return checked


def _form_number(text: str, field: str) -> float:
    """A number sent as form text: finite, and spelled as a number (not 'nan', 'inf' or 'true')."""
    try:
        value = float(text)
    except ValueError:
        raise ApiError(400, field, f"not a number: {echo(text)}") from None
    refused = non_finite_refusal(value)
    if refused:
        raise ApiError(400, field, refused)
    return value
