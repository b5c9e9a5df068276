"""The HTTP API's models and its error shape.

Request bodies derive from `RenderSettings` (the one request model), so a field over HTTP has
the name, default, bounds and validation it has in a job spec or on the command line. Every
error answers `{"error": {"field": ..., "message": ...}}` with the status that fits; `ApiError`
carries it from wherever it is raised (ingress, renderer replica) to the response.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from snapref_ray.render_service.judges.scores import Judgement
from snapref_ray.render_service.judges.spec import JudgeSpec
from snapref_ray.requests import RenderRequest, RenderSettings
from snapref_ray.serve.config import ServeLimits
from snapref_ray.serve.errors import ApiError, non_finite_refusal
from snapref_ray.validation import error_field, error_message

ResponseFormat = Literal["png", "json"]


def as_api_error(exc: BaseException) -> ApiError | None:
    """The ApiError in `exc`, also when Ray wrapped it (a RayTaskError keeps the original as `.cause`)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, ApiError):
        return cause
    return exc if isinstance(exc, ApiError) else None


# -- requests ---------------------------------------------------------------------------------
class ReferenceOptions(BaseModel):
    """What a reference's K/V depends on besides its pixels; the same fields as in RenderSettings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ref_caption: str = RenderSettings.model_fields["ref_caption"]
    ref_megapixels: float = RenderSettings.model_fields["ref_megapixels"]


class UploadJSON(ReferenceOptions):
    """POST /v1/references as JSON: the image base64-encoded (a data: URL works too)."""

    image: str = Field(..., description="The reference image file, base64 (standard alphabet) or a data: URL.")


REFERENCE_FIELDS = ("reference_id", "left_reference_id", "right_reference_id", "reference_image")


class RenderBody(RenderSettings):
    """POST /v1/render: RenderSettings + prompt, seed, n, the reference and the response format.

    Reference: `reference_id` (one character), `left_reference_id` + `right_reference_id` (two
    characters, stitched side by side), `reference_image` (base64, uploaded on the fly), or none
    (plain text-to-image). `ref_caption` / `ref_megapixels` default to what the reference was
    uploaded with; set them here to override.
    """

    prompt: str = RenderRequest.model_fields["prompt"]
    seed: int = RenderRequest.model_fields["seed"]
    n: int = Field(1, ge=1, description="Images to render with seeds seed, seed+1, ... in one batch.")
    reference_id: str | None = Field(None, description="A reference_id from POST /v1/references.")
    left_reference_id: str | None = Field(None, description="Two characters: the one drawn on the left.")
    right_reference_id: str | None = Field(None, description="Two characters: the one drawn on the right.")
    reference_image: str | None = Field(
        None, description="An inline reference, base64; stored like an upload, so repeating it hits the cache."
    )
    response_format: ResponseFormat | None = Field(
        None,
        description="png (one image, image/png) or json (base64 images + metadata). Default: the Accept"
        " header, else png for n = 1 and json for n > 1.",
    )
    judge: JudgeSpec | None = Field(
        None,
        description="Judge each image (docs/judging.md): the JSON answer gives each image's scores and verdicts;"
        " judge.identity_gap.contrast_reference is a reference_id here.",
    )

    def settings(self, **overrides) -> RenderSettings:
        """The RenderSettings part of the body (with `overrides` applied)."""
        values = self.model_dump(include=set(RenderSettings.model_fields))
        values.update(overrides)
        return RenderSettings(**values)


# -- responses --------------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    field: str | None = Field(None, description="The request field (or header) at fault; null if none in particular.")
    message: str


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ReferenceInfo(BaseModel):
    """An uploaded reference: its id and the size it is encoded at."""

    reference_id: str = Field(
        ..., description="Content hash of the image bytes and the options below: same upload, same id."
    )
    content_hash: str = Field(..., description="sha256 of the image file (the reference hash of batch-job metadata).")
    width: int = Field(..., description="Width after fitting to ref_megapixels (sides multiples of 16).")
    height: int
    ref_megapixels: float
    ref_caption: str
    bytes: int = Field(..., description="Size of the uploaded file.")


class ImageOut(BaseModel):
    seed: int
    width: int
    height: int
    png_base64: str = Field(
        ..., description="The PNG file (with A1111 `parameters` and `snapref` JSON chunks), base64."
    )
    judgement: Judgement | None = Field(None, description="Its scores and verdicts when the request set `judge`.")


class RenderResponse(BaseModel):
    """POST /v1/render answered as JSON."""

    images: list[ImageOut]
    prompt: str
    seeds: list[int]
    settings: RenderSettings = Field(..., description="The settings rendered with, defaults filled in.")
    reference_ids: list[str] = Field(default_factory=list, description="The references drawn (left first for two).")
    timings: dict[str, float] = Field(
        ...,
        description="Seconds: encode_s (0 on a cache hit), text_s, sample_s, decode_s, png_s, queue_s"
        " (waiting for the device), replica_s, total_s (in the ingress).",
    )
    batch_size: int = Field(..., description="Images in the batched forward this request rode in.")
    batched_requests: int = Field(..., description="Requests in that forward.")
    batch_id: str
    cache_hit: bool | None = Field(
        ..., description="The reference's K/V was already on the replica; null without a reference."
    )
    replica: str
    cache: dict[str, int] = Field(
        default_factory=dict, description="The replica's RefKV cache counters after this request."
    )


class ModelCard(BaseModel):
    """One entry of GET /v1/models' `data`: the shape OpenAI clients list models in (`models.list()`)."""

    id: str = Field(..., description="The name a request's `model` field may give (the `model` above).")
    object: Literal["model"] = "model"
    created: int = Field(..., description="When this server process loaded it (Unix seconds).")
    owned_by: str = "snapref-ray"


