"""OpenAI's images API as this endpoint reads it: request and response models, and the translation of a
request into the `RenderBody` that POST /v1/render takes.

One path renders both APIs: a `/v1/images/generations` or `/v1/images/edits` request becomes the same
`RenderBody` (and the same `RenderCall`) as the `/v1/render` request with the same prompt, seed, size and
settings, so their pixels agree by construction. Field names are OpenAI's (`prompt`, `n`, `size`,
`response_format`, `model`, `user`, `output_format`, ...) plus the extensions SGLang Diffusion and vLLM-Omni
take for Anima (`seed`, `num_inference_steps`, `guidance_scale`, `negative_prompt`, `generator_device`),
plus the adapter's settings under their own names (`mode`, `ref_weight`, `ref_guidance`, `step_cache`, ...).
A field is honoured where it means something here and refused, naming it, only where a value cannot be.
"""

from __future__ import annotations

import difflib
import io
import json
import re
import secrets
import time
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from snapref_ray.requests import RenderSettings, StepCache
from snapref_ray.serve.api import (
    ECHO_CHARS,
    REFERENCE_FIELDS,
    ModelCard,
    RenderBody,
    echo,
    validation_context,
    validation_error,
)
from snapref_ray.serve.config import ServeLimits
from snapref_ray.serve.errors import ApiError, non_finite_refusal
from snapref_ray.serve.openai_errors import ClientFieldError, renamed

# RenderBody fields these routes take under another name. width and height are both parts of `size`.
OPENAI_NAMES = {"width": "size", "height": "size", "steps": "num_inference_steps", "cfg": "guidance_scale"}
# Fields the routes name (OpenAI's clients send them) but refuse whatever the value: never a suggestion.
_ALWAYS_REFUSED = {"style", "input_fidelity"}
# RenderSettings fields not served here: img2img is not served over HTTP, the baseline is a benchmark.
_NOT_SERVED = {"denoise", "recompute_reference_every_step"}
# The adapter's settings, passed through under their own names.
ADAPTER_FIELDS = tuple(
    name for name in RenderSettings.model_fields if name not in OPENAI_NAMES and name not in _NOT_SERVED
)
# Several images of one character are read together: each adds its tokens to every step's attention, so a
# bound keeps one request's cost near a single reference's.
MAX_REFERENCE_IMAGES = 4
# What `url` would need: somewhere durable that a client can fetch rendered images from. ServeConfig has no
# such place (`references_uri` holds uploaded references, not outputs), so images come back inline.
_NO_URL = (
    "response_format 'url' needs durable storage for rendered images, and this server has none configured"
    " (references_uri keeps uploaded references only); use response_format 'b64_json'"
)


