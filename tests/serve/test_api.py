"""The HTTP API end to end: a real local Serve on 127.0.0.1 with the tiny models, real HTTP.

The module's application on the session's local Serve (tests/conftest.py) answers both APIs: its own
(/v1/references, /v1/render, ...) and, in the last section, OpenAI's images routes called with the official
`openai` package (one deployment for both: each costs ~13 s to deploy and delete on 2 cores). Parsing
helpers are tested without it.
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

import numpy as np
import openai
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
from snapref_ray.serve.reference_store import ReferenceLRU
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
    from snapref_ray.serve.render_path import RenderPath

    class _SlowResponse:
        cancelled = False

        def __await__(self):
            return asyncio.sleep(10).__await__()

        def cancel(self):
            self.cancelled = True

    path = RenderPath(ServeConfig(model="m", request_timeout_s=0.05), renderer=object(), local=None, store=None)
    response = _SlowResponse()
    with pytest.raises(ApiError) as info:
        asyncio.run(path.call(response))
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


# -- the live server: OpenAI's images routes, with the official `openai` package -----------------
# /v1/render is their oracle: the same prompt, seed, size, settings and reference sent there must give the
# same pixels, and what the server's RefKV counters say is read from GET /v1/models, apart from the answer
# checked. (Here, on this module's application, rather than in tests/serve/test_openai_images.py, which
# tests their parts without a server: one deployment serves both APIs.)
SIZE, STEPS = "256x256", 2
# Settings off their defaults, so that a translation that dropped one would change the pixels.
SETTINGS = {"guidance_scale": 3.0, "negative_prompt": "lowres", "mode": "char", "ref_weight": 0.8}


@pytest.fixture(scope="module")
def oai(server: str) -> openai.OpenAI:
    # max_retries=0: what is checked is the server's answer, not the SDK's retries.
    return openai.OpenAI(base_url=server + "/v1", api_key=TOKEN, max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def red_png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (96, 160), (200, 40, 40)).save(buf, "PNG")
    return buf.getvalue()


def _raw_json(url: str, method: str = "GET", data: bytes | None = None, headers: dict | None = None):
    """(status, parsed JSON body) of one HTTP call with the module's token."""
    status, _, body = _raw(url, method, data, headers)
    return status, json.loads(body)


def _pixels(data: bytes) -> np.ndarray:
    img = Image.open(io.BytesIO(data))
    img.load()
    return np.asarray(img.convert("RGB"))


def _rendered(client: SnapRefClient, prompt: str, seed: int, **settings) -> tuple[np.ndarray, dict]:
    """The oracle: /v1/render's image (pixels) and JSON answer for the same request in its own names."""
    width, height = map(int, SIZE.split("x"))
    answer = client.render(
        prompt, seed=seed, width=width, height=height, steps=STEPS, response_format="json", **settings
    )
    (image,) = answer["images"]
    return _pixels(base64.b64decode(image["png_base64"])), answer


def _native(settings: dict) -> dict:
    """SETTINGS in /v1/render's names."""
    names = {"guidance_scale": "cfg"}
    return {names.get(k, k): v for k, v in settings.items()}


def _encodes(server: str) -> int:
    status, info = _raw_json(server + "/v1/models")
    assert status == 200
    return info["refkv_cache"]["encodes"]


@pytest.mark.slow
def test_models_list_and_the_fields_of_today(oai: openai.OpenAI, server: str) -> None:
    (model,) = oai.models.list().data
    assert (model.id, model.object, model.owned_by) == ("dit.safetensors", "model", "snapref-ray")
    status, info = _raw_json(server + "/v1/models")
    assert status == 200 and info["object"] == "list" and info["data"][0]["id"] == "dit.safetensors"
    assert info["model"] == "dit.safetensors" and info["limits"] == LIMITS.model_dump() and info["modes"]


