"""The OpenAI-compatible image routes, called with the official `openai` package against the real server on
127.0.0.1 (the module's application on the session's local Serve), checked against /v1/render.

/v1/render is the oracle: the same prompt, seed, size, settings and reference sent there must give the same
pixels, and what the server's RefKV counters say is read from GET /v1/models, apart from the answer checked.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from urllib.error import HTTPError
from urllib.request import Request, urlopen

import numpy as np
import openai
import pytest
from PIL import Image

from snapref_ray.client import SnapRefClient
from snapref_ray.serve.config import ServeConfig, ServeLimits
from snapref_ray.serve.errors import ApiError
from snapref_ray.serve.openai_errors import error_response, renamed
from snapref_ray.serve.openai_images import OPENAI_NAMES, form_values
from snapref_ray.storage.image_files import read_image_info

TOKEN = "test-token-openai-7d1e"
TIMEOUT = 120  # seconds, every HTTP call
SIZE, STEPS = "256x256", 2
LIMITS = ServeLimits(max_upload_bytes=200_000, max_steps=8, max_n=3, max_side=512, max_prompt_chars=200)
# Settings off their defaults, so that a translation that dropped one would change the pixels.
SETTINGS = {"guidance_scale": 3.0, "negative_prompt": "lowres", "mode": "char", "ref_weight": 0.8}


@pytest.fixture(scope="module")
def server(local_serve, tiny_models: Path):
    config = ServeConfig(
        model=str(tiny_models),
        port=local_serve.port,
        token=TOKEN,
        limits=LIMITS,
        min_replicas=1,
        max_replicas=1,
        max_batch_size=4,
        request_timeout_s=120,
    )
    with local_serve.deployed(config) as url:
        yield url


@pytest.fixture(scope="module")
def oai(server: str) -> openai.OpenAI:
    # max_retries=0: what is checked is the server's answer, not the SDK's retries.
    return openai.OpenAI(base_url=server + "/v1", api_key=TOKEN, max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def native(server: str) -> SnapRefClient:
    return SnapRefClient(server, token=TOKEN, timeout=TIMEOUT, retries=0)


@pytest.fixture(scope="module")
def reference_png(tiny_models: Path) -> bytes:
    return (tiny_models / "reference.png").read_bytes()


@pytest.fixture(scope="module")
def red_png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (96, 160), (200, 40, 40)).save(buf, "PNG")
    return buf.getvalue()


def _raw(url: str, method: str = "GET", data: bytes | None = None, headers: dict | None = None):
    request = Request(url, data=data, headers={"Authorization": f"Bearer {TOKEN}", **(headers or {})}, method=method)
    try:
        with urlopen(request, timeout=TIMEOUT) as r:
            return r.status, json.loads(r.read())
    except HTTPError as e:
        return e.code, json.loads(e.read())


def _pixels(data: bytes) -> np.ndarray:
    img = Image.open(io.BytesIO(data))
    img.load()
    return np.asarray(img.convert("RGB"))


def _rendered(native: SnapRefClient, prompt: str, seed: int, **settings) -> tuple[np.ndarray, dict]:
    """The oracle: /v1/render's image (pixels) and JSON answer for the same request in its own names."""
    width, height = map(int, SIZE.split("x"))
    answer = native.render(
        prompt, seed=seed, width=width, height=height, steps=STEPS, response_format="json", **settings
    )
    (image,) = answer["images"]
    return _pixels(base64.b64decode(image["png_base64"])), answer


def _native(settings: dict) -> dict:
    """SETTINGS in /v1/render's names."""
    names = {"guidance_scale": "cfg"}
    return {names.get(k, k): v for k, v in settings.items()}


def _encodes(server: str) -> int:
    status, info = _raw(server + "/v1/models")
    assert status == 200
    return info["refkv_cache"]["encodes"]


# -- no server --------------------------------------------------------------------------------
def test_form_fields_are_typed_like_json() -> None:
    texts = {"n": "2", "guidance_scale": "4.5", "prompt": "123", "ref_in_uncond": "true"}
    values = form_values({**texts, "step_cache[threshold]": "0.3", "mode": "char", "size": "256x256"})
    assert values == {
        "n": 2,
        "guidance_scale": 4.5,
        "prompt": "123",  # a string field keeps its text
        "ref_in_uncond": True,
        "step_cache": {"threshold": 0.3},  # the SDK's nested form name
        "mode": "char",
        "size": "256x256",
    }
    for bad in ("NaN", "Infinity", "1e999"):
        with pytest.raises(ApiError, match="not a number this API accepts") as info:
            form_values({"guidance_scale": bad})
        assert info.value.field == "guidance_scale"


def test_a_form_takes_a_repeatable_part_up_to_its_bound() -> None:
    import asyncio

    from snapref_ray.serve.forms import MultipartForm

    def parsed(files: int) -> MultipartForm:
        parts = [(b"prompt", b"p")] + [(b"image[]", bytes([i]) * 3) for i in range(files)]
        body = b"".join(
            b'--b\r\nContent-Disposition: form-data; name="' + name + b'"\r\n\r\n' + data + b"\r\n"
            for name, data in parts
        )
        form = MultipartForm(
            "multipart/form-data; boundary=b",
            {"prompt": 10, "image[]": 10},
            max_parts=10,
            max_header_bytes=256,
            repeatable={"image[]": 3},
        )

        async def chunks():
            yield body + b"--b--\r\n"

        asyncio.run(form.feed(chunks()))
        return form

    form = parsed(3)
    assert [bytes(p.data) for p in form.repeated["image[]"]] == [b"\x00" * 3, b"\x01" * 3, b"\x02" * 3]
    assert [p.index for p in form.repeated["image[]"]] == [2, 3, 4] and form.text("prompt") == "p"
    with pytest.raises(ApiError, match="part 5 is 'image\\[\\]' number 4; at most 3 accepted") as info:
        parsed(4)
    assert (info.value.status, info.value.field) == (400, "image[]")