# -- requests ---------------------------------------------------------------------------------
class ImageRequestFields(BaseModel):
    """What both routes take besides the reference: OpenAI's fields and the SGLang / vLLM-Omni extensions.
    Unknown fields are kept aside (`model_extra`) and must be the adapter's settings (`ADAPTER_FIELDS`)."""

    model_config = ConfigDict(extra="allow")

    prompt: str = Field(..., description="The scene prompt (Anima is tag-prompted); the reference says who is drawn.")
    model: str | None = Field(None, description="The `id` GET /v1/models lists; another name is refused.")
    n: int = Field(1, description="Images with consecutive seeds seed, seed+1, ... in one batch (limits.max_n).")
    size: str | None = Field(
        None,
        description="WIDTHxHEIGHT in pixels, each a multiple of 16 within the server's limits (max_side,"
        " max_megapixels); 'auto' or unset: 1024x1024.",
    )
    response_format: Literal["b64_json", "url"] | None = Field(
        None, description="b64_json (the default). url needs durable storage for rendered images: refused here."
    )
    output_format: Literal["png", "webp", "jpeg", "jpg"] | None = Field(
        None, description="png (default; with A1111 `parameters` and `snapref` chunks), webp or jpeg."
    )
    output_compression: int | None = Field(
        None, ge=0, le=100, description="Quality of a jpeg or webp image, 0-100 (default 100)."
    )
    quality: str | None = Field(None, description="'auto' or 'standard' only: quality follows num_inference_steps.")
    background: str | None = Field(None, description="'auto' or 'opaque': images are rendered opaque.")
    moderation: str | None = Field(None, description="'auto' or 'low': this server does not moderate.")
    style: str | None = Field(None, description="A DALL-E 3 setting without a counterpart here: refused.")
    user: str | None = Field(None, description="Accepted and ignored.")
    safety_identifier: str | None = Field(None, description="Accepted and ignored.")
    stream: bool | None = Field(None, description="Streaming is not served: false or unset.")
    partial_images: int | None = Field(None, description="Streaming is not served: 0 or unset.")
    seed: int | None = Field(
        None,
        description="Noise seed (SGLang / vLLM-Omni extension); image i has seed + i. Unset: a random seed,"
        " which each item of the answer reports.",
    )
    num_inference_steps: int | None = Field(None, description="Sampling steps (RenderSettings.steps, default 30).")
    guidance_scale: float | None = Field(None, description="Text CFG scale (RenderSettings.cfg, default 4.5).")
    negative_prompt: str | None = Field(None, description="Negative prompt; empty by default.")
    generator_device: str | None = Field(
        None, description="'cpu' or unset: the noise is drawn by a CPU generator (ComfyUI-compatible seeds)."
    )

    def adapter_settings(self) -> dict[str, Any]:
        """The extra fields, each the name of one of the adapter's settings (400 naming it otherwise)."""
        extras = dict(self.model_extra or {})
        for name in extras:
            if name in ADAPTER_FIELDS:
                continue
            if name in OPENAI_NAMES:
                raise ClientFieldError(400, name, f"{name}: this route takes it as {OPENAI_NAMES[name]!r}")
            suggestions = self._suggestions()
            close = difflib.get_close_matches(name, suggestions, n=1)
            hint = f" (did you mean {suggestions[close[0]]!r}?)" if close else ""
            raise ClientFieldError(400, name[:ECHO_CHARS], f"{echo(name)}: unknown field{hint}")
        return extras

    @classmethod
    def _suggestions(cls) -> dict[str, str]:
        """What a mistyped field may be close to, and the name to suggest: the fields this route accepts (not
        those it refuses whatever the value), and /v1/render's names of them (`steps` suggests
        `num_inference_steps`)."""
        accepted = [n for n in [*cls.model_fields, *ADAPTER_FIELDS] if n not in _ALWAYS_REFUSED]
        return {**{n: n for n in accepted}, **OPENAI_NAMES}


class ImageGenerationRequest(ImageRequestFields):
    """POST /v1/images/generations (JSON). A reference, if any, is one uploaded to /v1/references."""

    reference_id: str | None = Field(None, description="A reference_id from POST /v1/references.")
    left_reference_id: str | None = Field(None, description="Two characters: the one drawn on the left.")
    right_reference_id: str | None = Field(None, description="Two characters: the one drawn on the right.")


class ImageEditRequest(ImageRequestFields):
    """POST /v1/images/edits (multipart): the text fields; the image files are the reference."""

    reference_layout: Literal["multi", "pair"] | None = Field(
        None,
        description="How several images are read: 'multi' (the default), several images of one character;"
        " 'pair', two characters, the first drawn on the left. One image is one character.",
    )
    input_fidelity: str | None = Field(
        None, description="Refused: how closely the reference is followed is ref_weight (and ref_guidance)."
    )

    def adapter_settings(self) -> dict[str, Any]:
        for name in REFERENCE_FIELDS:
            if name in (self.model_extra or {}):
                raise ApiError(
                    400,
                    name,
                    "an edit's reference is its image file(s); to render with an uploaded reference by id,"
                    " use /v1/images/generations",
                )
        return super().adapter_settings()


class OutputOptions(BaseModel):
    """How rendered PNGs are handed back: the file format and, for lossy ones, the quality."""

    format: Literal["png", "webp", "jpeg"] = "png"
    quality: int = 100