@pytest.mark.slow
def test_generate_equals_render(oai: openai.OpenAI, client: SnapRefClient, reference_png: bytes) -> None:
    reference_id = client.upload_reference(reference_png)
    answer = oai.images.generate(
        model="dit.safetensors",
        prompt="1girl, in a garden",
        size=SIZE,
        n=1,
        response_format="b64_json",
        user="someone",
        extra_body={
            "seed": 11,
            "num_inference_steps": STEPS,
            "generator_device": "cpu",
            "output_format": "png",
            "reference_id": reference_id,
            **SETTINGS,
        },
    )
    (item,) = answer.data
    png = base64.b64decode(item.b64_json)
    expected, rendered = _rendered(client, "1girl, in a garden", 11, reference_id=reference_id, **_native(SETTINGS))
    assert np.array_equal(_pixels(png), expected)
    # The extensions took effect and are recorded: in the answer and in the PNG's own metadata.
    assert item.seed == 11 and item.settings["steps"] == STEPS and item.settings["cfg"] == 3.0
    assert item.settings == rendered["settings"]
    info = read_image_info(png)
    assert (info["seed"], info["settings"]["steps"], info["reference_ids"]) == (11, STEPS, [reference_id])
    assert answer.size == SIZE and answer.snapref["reference_ids"] == [reference_id]
    # Another seed, another image; n images have consecutive seeds.
    other = oai.images.generate(
        prompt="1girl, in a garden",
        size=SIZE,
        n=2,
        extra_body={"seed": 12, "num_inference_steps": STEPS, "reference_id": reference_id, **SETTINGS},
    )
    assert [i.seed for i in other.data] == [12, 13]
    assert not np.array_equal(_pixels(base64.b64decode(other.data[0].b64_json)), expected)


@pytest.mark.slow
def test_edit_equals_render_and_encodes_once(
    oai: openai.OpenAI, client: SnapRefClient, server: str, reference_png: bytes
) -> None:
    caption = "openai edit test"  # a RefKV key no other test has made
    extra = {"seed": 5, "num_inference_steps": STEPS, "ref_caption": caption, **SETTINGS}
    before = _encodes(server)
    first = oai.images.edit(
        image=("ref.png", reference_png, "image/png"), prompt="1girl, reading", size=SIZE, extra_body=extra
    )
    assert _encodes(server) == before + 1 and first.snapref["cache_hit"] is False
    second = oai.images.edit(
        image=("ref.png", reference_png, "image/png"), prompt="1girl, reading", size=SIZE, extra_body=extra
    )
    assert _encodes(server) == before + 1, "the same image again was encoded again"
    assert second.snapref["cache_hit"] is True
    # The edit stored the image as /v1/references does: the same id, and /v1/render's pixels for it.
    reference_id = client.upload_reference(reference_png, ref_caption=caption)
    assert first.snapref["reference_ids"] == second.snapref["reference_ids"] == [reference_id]
    expected, _ = _rendered(client, "1girl, reading", 5, reference_id=reference_id, **_native(SETTINGS))
    assert np.array_equal(_pixels(base64.b64decode(first.data[0].b64_json)), expected)
    assert np.array_equal(_pixels(base64.b64decode(second.data[0].b64_json)), expected)
    assert _encodes(server) == before + 1


