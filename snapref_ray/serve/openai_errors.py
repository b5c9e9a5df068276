"""Errors of the OpenAI-compatible routes, in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

The routes under `/v1/images/` answer what OpenAI clients parse (the `openai` SDK raises `BadRequestError`,
`AuthenticationError`, ... from the status and reads `param` and `message` from this body); every other
route keeps the API's own `{"error": {"field", "message"}}`. Both come from one `ApiError`: the same
status, limits, auth and Retry-After, only the body differs. `param` is the request field at fault in the
names these routes take (`size`, not `width`).
"""

from __future__ import annotations

from pydantic import BaseModel, Field
from starlette.requests import Request
from starlette.responses import JSONResponse

from snapref_ray.serve.errors import ApiError

OPENAI_PREFIX = "/v1/images/"

# OpenAI's error types, by status (its clients branch on the status; the type is for people and logs).
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_overloaded_error",
    504: "timeout_error",
}
# A machine-readable code per status: what a client may switch on without parsing the message.
_CODES = {
    400: "invalid_value",
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    408: "body_timeout",
    413: "payload_too_large",
    415: "unsupported_media_type",
    429: "rate_limit_exceeded",
    500: "internal_error",
    503: "overloaded",
    504: "render_timeout",
}


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str = Field(..., description="invalid_request_error, authentication_error, server_overloaded_error, ...")
    param: str | None = Field(None, description="The request field (or header) at fault; null if none in particular.")
    code: str | None = Field(None, description="A short machine-readable reason (invalid_value, invalid_api_key, ...).")


class OpenAIErrorResponse(BaseModel):
    error: OpenAIErrorDetail


def is_openai_route(path: str) -> bool:
    """Whether a request's path is one whose errors answer in OpenAI's shape."""
    return path.startswith(OPENAI_PREFIX)


def openai_error_body(error: ApiError) -> dict:
    """`error` as OpenAI's error body."""
    return OpenAIErrorResponse(
        error=OpenAIErrorDetail(
            message=error.message,
            type=_TYPES.get(error.status, "server_error" if error.status >= 500 else "invalid_request_error"),
            param=error.field,
            code=_CODES.get(error.status),
        )
    ).model_dump()


def error_response(request: Request, error: ApiError) -> JSONResponse:
    """`error` in the shape of the route it answers: OpenAI's on its routes, the API's own elsewhere."""
    body = openai_error_body(error) if is_openai_route(request.url.path) else error.body()
    return JSONResponse(body, status_code=error.status, headers=error.headers or None)


class ClientFieldError(ApiError):
    """An error whose field is already named as the client sent it (an unknown extra field, say `steps` sent
    where the route takes `num_inference_steps`): `renamed` leaves it as it is."""


def renamed(error: ApiError, names: dict[str, str]) -> ApiError:
    """`error` with its field under the name the client sent it as (`steps` -> `num_inference_steps`). A field
    that is one part of what the client sent (`width` of `size`) is named in the message as `size (width)`."""
    if isinstance(error, ClientFieldError):
        return error
    client = names.get(error.field or "")
    if client is None:
        return error
    internal = error.field
    label = f"{client} ({internal})" if list(names.values()).count(client) > 1 else client
    message = error.message
    for lead in (f"{internal}: ", f"{internal} "):
        if message.startswith(lead):
            message = message[len(lead) :]
            break
    return ApiError(error.status, client, f"{label}: {message}", error.headers)