# -- translation ------------------------------------------------------------------------------
def render_body(
    request: ImageRequestFields, limits: ServeLimits | None = None, references: dict[str, str] | None = None
) -> RenderBody:
    """The /v1/render body of `request`: the same render, field by field. `references` are the reference
    fields (reference_id, ...) it carries; a seed is drawn when the request sets none. With `limits`, a
    message states this server's bounds."""
    _refuse_unhonourable(request)
    values: dict[str, Any] = {
        "prompt": request.prompt,
        "n": request.n,
        "seed": request.seed if request.seed is not None else secrets.randbelow(2**32),
        "response_format": "json",
        **request.adapter_settings(),
        **(references or {}),
    }
    values.update(_size(request.size))
    for ours, theirs in (("steps", "num_inference_steps"), ("cfg", "guidance_scale"), ("negative_prompt", None)):
        value = getattr(request, theirs or ours)
        if value is not None:
            values[ours] = value
    try:
        return RenderBody.model_validate(values, strict=True, context=validation_context(limits))
    except ValidationError as e:
        raise renamed(validation_error(e, set(RenderBody.model_fields), RenderBody), OPENAI_NAMES) from None


def output_options(request: ImageRequestFields) -> OutputOptions:
    fmt = {"jpg": "jpeg"}.get(request.output_format or "png", request.output_format or "png")
    if request.output_compression is not None and fmt == "png":
        raise ApiError(
            400, "output_compression", "applies to jpeg and webp; png is lossless (set output_format to use it)"
        )
    return OutputOptions(format=fmt, quality=100 if request.output_compression is None else request.output_compression)


def check_model(requested: str | None, served: str) -> None:
    """A request may name the model; only the one this server loaded (as GET /v1/models lists it) renders."""
    if requested is not None and requested != served:
        raise ApiError(400, "model", f"this server renders {served!r} (GET /v1/models), not {echo(requested)}")


def model_cards(info: dict, created: int) -> list[ModelCard]:
    """GET /v1/models' `data`: the loaded model as OpenAI clients list it."""
    return [ModelCard(id=info["model"], created=created)]


_SIZE = re.compile(r"(\d{1,5})x(\d{1,5})")


def _size(size: str | None) -> dict[str, int]:
    if size is None or size == "auto":
        return {}
    match = _SIZE.fullmatch(size.strip().lower())
    if match is None:
        raise ApiError(400, "size", f"expected WIDTHxHEIGHT in pixels (such as 1024x1024) or 'auto', got {echo(size)}")
    return {"width": int(match[1]), "height": int(match[2])}


def _refuse_unhonourable(request: ImageRequestFields) -> None:
    """Fields whose value this server cannot honour: a 400 naming the field and what it would take."""
    if request.response_format == "url":
        raise ApiError(400, "response_format", _NO_URL)
    accepted = {
        "quality": ({"auto", "standard"}, "image quality here follows num_inference_steps and guidance_scale"),
        "background": ({"auto", "opaque"}, "images are rendered opaque"),
        "moderation": ({"auto", "low"}, "this server does not moderate"),
        "generator_device": (
            {"cpu"},
            "the noise is drawn by a CPU generator here (ComfyUI-compatible seeds), whichever device renders",
        ),
    }
    for field, (values, why) in accepted.items():
        value = getattr(request, field)
        if value is not None and value not in values:
            accepted_values = ", ".join(sorted(values))
            raise ApiError(400, field, f"{echo(value)} cannot be honoured: {why} (accepted: {accepted_values})")
    if request.style is not None:
        raise ApiError(400, "style", "a DALL-E 3 setting without a counterpart here; leave it unset")
    if request.stream:
        raise ApiError(400, "stream", "streaming is not served; images come back whole")
    if request.partial_images:
        raise ApiError(400, "partial_images", "streaming is not served; leave partial_images unset or 0")
    if isinstance(request, ImageEditRequest) and request.input_fidelity is not None:
        raise ApiError(
            400, "input_fidelity", "not served: how closely the reference is followed is ref_weight (and ref_guidance)"
        )