@pytest.mark.slow
def test_edit_with_two_images_as_a_pair_or_one_character(
    oai: openai.OpenAI, client: SnapRefClient, reference_png: bytes, red_png: bytes
) -> None:
    answer = oai.images.edit(
        image=[("left.png", reference_png, "image/png"), ("right.png", red_png, "image/png")],
        prompt="2girls, side by side",
        size=SIZE,
        extra_body={"seed": 2, "num_inference_steps": STEPS, "reference_layout": "pair"},
    )
    left, right = client.upload_reference(reference_png), client.upload_reference(red_png)
    assert answer.snapref["reference_ids"] == [left, right]
    expected, _ = _rendered(client, "2girls, side by side", 2, left_reference_id=left, right_reference_id=right)
    assert np.array_equal(_pixels(base64.b64decode(answer.data[0].b64_json)), expected)
    # The same two files without reference_layout: several images of one character, read another way.
    multi = oai.images.edit(
        image=[("left.png", reference_png, "image/png"), ("right.png", red_png, "image/png")],
        prompt="2girls, side by side",
        size=SIZE,
        extra_body={"seed": 2, "num_inference_steps": STEPS},
    )
    assert multi.snapref["reference_ids"] == [left, right] and multi.snapref["cache_hit"] is False
    assert not np.array_equal(_pixels(base64.b64decode(multi.data[0].b64_json)), expected)


@pytest.mark.slow
def test_output_formats(oai: openai.OpenAI) -> None:
    request = {"prompt": "scenery", "size": SIZE, "extra_body": {"seed": 1, "num_inference_steps": STEPS}}
    png = base64.b64decode(oai.images.generate(**request).data[0].b64_json)
    for fmt, pil_format in (("webp", "WEBP"), ("jpeg", "JPEG")):
        answer = oai.images.generate(**request, output_format=fmt, output_compression=90)
        data = base64.b64decode(answer.data[0].b64_json)
        assert Image.open(io.BytesIO(data)).format == pil_format and answer.output_format == fmt
        # Lossy: the oracle is the PNG's pixels encoded here at the quality asked for.
        expected = io.BytesIO()
        Image.open(io.BytesIO(png)).convert("RGB").save(expected, pil_format, quality=90)
        assert np.array_equal(_pixels(data), _pixels(expected.getvalue())), fmt


@pytest.mark.slow
def test_bad_input_raises_the_sdks_typed_errors(oai: openai.OpenAI, server: str, reference_png: bytes) -> None:
    def bad_request(call, **kwargs) -> openai.BadRequestError:
        with pytest.raises(openai.BadRequestError) as info:
            call(**kwargs)
        assert info.value.status_code == 400 and info.value.type == "invalid_request_error"
        return info.value

    generate = {"prompt": "p", "size": SIZE, "extra_body": {"num_inference_steps": STEPS}}
    cases = [
        ({"size": "100x100"}, "size", "multiple of 16"),
        ({"size": "huge"}, "size", "expected WIDTHxHEIGHT"),
        ({"size": "1024x1024"}, "size", "more than the 512 allowed"),
        ({"n": 4}, "n", "more than the 3 allowed"),
        ({"response_format": "url"}, "response_format", "durable storage"),
        ({"model": "dall-e-3"}, "model", "this server renders 'dit.safetensors'"),
        ({"extra_body": {"num_inference_steps": 9}}, "num_inference_steps", "more than the 8 allowed"),
        ({"extra_body": {"generator_device": "cuda"}}, "generator_device", "CPU generator"),
        ({"extra_body": {"sampeler": "euler"}}, "sampeler", "did you mean 'sampler'"),
        ({"extra_body": {"reference_id": "0" * 32}}, None, None),  # 404, below
    ]

    def changed(change: dict) -> dict:
        return {**generate, **change, "extra_body": {**generate["extra_body"], **change.get("extra_body", {})}}

    for change, param, message in cases[:-1]:
        err = bad_request(oai.images.generate, **changed(change))
        assert err.param == param and message in err.message, (change, err.message)
    with pytest.raises(openai.NotFoundError) as info:
        oai.images.generate(**changed(cases[-1][0]))
    assert info.value.param == "reference_id" and "unknown reference id" in info.value.message
    # An edit whose image is not an image, and one with a file too large: the field is `image`.
    edit = {"prompt": "p", "size": SIZE, "extra_body": {"num_inference_steps": STEPS}}
    err = bad_request(oai.images.edit, image=("a.png", b"GIF89a but not really", "image/png"), **edit)
    assert err.param == "image" and "not an image format" in err.message
    image = ("ref.png", reference_png, "image/png")
    for change, param, message in [
        ({"extra_body": {"reference_id": "0" * 32}}, "reference_id", "an edit's reference is its image"),
        ({"extra_body": {"reference_layout": "pair"}}, "reference_layout", "send two images, not 1"),
        ({"mask": image}, "mask", "masks are not served"),
        ({"extra_body": {"num_inference_steps": 9}}, "num_inference_steps", "more than the 8 allowed"),
    ]:
        err = bad_request(oai.images.edit, image=image, **{**edit, **change})
        assert err.param == param and message in err.message, (change, err.message)
    with pytest.raises(openai.APIStatusError) as too_large:
        oai.images.edit(image=("a.png", b"\x00" * (LIMITS.max_upload_bytes + 1), "image/png"), **edit)
    assert too_large.value.status_code == 413 and too_large.value.param == "image"
    # A wrong token: the SDK's AuthenticationError, in OpenAI's shape, without the token in it.
    wrong = openai.OpenAI(base_url=server + "/v1", api_key="wrong-token", max_retries=0, timeout=TIMEOUT)
    for call in (lambda: wrong.images.generate(**generate), lambda: wrong.images.edit(image=reference_png, **edit)):
        with pytest.raises(openai.AuthenticationError) as auth:
            call()
        assert auth.value.param == "Authorization" and auth.value.code == "invalid_api_key"
        assert "invalid bearer token" in auth.value.message and TOKEN not in auth.value.message
    # The existing routes keep their own error shape.
    status, body = _raw_json(server + "/v1/render", "POST", b"{}", {"Content-Type": "application/json"})
    assert status == 400 and set(body["error"]) == {"field", "message"}
    status, body = _raw_json(server + "/v1/images/generations", "POST", b"{}", {"Content-Type": "application/json"})
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == "prompt"


