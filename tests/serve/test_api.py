"""The HTTP API end to end: a real local Serve on 127.0.0.1 with the tiny models, real HTTP.

The module's application on the session's local Serve (tests/conftest.py); parsing helpers are
tested without it.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.error import HTTPError
from urllib.request import Request, urlopen

import pytest
from PIL import Image

from snapref_ray.client import ApiError as ClientError
from snapref_ray.client import SnapRefClient, _multipart
from snapref_ray.serve.api import (
    ApiError,
    ReferenceInfo,
    ReferenceOptions,
    RenderBody,
    check_limits,
    check_reference_fields,
    reference_id_for,
    validation_error,
)
from snapref_ray.serve.config import ServeConfig, ServeLimits
from snapref_ray.serve.forms import MultipartForm
from snapref_ray.serve.references import ReferenceLRU
from snapref_ray.storage.image_files import read_image_info

TOKEN = "test-token-5f2c"
TIMEOUT = 120  # seconds, every HTTP call
SMALL = {"width": 256, "height": 256, "steps": 2}
LIMITS = ServeLimits(max_upload_bytes=200_000, max_steps=8, max_n=3, max_side=512, max_prompt_chars=200)


@pytest.fixture(scope="module")
def server(local_serve, tiny_models: Path):
    config = ServeConfig(
        model=str(tiny_models),
        port=local_serve.port,
        token=TOKEN,
        limits=LIMITS,
        min_replicas=1,
        max_replicas=1,
        max_batch=4,
        request_timeout_s=120,
    )
    with local_serve.deployed(config) as url:
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> SnapRefClient:
    return SnapRefClient(server, token=TOKEN, timeout=TIMEOUT, retries=0)


@pytest.fixture(scope="module")
def reference_png(tiny_models: Path) -> bytes:
    return (tiny_models / "reference.png").read_bytes()


@pytest.fixture(scope="module")
def reference_id(client: SnapRefClient, reference_png: bytes) -> str:
    return client.upload_reference(reference_png)


def _raw(url: str, method: str = "GET", data=None, headers: dict | None = None, token: str | None = TOKEN):
    """(status, headers, body) of one HTTP call; no client-side interpretation."""
    headers = dict(headers or {})
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        with urlopen(Request(url, data=data, headers=headers, method=method), timeout=TIMEOUT) as r:
            return r.status, r.headers, r.read()
    except HTTPError as e:
        return e.code, e.headers, e.read()


def _error(body: bytes) -> tuple[str | None, str]:
    err = json.loads(body)["error"]
    return err["field"], err["message"]


def _render_error(client: SnapRefClient, **body) -> ClientError:
    with pytest.raises(ClientError) as info:
        client.render(**body)
    return info.value


# -- no server: parsing and identity ---------------------------------------------------------
def _parse_form(body: bytes, content_type: str, chunk: int = 7) -> MultipartForm:
    async def chunks():
        for i in range(0, len(body), chunk):
            yield body[i : i + chunk]

    form = MultipartForm(
        content_type,
        {"file": 10_000, "ref_caption": 100, "ref_megapixels": 64},
        max_parts=4,
        max_header_bytes=256,
        too_large_status={"file": 413},
    )
    asyncio.run(form.feed(chunks()))
    return form


def test_multipart_round_trip_keeps_binary_content() -> None:
    data = b"\x89PNG\r\n\x1a\n\r\n--not-a-boundary\r\n\x00\xff" * 50
    body, content_type = _multipart(
        {"ref_caption": "blue hair, ünïcode", "ref_megapixels": "0.5"}, "file", "a.png", data
    )
    for chunk in (1, 7, len(body)):  # streamed in pieces that split boundaries and headers anywhere
        form = _parse_form(body, content_type, chunk)
        assert (bytes(form.parts["file"].data), form.parts["file"].filename) == (data, "a.png")
        assert form.text("ref_caption") == "blue hair, ünïcode" and form.text("ref_megapixels") == "0.5"
        assert form.count == 3
    with pytest.raises(ApiError, match="without a boundary"):
        _parse_form(body, "multipart/form-data")


def test_reference_id_is_a_hash_of_file_and_options() -> None:
    h = hashlib.sha256(b"x").hexdigest()
    base = reference_id_for(h, ReferenceOptions())
    assert base == reference_id_for(h, ReferenceOptions(ref_caption="", ref_megapixels=1.0))
    assert len(base) == 32 and int(base, 16) >= 0
    assert base != reference_id_for(h, ReferenceOptions(ref_caption="a"))
    assert base != reference_id_for(h, ReferenceOptions(ref_megapixels=0.5))


def test_render_body_is_the_request_model() -> None:
    from snapref_ray.requests import RenderRequest, RenderSettings

    for name, info in RenderSettings.model_fields.items():
        assert RenderBody.model_fields[name].default == info.default, name
    assert RenderBody.model_fields["seed"].metadata == RenderRequest.model_fields["seed"].metadata
    body = RenderBody(prompt="p", steps=5, mode="char", ref_weight=0.7)
    assert body.settings() == RenderSettings(steps=5, mode="char", ref_weight=0.7)


@pytest.mark.parametrize(
    "body, field, message",
    [
        ({"steps": 0}, "steps", "greater than or equal to 1"),
        ({"width": 100}, "width", "width must be a multiple of 16 between 256 and 4096, got 100"),
        ({"sampler": "dpm"}, "sampler", "'euler' or 'er_sde'"),
        ({"colour": "red"}, "colour", "colour: unknown field"),
        ({"sampeler": "euler"}, "sampeler", "sampeler: unknown field (did you mean 'sampler'?)"),
        ({"ref_start": 0.9, "ref_end": 0.1}, "ref_start", "ref_start (0.9) must not exceed ref_end (0.1)"),
    ],
)
def test_validation_errors_name_the_field(body: dict, field: str, message: str) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as info:
        RenderBody(prompt="p", **body)
    err = validation_error(info.value, set(RenderBody.model_fields), RenderBody)
    assert (err.status, err.field) == (400, field)
    assert message in err.message


@pytest.mark.parametrize(
    "body, field",
    [
        ({"steps": 9}, "steps"),
        ({"n": 4}, "n"),
        ({"width": 528}, "width"),
        ({"prompt": "x" * 201}, "prompt"),
        ({"negative_prompt": "x" * 201}, "negative_prompt"),
        ({"ref_megapixels": 3.0}, "ref_megapixels"),
        ({"denoise": 0.5}, "denoise"),
    ],
)
def test_server_limits_name_the_field(body: dict, field: str) -> None:
    with pytest.raises(ApiError) as info:
        check_limits(RenderBody(**{"prompt": "p", **SMALL, **body}), LIMITS)
    assert (info.value.status, info.value.field) == (400, field)


@pytest.mark.parametrize(
    "body, field",
    [
        ({"left_reference_id": "a"}, "right_reference_id"),
        ({"right_reference_id": "a"}, "left_reference_id"),
        ({"reference_id": "a", "reference_image": "eA=="}, "reference_image"),
        ({"reference_id": "a", "left_reference_id": "b", "right_reference_id": "c"}, "right_reference_id"),
    ],
)
def test_reference_fields_are_exclusive(body: dict, field: str) -> None:
    with pytest.raises(ApiError) as info:
        check_reference_fields(RenderBody(prompt="p", **body))
    assert (info.value.status, info.value.field) == (400, field)


def test_reference_store_evicts_by_bytes() -> None:
    lru = ReferenceLRU(max_bytes=10)

    def info(h: str, rid: str) -> ReferenceInfo:
        return ReferenceInfo(
            reference_id=rid, content_hash=h, width=16, height=16, ref_megapixels=1.0, ref_caption="", bytes=4
        )

    lru.put(info("h1", "a"), b"1111")
    lru.put(info("h1", "a2"), b"1111")  # same file, second caption: stored once
    lru.put(info("h2", "b"), b"2222")
    assert lru.stats()["bytes"] == 8
    assert lru.describe("a") is not None  # h1 is now the most recently used
    lru.put(info("h3", "c"), b"3333")  # 12 bytes > 10: h2 goes
    assert (lru.describe("b"), lru.get_bytes("h2")) == (None, None)
    assert lru.describe("a2").content_hash == "h1" and lru.get_bytes("h3") == b"3333"
    assert lru.stats() == {"files": 2, "references": 3, "bytes": 8, "max_bytes": 10, "evictions": 1}
    with pytest.raises(ValueError, match="exceeds"):
        lru.put(info("h4", "d"), b"x" * 11)


def test_renderer_timeout_becomes_504() -> None:
    from snapref_ray.serve.ingress import Ingress

    class _SlowResponse:
        cancelled = False

        def __await__(self):
            return asyncio.sleep(10).__await__()

        def cancel(self):
            self.cancelled = True

    class _Fake:
        _config = ServeConfig(model="m", request_timeout_s=0.05)

    response = _SlowResponse()
    with pytest.raises(ApiError) as info:
        asyncio.run(Ingress.func_or_class._call(_Fake(), response))
    assert (info.value.status, info.value.field) == (504, None)
    assert "request_timeout_s=0.05" in info.value.message and response.cancelled


# -- the live server ---------------------------------------------------------------------------
@pytest.mark.slow
def test_health_needs_no_token_and_docs_do(server: str) -> None:
    status, _, body = _raw(server + "/v1/health", token=None)
    assert (status, json.loads(body)) == (200, {"status": "ok"})
    for path in ("/docs", "/openapi.json"):  # a token is configured: the docs need it too
        assert _raw(server + path, token=None)[0] == 401
    status, headers, _ = _raw(server + "/docs")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    status, _, body = _raw(server + "/openapi.json")
    spec = json.loads(body)
    assert {"/v1/render", "/v1/references", "/v1/health", "/v1/models"} <= set(spec["paths"])
    render_schema = spec["paths"]["/v1/render"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"prompt", "seed", "n", "ref_weight", "reference_id", "response_format"} <= set(render_schema["properties"])
    upload = spec["paths"]["/v1/references"]["post"]["requestBody"]["content"]
    assert set(upload) == {"multipart/form-data", "application/json"}


@pytest.mark.slow
def test_models_lists_model_adapter_modes_and_limits(client: SnapRefClient) -> None:
    info = client.models()
    assert info["model"] == "dit.safetensors"
    assert info["modes"] == ["cs", "char"] and info["adapter"]["identity"].startswith("sha256:")
    assert info["limits"] == LIMITS.model_dump() and info["device"] == "cpu"


@pytest.mark.slow
@pytest.mark.parametrize("path, method", [("/v1/models", "GET"), ("/v1/references", "POST"), ("/v1/render", "POST")])
def test_missing_or_invalid_token_is_401(server: str, path: str, method: str) -> None:
    data = b"{}" if method == "POST" else None
    for token, message in [(None, "missing bearer token"), ("wrong-token", "invalid bearer token")]:
        status, headers, body = _raw(server + path, method, data, {"Content-Type": "application/json"}, token=token)
        assert status == 401
        field, text = _error(body)
        assert field == "Authorization" and text.startswith(message)
        assert TOKEN not in text
        assert headers["WWW-Authenticate"] == 'Bearer realm="snapref-ray"'


@pytest.mark.slow
def test_same_image_twice_gives_the_same_id(client: SnapRefClient, reference_png: bytes, server: str) -> None:
    first = client.upload_reference_info(reference_png)
    assert first["content_hash"] == hashlib.sha256(reference_png).hexdigest()
    assert (first["width"], first["height"], first["bytes"]) == (128, 192, len(reference_png))  # already < 1 MP
    again = client.upload_reference_info(reference_png)
    as_json = json.loads(
        _raw(
            server + "/v1/references",
            "POST",
            json.dumps({"image": base64.b64encode(reference_png).decode()}).encode(),
            {"Content-Type": "application/json"},
        )[2]
    )
    assert first == again == as_json
    captioned = client.upload_reference_info(reference_png, ref_caption="1girl, blue dress", ref_megapixels=0.01)
    assert captioned["reference_id"] != first["reference_id"]
    assert captioned["content_hash"] == first["content_hash"]
    assert (captioned["width"], captioned["height"]) == (80, 112)  # fitted to 0.01 MP, multiples of 16


@pytest.mark.slow
def test_upload_and_render_round_trip_png(client: SnapRefClient, reference_id: str, server: str) -> None:
    png = client.render("1girl, in a garden", reference_id=reference_id, seed=11, **SMALL)
    img = Image.open(io.BytesIO(png))
    img.load()
    assert (img.format, img.size, img.mode) == ("PNG", (256, 256), "RGB")
    info = read_image_info(png)
    assert (info["seed"], info["prompt"], info["reference_ids"]) == (11, "1girl, in a garden", [reference_id])
    assert info["settings"]["steps"] == 2
    status, headers, _ = _raw(
        server + "/v1/render",
        "POST",
        json.dumps({"prompt": "x", "reference_id": reference_id, **SMALL}).encode(),
        {"Content-Type": "application/json", "Accept": "image/png"},
    )
    assert (status, headers["Content-Type"], headers["X-Seed"]) == (200, "image/png", "0")
    assert headers["X-Reference-Ids"] == reference_id and headers["X-Cache-Hit"] in ("true", "false")


@pytest.mark.slow
def test_json_mode_returns_metadata(client: SnapRefClient, reference_id: str) -> None:
    answer = client.render(
        "1girl, reading",
        reference_id=reference_id,
        seed=3,
        response_format="json",
        mode="char",
        ref_weight=0.8,
        **SMALL,
    )
    assert answer["prompt"] == "1girl, reading" and answer["seeds"] == [3]
    assert answer["settings"]["mode"] == "char" and answer["settings"]["ref_weight"] == 0.8
    assert answer["settings"]["cfg"] == 4.5  # defaults filled in
    assert answer["reference_ids"] == [reference_id]
    assert {"encode_s", "text_s", "sample_s", "decode_s", "png_s", "queue_s", "replica_s", "call_s", "total_s"} <= set(
        answer["timings"]
    )
    timings = answer["timings"]  # nested spans: the replica's work inside the ingress's call inside the request
    assert 0 < timings["sample_s"] < timings["replica_s"] <= timings["call_s"] <= timings["total_s"]
    assert answer["batch_size"] >= 1 and answer["batched_requests"] >= 1 and isinstance(answer["cache_hit"], bool)
    (image,) = answer["images"]
    assert (image["seed"], image["width"], image["height"]) == (3, 256, 256)
    assert read_image_info(base64.b64decode(image["png_base64"]))["seed"] == 3


@pytest.mark.slow
def test_n_images_have_consecutive_distinct_seeds(client: SnapRefClient, reference_id: str) -> None:
    answer = client.render("1girl", reference_id=reference_id, seed=40, n=3, **SMALL)  # n > 1: JSON by default
    assert answer["seeds"] == [40, 41, 42] and [i["seed"] for i in answer["images"]] == [40, 41, 42]
    assert answer["batch_size"] >= 3
    pixels = [Image.open(io.BytesIO(png)).tobytes() for png in client.decode_images(answer)]
    assert len(set(pixels)) == 3


@pytest.mark.slow
def test_reference_is_encoded_once_per_replica(client: SnapRefClient, reference_png: bytes) -> None:
    ref = client.upload_reference(reference_png, ref_caption="encoded-once test")  # a key no replica holds yet
    with ThreadPoolExecutor(4) as pool:
        answers = list(
            pool.map(
                lambda s: client.render("1girl", reference_id=ref, seed=s, response_format="json", **SMALL), range(4)
            )
        )
    (replica,) = {a["replica"] for a in answers}  # one replica in this module
    assert [a["cache_hit"] for a in answers].count(False) == 1  # the one that encoded; the others waited for it
    encoders = [a for a in answers if not a["cache_hit"]]
    assert encoders[0]["timings"]["encode_s"] > 0
    assert all(a["timings"]["encode_s"] == 0 for a in answers if a["cache_hit"])
    before = max(a["cache"]["encodes"] for a in answers)
    later = client.render("1girl", reference_id=ref, seed=9, response_format="json", **SMALL)
    assert later["cache_hit"] is True and later["cache"]["encodes"] == before and later["replica"] == replica
    # A different caption or target size is a different K/V: encoded again.
    other_size = client.render("1girl", reference_id=ref, response_format="json", width=272, height=256, steps=2)
    assert other_size["cache_hit"] is False and other_size["cache"]["encodes"] == before + 1


@pytest.mark.slow
def test_inline_reference_and_two_characters(client: SnapRefClient, reference_png: bytes, reference_id: str) -> None:
    inline = client.render("1girl", reference_image=reference_png, response_format="json", **SMALL)
    assert inline["reference_ids"] == [reference_id]  # stored like an upload of the same file
    other = Image.new("RGB", (96, 160), (200, 40, 40))
    buf = io.BytesIO()
    other.save(buf, "PNG")
    right = client.upload_reference(buf.getvalue())
    pair = client.render(
        "2girls, side by side",
        left_reference_id=reference_id,
        right_reference_id=right,
        response_format="json",
        **SMALL,
    )
    assert pair["reference_ids"] == [reference_id, right] and len(pair["images"]) == 1
    plain = client.render("scenery", response_format="json", **SMALL)  # no reference at all
    assert plain["reference_ids"] == [] and plain["cache_hit"] is None


@pytest.mark.slow
@pytest.mark.parametrize(
    "body, field",
    [
        ({"steps": 0}, "steps"),
        ({"width": 100}, "width"),
        ({"colour": "red"}, "colour"),
        ({"steps": 9}, "steps"),
        ({"n": 4}, "n"),
        ({"n": 2, "response_format": "png"}, "n"),
        ({"ref_start": 0.9, "ref_end": 0.1}, "ref_start"),
        ({"left_reference_id": "x"}, "right_reference_id"),
    ],
)
def test_bad_fields_are_400_naming_the_field(client: SnapRefClient, body: dict, field: str) -> None:
    err = _render_error(client, prompt="p", **{**SMALL, **body})
    assert (err.status, err.field) == (400, field)
    assert err.message


@pytest.mark.slow
def test_malformed_bodies_are_400(server: str) -> None:
    status, _, body = _raw(server + "/v1/render", "POST", b"{not json", {"Content-Type": "application/json"})
    assert (status, _error(body)[0]) == (400, "body") and "Invalid JSON" in _error(body)[1]
    status, _, body = _raw(
        server + "/v1/render", "POST", json.dumps({"seed": 1}).encode(), {"Content-Type": "application/json"}
    )
    assert (status, _error(body)[0]) == (400, "prompt")
    status, _, body = _raw(
        server + "/v1/render",
        "POST",
        json.dumps({"prompt": "p", "reference_image": "not base64!", **SMALL}).encode(),
        {"Content-Type": "application/json"},
    )
    assert (status, _error(body)[0]) == (400, "reference_image") and "not valid base64" in _error(body)[1]
    status, _, body = _raw(server + "/v1/references", "POST", b"raw", {"Content-Type": "image/png"})
    assert (status, _error(body)[0]) == (415, "Content-Type")


@pytest.mark.slow
def test_unknown_reference_id_is_404(client: SnapRefClient, reference_id: str) -> None:
    err = _render_error(client, prompt="p", reference_id="0" * 32, **SMALL)
    assert (err.status, err.field) == (404, "reference_id")
    assert "unknown reference id '00000000000000000000000000000000'" in err.message
    err = _render_error(client, prompt="p", left_reference_id=reference_id, right_reference_id="nope", **SMALL)
    assert (err.status, err.field) == (404, "right_reference_id")


@pytest.mark.slow
def test_unknown_route_is_a_json_404(server: str) -> None:
    status, _, body = _raw(server + "/v2/render")
    assert status == 404 and _error(body) == (None, "Not Found")


@pytest.mark.slow
def test_oversized_upload_is_413(client: SnapRefClient, server: str) -> None:
    too_big = b"\x00" * (LIMITS.max_upload_bytes + 1)
    with pytest.raises(ClientError) as info:  # multipart, refused on Content-Length before reading
        client.upload_reference(too_big)
    assert (info.value.status, info.value.field) == (413, "file")
    # JSON: the base64 body fits the body limit, the decoded file does not.
    body = json.dumps({"image": base64.b64encode(too_big).decode()}).encode()
    status, _, answer = _raw(server + "/v1/references", "POST", body, {"Content-Type": "application/json"})
    assert (status, _error(answer)[0]) == (413, "image")
    assert f"{len(too_big)} bytes, more than the {LIMITS.max_upload_bytes} accepted" in _error(answer)[1]
    # No Content-Length (chunked): refused from the bytes actually received.
    head = b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.png"\r\n\r\n'
    chunks = iter([head] + [b"\x00" * 100_000] * 5)
    status, _, answer = _raw(
        server + "/v1/references", "POST", chunks, {"Content-Type": "multipart/form-data; boundary=b"}
    )
    assert (status, _error(answer)[0]) == (413, "file")
    assert "exceeds" in _error(answer)[1]


@pytest.mark.slow
def test_corrupt_or_hostile_images_are_400(client: SnapRefClient, reference_png: bytes) -> None:
    bomb = io.BytesIO()
    Image.new("1", (9000, 8000)).save(bomb, "PNG")  # 72 MP in a few kB: refused on its header
    cases = [
        (reference_png[: len(reference_png) // 2], "truncated or corrupt"),
        (b"", "empty file"),
        (b"GIF89a but not really an image", "not an image format"),
        (bomb.getvalue(), "decompression bomb"),
    ]
    for data, message in cases:
        with pytest.raises(ClientError) as info:
            client.upload_reference(data)
        assert (info.value.status, info.value.field) == (400, "file"), message
        assert message in info.value.message
