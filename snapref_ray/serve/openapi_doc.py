"""The API's OpenAPI document and its docs page.

FastAPI writes the document from the routes; what it cannot see is added here: the request bodies the
routes read themselves (a multipart upload, a JSON render body, the OpenAI routes with the adapter's
settings as extra fields) and, when the server has a token, the bearer scheme on every operation that
checks it. The ingress serves both at /openapi.json and /docs itself, so they can require the token.
"""

from __future__ import annotations

import copy
import json

from fastapi import FastAPI

from snapref_ray.requests import RenderSettings
from snapref_ray.serve.api import ReferenceOptions, RenderBody, UploadJSON
from snapref_ray.serve.openai_images import (
    ADAPTER_FIELDS,
    MAX_REFERENCE_IMAGES,
    ImageEditRequest,
    ImageGenerationRequest,
)

_BEARER = "bearerAuth"
_SWAGGER_JS = "https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"
_SWAGGER_CSS = "https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css"


def upload_body() -> dict:
    """POST /v1/references: a multipart file with its options, or JSON with the image base64."""
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


def render_body() -> dict:
    """POST /v1/render: the JSON render body."""
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": RenderBody.model_json_schema()}}}
    }


def generation_body() -> dict:
    """POST /v1/images/generations: OpenAI's JSON body with the adapter's settings."""
    schema = _with_settings(ImageGenerationRequest.model_json_schema())
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def edit_body() -> dict:
    """POST /v1/images/edits: OpenAI's multipart body, the image file(s) being the reference."""
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


def openapi_document(app: FastAPI, bearer: bool) -> dict:
    """FastAPI's document of `app`, plus the bearer scheme on every operation that checks the token."""
    spec = copy.deepcopy(app.openapi())
    if bearer:
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
    return spec


def docs_page(spec: dict) -> str:
    """Swagger UI over `spec`, inlined: with a token configured the browser could not fetch /openapi.json itself."""
    inlined = json.dumps(spec).replace("</", "<\\/")
    return f"""<!doctype html><html><head><title>snapref-ray API</title>
<link rel="stylesheet" href="{_SWAGGER_CSS}"></head><body><div id="swagger-ui"></div>
<script src="{_SWAGGER_JS}"></script>
<script>SwaggerUIBundle({{spec: {inlined}, dom_id: "#swagger-ui", persistAuthorization: true}});</script>
</body></html>"""


def _with_settings(schema: dict) -> dict:
    """`schema` with the adapter's settings listed (they are accepted as extra fields under their own names)."""
    settings = RenderSettings.model_json_schema()
    properties = {**schema["properties"], **{n: settings["properties"][n] for n in ADAPTER_FIELDS}}
    defs = {**schema.get("$defs", {}), **settings.get("$defs", {})}
    return {**schema, "properties": properties, **({"$defs": defs} if defs else {})}