@pytest.mark.slow
def test_hints_name_the_clients_field_and_this_servers_limits(oai: openai.OpenAI, client: SnapRefClient) -> None:
    generate = {"prompt": "p", "size": SIZE}

    def refused(extra: dict, **change) -> openai.BadRequestError:
        with pytest.raises(openai.BadRequestError) as info:
            oai.images.generate(**{**generate, **change}, extra_body={"num_inference_steps": STEPS, **extra})
        return info.value

    # A typo is matched only against what the route accepts: `style` is refused whatever its value.
    err = refused({"stpes": 2})
    assert err.param == "stpes" and "did you mean 'num_inference_steps'?" in err.message, err.message
    assert "style" not in err.message
    # /v1/render's name sent here is reported under the name sent, with the route's name as the way out.
    err = refused({"steps": 2})
    assert (err.param, err.body["message"]) == ("steps", "steps: this route takes it as 'num_inference_steps'")
    # A side past the request model's own bound: the message states this server's cap (512), not 4096.
    err = refused({}, size="8192x256")
    assert err.param == "size" and "between 256 and 512, got 8192" in err.message, err.message
    native = _render_error(client, prompt="p", width=8192, height=256, steps=STEPS)
    assert (native.status, native.field) == (400, "width")
    assert "between 256 and 512, got 8192" in native.message and "4096" not in native.message, native.message


@pytest.mark.slow
def test_openapi_lists_the_routes(server: str) -> None:
    status, spec = _raw_json(server + "/openapi.json")
    assert status == 200
    generation = spec["paths"]["/v1/images/generations"]["post"]
    schema = generation["requestBody"]["content"]["application/json"]["schema"]
    assert {"prompt", "n", "size", "seed", "num_inference_steps", "guidance_scale", "mode", "reference_id"} <= set(
        schema["properties"]
    )
    edit = spec["paths"]["/v1/images/edits"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert {"image", "prompt", "reference_layout", "ref_weight"} <= set(edit["properties"])
    assert generation["security"] == [{"bearerAuth": []}]