def test_errors_name_the_field_as_the_client_sent_it() -> None:
    err = renamed(ApiError(400, "steps", "9 steps, more than the 8 allowed"), OPENAI_NAMES)
    assert (err.field, err.message) == ("num_inference_steps", "num_inference_steps: 9 steps, more than the 8 allowed")
    err = renamed(ApiError(400, "height", "1024 px, more than the 512 allowed"), OPENAI_NAMES)
    assert (err.field, err.message) == ("size", "size (height): 1024 px, more than the 512 allowed")
    untouched = ApiError(400, "n", "too many")
    assert renamed(untouched, OPENAI_NAMES) is untouched


def test_errors_take_openais_shape_only_on_its_routes() -> None:
    from starlette.requests import Request as StarletteRequest

    overloaded = ApiError(503, None, "the renderers are at capacity", headers={"Retry-After": "5"})
    for path, body in [
        (
            "/v1/images/generations",
            {
                "message": "the renderers are at capacity",
                "type": "server_overloaded_error",
                "param": None,
                "code": "overloaded",
            },
        ),
        ("/v1/render", {"field": None, "message": "the renderers are at capacity"}),
    ]:
        response = error_response(StarletteRequest({"type": "http", "path": path, "headers": []}), overloaded)
        assert (response.status_code, json.loads(response.body)) == (503, {"error": body})
        assert response.headers["Retry-After"] == "5"  # the SDK waits as long before it retries


# -- the live server ---------------------------------------------------------------------------
@pytest.mark.slow
def test_models_list_and_the_fields_of_today(oai: openai.OpenAI, server: str) -> None:
    (model,) = oai.models.list().data
    assert (model.id, model.object, model.owned_by) == ("dit.safetensors", "model", "snapref-ray")
    status, info = _raw(server + "/v1/models")
    assert status == 200 and info["object"] == "list" and info["data"][0]["id"] == "dit.safetensors"
    assert info["model"] == "dit.safetensors" and info["limits"] == LIMITS.model_dump() and info["modes"]


@pytest.mark.slow
def test_generate_equals_render(oai: openai.OpenAI, native: SnapRefClient, reference_png: bytes) -> None:
    reference_id = native.upload_reference(reference_png)
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
    expected, rendered = _rendered(native, "1girl, in a garden", 11, reference_id=reference_id, **_native(SETTINGS))
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
    oai: openai.OpenAI, native: SnapRefClient, server: str, reference_png: bytes
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
    reference_id = native.upload_reference(reference_png, ref_caption=caption)
    assert first.snapref["reference_ids"] == second.snapref["reference_ids"] == [reference_id]
    expected, _ = _rendered(native, "1girl, reading", 5, reference_id=reference_id, **_native(SETTINGS))
    assert np.array_equal(_pixels(base64.b64decode(first.data[0].b64_json)), expected)
    assert np.array_equal(_pixels(base64.b64decode(second.data[0].b64_json)), expected)
    assert _encodes(server) == before + 1


@pytest.mark.slow
def test_edit_with_two_images_as_a_pair_or_one_character(
    oai: openai.OpenAI, native: SnapRefClient, reference_png: bytes, red_png: bytes
) -> None:
    answer = oai.images.edit(
        image=[("left.png", reference_png, "image/png"), ("right.png", red_png, "image/png")],
        prompt="2girls, side by side",
        size=SIZE,
        extra_body={"seed": 2, "num_inference_steps": STEPS, "reference_layout": "pair"},
    )
    left, right = native.upload_reference(reference_png), native.upload_reference(red_png)
    assert answer.snapref["reference_ids"] == [left, right]
    expected, _ = _rendered(native, "2girls, side by side", 2, left_reference_id=left, right_reference_id=right)
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
    status, body = _raw(server + "/v1/render", "POST", b"{}", {"Content-Type": "application/json"})
    assert status == 400 and set(body["error"]) == {"field", "message"}
    status, body = _raw(server + "/v1/images/generations", "POST", b"{}", {"Content-Type": "application/json"})
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == "prompt"


@pytest.mark.slow
def test_openapi_lists_the_routes(server: str) -> None:
    status, spec = _raw(server + "/openapi.json")
    assert status == 200
    generation = spec["paths"]["/v1/images/generations"]["post"]
    schema = generation["requestBody"]["content"]["application/json"]["schema"]
    assert {"prompt", "n", "size", "seed", "num_inference_steps", "guidance_scale", "mode", "reference_id"} <= set(
        schema["properties"]
    )
    edit = spec["paths"]["/v1/images/edits"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert {"image", "prompt", "reference_layout", "ref_weight"} <= set(edit["properties"])
    assert generation["security"] == [{"bearerAuth": []}]
