"""Image files carry their parameters: PNG tEXt/iTXt chunks, EXIF UserComment + XMP for WebP/JPEG."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from snapref_ray.requests import RenderSettings
from snapref_ray.storage.image_files import (
    a1111_parameters,
    encode_image,
    encode_rendered_image,
    make_thumbnail,
    read_image_info,
    read_image_parameters,
)

INFO = {
    "item_id": "r0001-s0",
    "reference_hash": "ab" * 32,
    "adapter": "snapref_anima.safetensors",
    "seed": 123456789,
    "sampler": "er_sde",
    "settings": {"steps": 30, "cfg": 4.0, "ref_caption": "1girl, 日本"},
}


def _image(w: int = 48, h: int = 32, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(0)
    channels = {"RGB": 3, "RGBA": 4}.get(mode)
    shape = (h, w, channels) if channels else (h, w)
    return Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode)


def _png_text_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """(chunk type, keyword) of every text chunk, read from the raw PNG stream."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, found = 8, []
    while pos < len(data):
        length, ctype = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + length]
        assert struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])[0] == zlib.crc32(ctype + body)
        if ctype in (b"tEXt", b"iTXt", b"zTXt"):
            found.append((ctype, body.split(b"\0", 1)[0]))
        pos += 12 + length
    return found


def test_a1111_parameters_text():
    settings = {
        "negative_prompt": "ignored here",
        "width": 832,
        "height": 1216,
        "steps": 28,
        "cfg": 4.5,
        "sampler": "er_sde",
        "scheduler": "simple",
        "ref_weight": 1.25,
        "ref_caption": "1girl, solo",
        "mode": "cs",
    }
    text = a1111_parameters(
        "1girl, beach, sunset",
        "lowres, bad anatomy",
        settings,
        42,
        {"Model": "anima-preview", "SnapRef adapter": "snapref.safetensors", "Item id": "r1:s0"},
    )
    assert text == (
        "1girl, beach, sunset\n"
        "Negative prompt: lowres, bad anatomy\n"
        "Steps: 28, Sampler: er_sde, Schedule type: simple, CFG scale: 4.5, Seed: 42, Size: 832x1216, "
        'Ref weight: 1.25, Ref caption: "1girl, solo", Mode: cs, Model: anima-preview, '
        'SnapRef adapter: snapref.safetensors, Item id: "r1:s0"'
    )


def test_a1111_parameters_without_negative_from_render_settings():
    text = a1111_parameters("scene", "", RenderSettings(width=512, height=768).model_dump(), 7, {})
    prompt, line = text.split("\n")
    assert prompt == "scene"
    assert line.startswith(
        "Steps: 30, Sampler: er_sde, Schedule type: simple, CFG scale: 4.5, Seed: 7, Size: 512x768, "
    )
    assert "Ref weight: 1.0" in line and "Negative prompt" not in text
    assert "Ref guidance" not in line  # unset: the adapter kind's default, named once resolved


def test_png_round_trip_chunks_and_pixels():
    img = _image()
    params = a1111_parameters("1girl, cafe", "lowres", {"steps": 30, "width": 48, "height": 32}, 5, {})
    data = encode_image(img, "png", parameters=params, info=INFO)
    assert _png_text_chunks(data) == [(b"tEXt", b"parameters"), (b"iTXt", b"snapref")]
    assert read_image_info(data) == INFO
    assert read_image_parameters(data) == params
    with Image.open(io.BytesIO(data)) as back:
        assert back.format == "PNG" and back.size == (48, 32)
        assert np.array_equal(np.asarray(back), np.asarray(img))


def test_png_non_latin1_parameters_use_itxt():
    data = encode_image(_image(), "png", parameters="少女, 海辺\nSteps: 30", info={"a": 1})
    assert _png_text_chunks(data) == [(b"iTXt", b"parameters"), (b"iTXt", b"snapref")]
    assert read_image_parameters(data) == "少女, 海辺\nSteps: 30"
    assert read_image_info(data) == {"a": 1}