class HealthResponse(BaseModel):
    status: Literal["ok"]


class ModelsResponse(BaseModel):
    """GET /v1/models: what this server renders with (the replica's render service) and its limits."""

    model: str = Field(..., description="The DiT file (with merged LoRAs and quantisation noted).")
    adapter: dict | None = Field(..., description="The reference adapter: kind, identity, and what its file states.")
    modes: list[str] = Field(..., description="The SnapRef read modes of the adapter (none for ArcAnima).")
    loras: list[dict] = Field(default_factory=list, description="LoRAs merged into the DiT: file name and strength.")
    device: str
    dtype: str
    quantize: str = Field("none", description="'fp8' when the DiT's block linears run in float8.")
    compile: bool = False
    cold_start: dict | None = Field(
        None,
        description="This replica's cold start (render_service/cold_start.py): model_load_s, compile_s with"
        " graphs_built vs graphs_loaded from the compile cache, warmup_s and what was warmed, first_image_s.",
    )
    refkv_cache: dict = Field(default_factory=dict, description="The replica's RefKV cache: counters and bytes.")
    memory: list[dict] = Field(
        default_factory=list,
        description="The replica's memory fit per resolution: one image's peak, what each further image adds,"
        " the batch chosen (measured on the first renders at each size).",
    )
    limits: ServeLimits
    max_batch: int = Field(
        description="Images one forward of a replica batches together (the same name as in jobs and Ray Data)."
    )
    object: Literal["list"] = Field("list", description="With `data`: the list shape OpenAI clients read.")
    data: list[ModelCard] = Field(default_factory=list, description="The loaded model, as OpenAI clients list it.")


# -- identity ---------------------------------------------------------------------------------
def reference_id_for(content_hash: str, options: ReferenceOptions) -> str:
    """The public id of an upload: a hash of the file's hash and the options its K/V depends on."""
    text = f"{content_hash}\n{options.ref_megapixels!r}\n{options.ref_caption}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


# -- parsing helpers --------------------------------------------------------------------------
ECHO_CHARS = 64  # longest client-supplied text an error message repeats
FORM_OVERHEAD = 64 * 1024  # multipart headers and the small text fields next to a file


def json_body_limit(file_limit: int) -> int:
    """Largest JSON body that carries a file of `file_limit` bytes base64-encoded, with its other fields."""
    return 4 * math.ceil(file_limit / 3) + FORM_OVERHEAD  # base64 is 4 characters per 3 bytes


def require_media_type(content_type: str, expected: str, route: str) -> None:
    """A 415 naming the route unless the request's Content-Type (parameters aside) is `expected`."""
    if content_type.partition(";")[0].strip().lower() != expected:
        raise ApiError(415, "Content-Type", f"{route} takes {expected}, got {echo(content_type)}")


def echo(text: str) -> str:
    """`text` as an error message repeats it: quoted, at most ECHO_CHARS characters."""
    return repr(text[:ECHO_CHARS]) + ("..." if len(text) > ECHO_CHARS else "")


class _NonFinite(float):
    """NaN / Infinity / -Infinity as JSON spells them, kept apart from numbers by the parser."""

    def __new__(cls, token: str) -> _NonFinite:
        value = super().__new__(cls, token.replace("Infinity", "inf"))
        value.token = token
        return value


