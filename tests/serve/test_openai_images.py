"""The parts of the OpenAI-compatible image routes that need no server: multipart fields typed like JSON,
repeatable `image[]` parts, error names and shapes.

The routes themselves, called with the official `openai` package against the real server and checked
against /v1/render, are tested in tests/serve/test_api.py's last section, on that module's deployment (one
application serves both APIs, so the suite deploys it once).
"""

from __future__ import annotations

import json

import pytest

from snapref_ray.serve.errors import ApiError
from snapref_ray.serve.openai_errors import error_response, renamed
from snapref_ray.serve.openai_images import OPENAI_NAMES, form_values


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