@pytest.mark.parametrize("fmt, pil_format", [("webp", "WEBP"), ("jpeg", "JPEG")])
def test_lossy_formats_keep_info_in_xmp_and_parameters_in_exif(fmt, pil_format):
    params = '1girl, <lora:x>, "quoted" & 日本\nSteps: 30, Seed: 5'
    data = encode_image(_image(64, 40), fmt, parameters=params, info=INFO)
    with Image.open(io.BytesIO(data)) as back:
        assert back.format == pil_format and back.size == (64, 40)
        assert b"https://github.com/snapref-ray/ns/1.0/" in back.info["xmp"]
    assert read_image_info(data) == INFO
    assert read_image_parameters(data) == params


@pytest.mark.parametrize("mode", ["RGBA", "L", "P"])
def test_jpeg_accepts_any_mode(mode):
    img = _image(mode="RGBA").convert(mode) if mode != "RGBA" else _image(mode="RGBA")
    data = encode_image(img, "jpeg", info={"x": 1})
    assert read_image_info(data) == {"x": 1}


def test_image_without_info_reads_empty():
    buf = io.BytesIO()
    _image().save(buf, "PNG")
    assert read_image_info(buf.getvalue()) == {}
    assert read_image_parameters(buf.getvalue()) == ""
    buf = io.BytesIO()
    _image().save(buf, "JPEG")
    assert read_image_info(buf.getvalue()) == {}


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match=r"image format must be one of \['jpeg', 'png', 'webp'\], got 'gif'"):
        encode_image(_image(), "gif")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "size, max_side, expected",
    [
        ((1000, 500), 256, (256, 128)),
        ((600, 1200), 256, (128, 256)),
        ((2000, 3000), 512, (341, 512)),
        ((100, 50), 256, (100, 50)),  # never enlarged
    ],
)
def test_thumbnail_sizes(size, max_side, expected):
    data = make_thumbnail(_image(*size), max_side)
    with Image.open(io.BytesIO(data)) as thumb:
        assert thumb.format == "JPEG" and thumb.mode == "RGB"
        assert thumb.size == expected


def test_thumbnail_of_rgba_and_colour_kept():
    img = Image.new("RGBA", (400, 400), (200, 30, 40, 255))
    with Image.open(io.BytesIO(make_thumbnail(img))) as thumb:
        assert thumb.size == (256, 256)
        r, g, b = thumb.getpixel((128, 128))
        assert abs(r - 200) <= 3 and abs(g - 30) <= 3 and abs(b - 40) <= 3


def test_rendered_image_writer_records_reference_and_settings():
    settings = RenderSettings(negative_prompt="lowres", steps=12, cfg=4.5, mode="char").model_dump()
    img = _image()
    data = encode_rendered_image(
        img,
        prompt="1girl, cafe",
        seed=7,
        settings=settings,
        model="dit.safetensors",
        adapter="0123456789abcdef0123",
        reference_hash="cd" * 32,
        item_id="row-0",
    )

    info = read_image_info(data)
    assert info == {
        "prompt": "1girl, cafe",
        "seed": 7,
        "settings": settings,
        "model": "dit.safetensors",
        "adapter": "0123456789abcdef0123",
        "reference_hash": "cd" * 32,
        "item_id": "row-0",
    }
    lines = read_image_parameters(data).split("\n")
    assert lines[:2] == ["1girl, cafe", "Negative prompt: lowres"]
    assert lines[2].startswith(
        "Steps: 12, Sampler: er_sde, Schedule type: simple, CFG scale: 4.5, Seed: 7, Size: 1024x1024"
    )
    assert lines[2].endswith(
        f"Model: dit.safetensors, SnapRef reference: {'cd' * 6}, SnapRef mode: char, SnapRef adapter: 0123456789abcdef"
    )
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(data))), np.asarray(img))


def test_rendered_image_writer_without_reference_names_no_snapref_fields():
    settings = RenderSettings().model_dump()
    data = encode_rendered_image(
        _image(),
        prompt="1girl",
        seed=0,
        settings=settings,
        model="m",
        adapter=None,
        fmt="webp",
        extra_info={"reference_ids": []},
    )
    assert read_image_info(data) == {
        "prompt": "1girl",
        "seed": 0,
        "settings": settings,
        "model": "m",
        "adapter": None,
        "reference_ids": [],
    }
    assert "SnapRef" not in read_image_parameters(data)