# -- multipart text fields --------------------------------------------------------------------
def _is_text(annotation: Any) -> bool:
    """Whether a field's values are only strings (so a form's text is the value itself, not JSON)."""
    if annotation is str:
        return True
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return all(isinstance(a, str) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return all(a is type(None) or _is_text(a) for a in typing.get_args(annotation))
    return False


_TEXT_FIELDS = {
    name
    for fields in (ImageEditRequest.model_fields, RenderSettings.model_fields)
    for name, info in fields.items()
    if _is_text(info.annotation)
}
_NESTED = re.compile(r"([a-z_]+)\[([a-z_]+)\]")  # how the OpenAI SDK sends a dict: step_cache[threshold]


def edit_field_names() -> list[str]:
    """Every text part an edit may carry (the SDK sends a dict setting as `name[key]` parts)."""
    # The reference fields only to be refused by name: an edit's reference is its image.
    names = [*ImageEditRequest.model_fields, *ADAPTER_FIELDS, *REFERENCE_FIELDS]
    return names + [f"step_cache[{key}]" for key in StepCache.model_fields]


def form_values(texts: dict[str, str]) -> dict[str, Any]:
    """Multipart text fields as typed values: text for string fields, JSON for the others (`2`, `4.5`,
    `true`, `{"threshold": 0.3}`); text that is not JSON stays text, for validation to name the field."""
    values: dict[str, Any] = {}
    for name, text in texts.items():
        nested = _NESTED.fullmatch(name)
        field = nested[1] if nested else name
        value: Any = text if field in _TEXT_FIELDS and not nested else _json_value(text, name)
        if nested:
            container = values.setdefault(field, {})
            if not isinstance(container, dict):
                raise ApiError(400, field, f"sent both as {field!r} and as {name!r}")
            container[nested[2]] = value
        else:
            if isinstance(values.get(field), dict):
                raise ApiError(400, field, f"sent both as {field!r} and as {field}[...]")
            values[field] = value
    return values


def _json_value(text: str, name: str) -> Any:
    def refuse(token: str):
        raise ApiError(400, name, non_finite_refusal(float(token), token))

    try:
        value = json.loads(text, parse_constant=refuse)
    except ValueError:
        return text
    refused = non_finite_refusal(value, "Infinity")  # 1e999 (NaN and Infinity spelled out were refused above)
    if refused:
        raise ApiError(400, name, refused)
    return value


# -- responses --------------------------------------------------------------------------------
class ImageData(BaseModel):
    """One image of the answer, with the facts a client needs to render it again."""

    b64_json: str = Field(..., description="The image file, base64 (output_format; png carries metadata chunks).")
    seed: int = Field(..., description="The seed this image was rendered with.")
    settings: RenderSettings = Field(..., description="The settings rendered with, defaults filled in.")


class RenderFacts(BaseModel):
    """What /v1/render's JSON answer reports besides the images: how the request was rendered."""

    reference_ids: list[str] = Field(default_factory=list, description="The references drawn (left first for two).")
    cache_hit: bool | None = Field(..., description="The reference's K/V was already on the replica; null without.")
    cache: dict[str, int] = Field(default_factory=dict, description="The replica's RefKV cache counters after it.")
    timings: dict[str, float]
    batch_size: int
    batched_requests: int
    batch_id: str
    replica: str


class ImagesResponse(BaseModel):
    """The answer of both routes, in OpenAI's shape (`created`, `data[].b64_json`) plus SnapRef's facts."""

    created: int = Field(..., description="Unix seconds.")
    data: list[ImageData]
    output_format: Literal["png", "webp", "jpeg"]
    size: str = Field(..., description="WIDTHxHEIGHT as rendered.")
    snapref: RenderFacts


def images_response(reply, reference_ids: list[str], images: list[str], output: OutputOptions) -> ImagesResponse:
    """The answer for a renderer's `reply` whose images, encoded as `output` asks, are `images` (base64)."""
    settings = reply.settings
    return ImagesResponse(
        created=int(time.time()),
        data=[ImageData(b64_json=b64, seed=seed, settings=settings) for b64, seed in zip(images, reply.seeds)],
        output_format=output.format,
        size=f"{settings.width}x{settings.height}",
        snapref=RenderFacts(
            reference_ids=reference_ids,
            cache_hit=reply.cache_hit,
            cache=reply.cache,
            timings=reply.timings,
            batch_size=reply.batch_size,
            batched_requests=reply.batched_requests,
            batch_id=reply.batch_id,
            replica=reply.replica,
        ),
    )


def encode_image(png: bytes, output: OutputOptions) -> bytes:
    """A rendered PNG as `output` asks: itself for png, else re-encoded (CPU work: call off the event loop)."""
    if output.format == "png":
        return png
    from PIL import Image

    with Image.open(io.BytesIO(png)) as img:
        buf = io.BytesIO()
        img.convert("RGB").save(buf, output.format.upper(), quality=output.quality)
    return buf.getvalue()