def parse_json_object(raw: bytes, known_fields: set[str]) -> dict:
    """A JSON body as a dict, with exact types: NaN and Infinity (either spelling) are refused naming the
    field, and so is any other number too large for a float (1e999)."""
    try:
        value = json.loads(raw, parse_constant=_NonFinite)
    except UnicodeDecodeError as e:
        raise ApiError(400, "body", f"the body is not UTF-8 JSON (byte {e.start})") from None
    except (json.JSONDecodeError, RecursionError) as e:
        raise ApiError(400, "body", f"Invalid JSON: {str(e)[:120]}") from None
    if not isinstance(value, dict):
        raise ApiError(400, "body", f"expected a JSON object, got {type(value).__name__}")
    for key, item in value.items():
        if isinstance(item, float) and not math.isfinite(item):
            token = getattr(item, "token", "Infinity" if item > 0 else "-Infinity") if not math.isnan(item) else "NaN"
            field = key if key in known_fields else key[:ECHO_CHARS]
            raise ApiError(400, field, non_finite_refusal(item, token, why=" (NaN and Infinity are refused)"))
    return value


def validate_strict(model: type[BaseModel], raw: bytes, limits: ServeLimits | None = None):
    """`model` from a JSON body, strictly typed: booleans are not numbers, numbers are not booleans,
    strings are not numbers (pydantic's strict mode), with NaN/Infinity refused first. With `limits`, the
    bounds a message states are this server's (`validation_context`)."""
    fields = set(model.model_fields)
    data = parse_json_object(raw, fields)
    try:
        return model.model_validate(data, strict=True, context=validation_context(limits))
    except ValidationError as e:
        raise validation_error(e, fields, model) from None


def validation_context(limits: ServeLimits | None) -> dict | None:
    """What the request model's validators read to check against this server's caps instead of the model's
    own (a width error then says "between 256 and 2048" on a server capped at 2048, not 4096)."""
    return {"max_side": limits.max_side} if limits is not None else None


def validation_error(exc: ValidationError, known_fields: set[str] | None = None, model=None) -> ApiError:
    """A pydantic error as a 400 naming the first field at fault (all of them in the message)."""
    messages, first_field = [], None
    for err in exc.errors():
        # No location: a model-level check (it names its field: validation.field_error) or unparsable JSON (the body).
        field = error_field(err) or "body"
        if known_fields is not None and field not in known_fields and field != "body":
            field = field[:ECHO_CHARS]  # an unknown key: repeat at most ECHO_CHARS of it
        msg = non_finite_refusal(err.get("input")) or error_message(err, model, echo_limit=ECHO_CHARS)
        messages.append(f"{field}: {msg}" if field else msg)
        first_field = first_field or field
    extra = f" (and {len(messages) - 3} more)" if len(messages) > 3 else ""
    return ApiError(400, first_field, "; ".join(messages[:3]) + extra)


def decode_base64(text: str, field: str) -> bytes:
    if text.startswith("data:"):
        text = text.partition(",")[2]
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ApiError(400, field, f"not valid base64 ({e})") from None


def check_limits(body: RenderBody, limits: ServeLimits) -> None:
    """The server's bounds (tighter than the request model's); a 400 naming the field otherwise."""
    for field in ("prompt", "negative_prompt", "ref_caption"):
        length = len(getattr(body, field))
        if length > limits.max_prompt_chars:
            raise ApiError(400, field, f"{length} characters, more than the {limits.max_prompt_chars} allowed")
    if body.steps > limits.max_steps:
        raise ApiError(400, "steps", f"{body.steps} steps, more than the {limits.max_steps} allowed on this server")
    if body.n > limits.max_n:
        raise ApiError(400, "n", f"{body.n} images, more than the {limits.max_n} allowed per request")
    for field in ("width", "height"):
        if getattr(body, field) > limits.max_side:
            raise ApiError(
                400, field, f"{getattr(body, field)} px, more than the {limits.max_side} allowed on this server"
            )
    megapixels = body.width * body.height / 1e6
    if megapixels > limits.max_megapixels:
        raise ApiError(
            400,
            "width",
            f"{body.width}x{body.height} is {megapixels:.2f} MP, more than the {limits.max_megapixels} MP allowed",
        )
    if body.ref_megapixels > limits.max_megapixels:
        raise ApiError(
            400, "ref_megapixels", f"{body.ref_megapixels} MP, more than the {limits.max_megapixels} allowed"
        )
    if body.denoise < 1.0:
        raise ApiError(400, "denoise", "img2img (denoise < 1) is not served over HTTP; use 1")


def check_reference_fields(body: RenderBody) -> None:
    """At most one way of naming the reference; left and right come together."""
    given = [f for f in REFERENCE_FIELDS if getattr(body, f) is not None]
    pair = {"left_reference_id", "right_reference_id"}
    if len(pair & set(given)) == 1:
        missing = (pair - set(given)).pop()
        raise ApiError(400, missing, "two characters need both left_reference_id and right_reference_id")
    kinds = {"pair" if f in pair else f for f in given}
    if len(kinds) > 1:
        raise ApiError(
            400,
            given[-1],
            f"give only one of reference_id, left/right_reference_id, reference_image (got {', '.join(given)})",
        )
