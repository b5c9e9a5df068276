"""A small client for the snapref-ray HTTP API (standard library only).

    from snapref_ray.client import SnapRefClient

    client = SnapRefClient("http://127.0.0.1:8000", token="...")   # or $SNAPREF_API_TOKEN
    ref = client.upload_reference("character.png")
    png = client.render("1girl, in a cafe", reference_id=ref, width=1024, height=1024, seed=7)
    answer = client.render("1girl, at the beach", reference_id=ref, n=4)   # JSON: images + metadata
    images = client.decode_images(answer)

Errors come back as `ApiError` with the server's status, field and message (and Retry-After for 503).
"""

from __future__ import annotations

import base64
import json
import os
import uuid
from pathlib import Path
from typing import Any
from urllib.error import HTTPError
from urllib.request import Request, urlopen

TOKEN_ENV = "SNAPREF_API_TOKEN"


class ApiError(Exception):
    """A non-2xx answer: `status`, `field` (may be None), `message`, `retry_after` seconds (503)."""

    def __init__(self, status: int, field: str | None, message: str, retry_after: float | None = None) -> None:
        super().__init__(f"HTTP {status}" + (f" {field}" if field else "") + f": {message}")
        self.status, self.field, self.message, self.retry_after = status, field, message, retry_after


class SnapRefClient:
    """Talks to one server. `timeout` (seconds) bounds every request."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", token: str | None = None, timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._token = token if token is not None else os.environ.get(TOKEN_ENV)
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"SnapRefClient({self.base_url!r}, token={'set' if self._token else 'none'})"

    # -- endpoints ----------------------------------------------------------------------------
    def health(self) -> dict:
        return json.loads(self._request("GET", "/v1/health")[1])

    def models(self) -> dict:
        return json.loads(self._request("GET", "/v1/models")[1])

    def upload_reference_info(self, image: str | os.PathLike | bytes, *, ref_caption: str | None = None,
                              ref_megapixels: float | None = None) -> dict:
        """Upload a reference (multipart); the server's answer: reference_id, content_hash, width, height, ..."""
        data = image if isinstance(image, (bytes, bytearray)) else Path(image).read_bytes()
        filename = "reference" if isinstance(image, (bytes, bytearray)) else Path(image).name
        fields = {k: str(v) for k, v in (("ref_caption", ref_caption), ("ref_megapixels", ref_megapixels)) if v is not None}
        body, content_type = _multipart(fields, "file", filename, bytes(data))
        return json.loads(self._request("POST", "/v1/references", body, {"Content-Type": content_type})[1])

    def upload_reference(self, image: str | os.PathLike | bytes, **options) -> str:
        """Upload a reference and return its id (the same image and options always give the same id)."""
        return self.upload_reference_info(image, **options)["reference_id"]

    def render(self, prompt: str, *, reference_id: str | None = None, left_reference_id: str | None = None,
               right_reference_id: str | None = None, reference_image: str | os.PathLike | bytes | None = None,
               n: int = 1, seed: int = 0, response_format: str | None = None, **settings: Any) -> bytes | dict:
        """Render; PNG bytes for one image (response_format png, the default for n = 1), else the parsed JSON.

        `settings` are RenderSettings fields (width, height, steps, cfg, sampler, mode, ref_weight, ...).
        """
        body: dict[str, Any] = {"prompt": prompt, "seed": seed, "n": n, **settings}
        for key, value in (("reference_id", reference_id), ("left_reference_id", left_reference_id),
                           ("right_reference_id", right_reference_id), ("response_format", response_format)):
            if value is not None:
                body[key] = value
        if reference_image is not None:
            raw = reference_image if isinstance(reference_image, (bytes, bytearray)) else Path(reference_image).read_bytes()
            body["reference_image"] = base64.b64encode(raw).decode("ascii")
        content_type, payload = self._request("POST", "/v1/render", json.dumps(body).encode(),
                                              {"Content-Type": "application/json"})
        return payload if content_type.startswith("image/png") else json.loads(payload)

    @staticmethod
    def decode_images(answer: dict) -> list[bytes]:
        """The PNG files of a JSON render answer."""
        return [base64.b64decode(img["png_base64"]) for img in answer["images"]]

    # -- transport ----------------------------------------------------------------------------
    def _request(self, method: str, path: str, data: bytes | None = None,
                 headers: dict[str, str] | None = None) -> tuple[str, bytes]:
        headers = dict(headers or {})
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        request = Request(self.base_url + path, data=data, headers=headers, method=method)
        try:
            with urlopen(request, timeout=self.timeout) as response:
                return response.headers.get("Content-Type", ""), response.read()
        except HTTPError as e:
            raise _api_error(e) from None


def _api_error(e: HTTPError) -> ApiError:
    payload = e.read()
    retry = e.headers.get("Retry-After")
    try:
        err = json.loads(payload)["error"]
        field, message = err.get("field"), err.get("message", "")
    except (ValueError, KeyError, TypeError):
        field, message = None, payload.decode("utf-8", errors="replace").strip() or e.reason
    return ApiError(e.code, field, message, float(retry) if retry else None)


def _multipart(fields: dict[str, str], file_field: str, filename: str, data: bytes) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    filename = filename.replace('"', "_").replace("\r", "_").replace("\n", "_")
    lines: list[bytes] = []
    for name, value in fields.items():
        lines += [f"--{boundary}".encode(), f'Content-Disposition: form-data; name="{name}"'.encode(), b"",
                  value.encode("utf-8")]
    lines += [f"--{boundary}".encode(),
              f'Content-Disposition: form-data; name="{file_field}"; filename="{filename}"'.encode(),
              b"Content-Type: application/octet-stream", b"", data, f"--{boundary}--".encode(), b""]
    return b"\r\n".join(lines), f"multipart/form-data; boundary={boundary}"
