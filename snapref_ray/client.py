"""A small client for the snapref-ray HTTP API (standard library only).

    from snapref_ray.client import SnapRefClient

    client = SnapRefClient("http://127.0.0.1:8000", token="...")   # or $SNAPREF_API_TOKEN
    ref = client.upload_reference("character.png")
    png = client.render("1girl, in a cafe", reference_id=ref, width=1024, height=1024, seed=7)
    answer = client.render("1girl, at the beach", reference_id=ref, n=4)   # JSON: images + metadata
    images = client.decode_images(answer)

Errors come back as `ApiError` with the server's status, field and message (and Retry-After for 503).

A replica lost while it held a request (its node died, it was killed or ran out of memory) shows up
as a dropped connection or as a 5xx from the front (HAProxy or Serve's proxy: plain text, never the
API's JSON error). Every call is idempotent (a render is a function of its request, an upload is
stored by content hash), so the client sends such a call again, up to `retries` times; the front
meanwhile stops routing to the lost replica. The API's own errors, 503 "at capacity" included (its
Retry-After is the caller's to honour), and timeouts are not retried. Each plain-HTTP request
also leaves in one write (head and body together), so that the front has all of it when it picks
a replica and can itself re-send it to another if that one dies reading it.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import time
import uuid
from http.client import HTTPConnection, RemoteDisconnected
from pathlib import Path
from typing import Any
from urllib.error import HTTPError, URLError
from urllib.request import HTTPHandler, Request, build_opener

from snapref_ray.serve.errors import TOKEN_ENV, ApiError


class SnapRefClient:
    """Talks to one server. `timeout` (seconds) bounds every request; `retries` is how many times a call
    that met a lost replica is sent again, `retry_wait_s` the pause before the first (doubling after)."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        token: str | None = None,
        timeout: float = 600.0,
        retries: int = 2,
        retry_wait_s: float = 0.5,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._token = token if token is not None else os.environ.get(TOKEN_ENV)
        self.timeout = timeout
        self.retries, self.retry_wait_s = retries, retry_wait_s
        self._opener = build_opener(_OneWriteHTTPHandler)

    def __repr__(self) -> str:
        return f"SnapRefClient({self.base_url!r}, token={'set' if self._token else 'none'})"

    # -- endpoints ----------------------------------------------------------------------------
    def health(self) -> dict:
        return json.loads(self._request("GET", "/v1/health")[1])

    def models(self) -> dict:
        return json.loads(self._request("GET", "/v1/models")[1])

    def upload_reference_info(
        self, image: str | os.PathLike | bytes, *, ref_caption: str | None = None, ref_megapixels: float | None = None
    ) -> dict:
        """Upload a reference (multipart); the server's answer: reference_id, content_hash, width, height, ..."""
        data = image if isinstance(image, (bytes, bytearray)) else Path(image).read_bytes()
        filename = "reference" if isinstance(image, (bytes, bytearray)) else Path(image).name
        fields = {
            k: str(v) for k, v in (("ref_caption", ref_caption), ("ref_megapixels", ref_megapixels)) if v is not None
        }
        body, content_type = _multipart(fields, "file", filename, bytes(data))
        return json.loads(self._request("POST", "/v1/references", body, {"Content-Type": content_type})[1])

    def upload_reference(self, image: str | os.PathLike | bytes, **options) -> str:
        """Upload a reference and return its id (the same image and options always give the same id)."""
        return self.upload_reference_info(image, **options)["reference_id"]

    def render(
        self,
        prompt: str,
        *,
        reference_id: str | None = None,
        left_reference_id: str | None = None,
        right_reference_id: str | None = None,
        reference_image: str | os.PathLike | bytes | None = None,
        n: int = 1,
        seed: int = 0,
        response_format: str | None = None,
        **settings: Any,
    ) -> bytes | dict:
        """Render; PNG bytes for one image (response_format png, the default for n = 1), else the parsed JSON.

        `settings` are RenderSettings fields (width, height, steps, cfg, sampler, mode, ref_weight, ...).
        """
        body: dict[str, Any] = {"prompt": prompt, "seed": seed, "n": n, **settings}
        for key, value in (
            ("reference_id", reference_id),
            ("left_reference_id", left_reference_id),
            ("right_reference_id", right_reference_id),
            ("response_format", response_format),
        ):
            if value is not None:
                body[key] = value
        if reference_image is not None:
            raw = (
                reference_image
                if isinstance(reference_image, (bytes, bytearray))
                else Path(reference_image).read_bytes()
            )
            body["reference_image"] = base64.b64encode(raw).decode("ascii")
        content_type, payload = self._request(
            "POST", "/v1/render", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        return payload if content_type.startswith("image/png") else json.loads(payload)

    @staticmethod
    def decode_images(answer: dict) -> list[bytes]:
        """The PNG files of a JSON render answer."""
        return [base64.b64decode(img["png_base64"]) for img in answer["images"]]

    # -- transport ----------------------------------------------------------------------------
    def _request(
        self, method: str, path: str, data: bytes | None = None, headers: dict[str, str] | None = None
    ) -> tuple[str, bytes]:
        headers = dict(headers or {})
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        request = Request(self.base_url + path, data=data, headers=headers, method=method)
        attempt = 0
        while True:
            try:
                return self._send(request)
            except _LostReplica as lost:
                if attempt >= self.retries:
                    raise lost.error from None
                time.sleep(self.retry_wait_s * 2**attempt)
                attempt += 1

    def _send(self, request: Request) -> tuple[str, bytes]:
        try:
            with self._opener.open(request, timeout=self.timeout) as response:
                return response.headers.get("Content-Type", ""), response.read()
        except HTTPError as e:
            error, from_the_api = _api_error(e)
            if e.code >= 500 and not from_the_api:
                raise _LostReplica(error) from None
            raise error from None
        except (ConnectionResetError, ConnectionRefusedError) as e:  # RemoteDisconnected is a reset
            raise _LostReplica(e) from None
        except URLError as e:
            if isinstance(e.reason, (ConnectionResetError, ConnectionRefusedError, RemoteDisconnected)):
                raise _LostReplica(e) from None
            raise


class _OneWriteHTTPConnection(HTTPConnection):
    """An HTTP connection that writes a request's head and body as one piece.

    http.client writes them apart. HAProxy forwards a request once it has the head, and can re-send it
    to another replica (its `retry-on`) only if it had the whole request by then. Behind HAProxy 2.6
    configured by Serve's template, with a replica that dies reading a request sent over a pooled
    connection, 4-11 of each 12 two-write requests it read were lost and 0 of 12 one-write ones
    (tests/serve/test_lost_replica_resend.py). TCP_CORK holds the head until the body follows (Linux)."""

    def request(self, method, url, body=None, headers={}, *, encode_chunked=False):  # noqa: B006 (http.client's)
        if self.sock is None:
            self.connect()
        corked = _set_cork(self.sock, True)
        try:
            super().request(method, url, body, headers, encode_chunked=encode_chunked)
        finally:
            if corked and self.sock is not None:
                _set_cork(self.sock, False)  # uncorking sends what is held


class _OneWriteHTTPHandler(HTTPHandler):
    def http_open(self, req):
        return self.do_open(_OneWriteHTTPConnection, req)


def _set_cork(sock: socket.socket, on: bool) -> bool:
    """Hold (or release) partial TCP segments; False where the platform cannot."""
    cork = getattr(socket, "TCP_CORK", None)
    if cork is None:
        return False
    try:
        sock.setsockopt(socket.IPPROTO_TCP, cork, int(on))
    except OSError:
        return False
    return True


class _LostReplica(Exception):
    """The call may be sent again: `error` is what its caller sees if it is not."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _api_error(e: HTTPError) -> tuple[ApiError, bool]:
    """The error, and whether the API wrote it (its JSON error body) rather than the front."""
    payload = e.read()
    retry = e.headers.get("Retry-After")
    try:
        err = json.loads(payload)["error"]
        field, message, from_the_api = err.get("field"), err.get("message", ""), True
    except (ValueError, KeyError, TypeError, AttributeError):
        field, message, from_the_api = None, payload.decode("utf-8", errors="replace").strip() or e.reason, False
    return ApiError(e.code, field, message, {"Retry-After": retry} if retry else None), from_the_api


def _multipart(fields: dict[str, str], file_field: str, filename: str, data: bytes) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    filename = filename.replace('"', "_").replace("\r", "_").replace("\n", "_")
    lines: list[bytes] = []
    for name, value in fields.items():
        lines += [
            f"--{boundary}".encode(),
            f'Content-Disposition: form-data; name="{name}"'.encode(),
            b"",
            value.encode("utf-8"),
        ]
    lines += [
        f"--{boundary}".encode(),
        f'Content-Disposition: form-data; name="{file_field}"; filename="{filename}"'.encode(),
        b"Content-Type: application/octet-stream",
        b"",
        data,
        f"--{boundary}--".encode(),
        b"",
    ]
    return b"\r\n".join(lines), f"multipart/form-data; boundary={boundary}"
