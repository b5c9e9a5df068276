"""Reference images: every PIL mode to RGB, EXIF, refusals of broken and oversized data, fitting, stitching."""

from __future__ import annotations

import hashlib
import io
import math
import struct
import zlib

import pytest
import torch
from PIL import Image

from snapref_ray.adapter import (
    MAX_REFERENCE_PIXELS,
    ReferenceImageError,
    content_hash,
    fit_megapixels,
    image_to_pixels,
    open_reference,
    prepare_reference,
    stitch_side_by_side,
)


def encode(img: Image.Image, fmt: str = "PNG", **kwargs) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kwargs)
    return buf.getvalue()


def png(width: int, height: int, bit_depth: int, color_type: int, rows: bytes | None = None) -> bytes:
    """A PNG written by hand: lets a test claim any size, or use 16-bit colour PIL cannot write."""

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    idat = chunk(b"IDAT", zlib.compress(rows)) if rows is not None else b""
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + idat + chunk(b"IEND", b"")


def rgb(img: Image.Image, xy: tuple[int, int]) -> tuple[int, int, int]:
    assert img.mode == "RGB"
    return img.getpixel(xy)


# ---------------------------------------------------------------------------------------------
# Modes


def test_rgb_passes_through():
    img = Image.new("RGB", (8, 4), (10, 20, 30))
    out = open_reference(encode(img))
    assert out.size == (8, 4) and rgb(out, (7, 3)) == (10, 20, 30)


def test_palette():
    p = Image.new("P", (2, 1))
    p.putpalette([200, 10, 10, 10, 200, 10] + [0] * 762)
    p.putpixel((1, 0), 1)
    out = open_reference(encode(p))
    assert (rgb(out, (0, 0)), rgb(out, (1, 0))) == ((200, 10, 10), (10, 200, 10))


def test_palette_with_transparent_index_goes_on_white():
    p = Image.new("P", (2, 1))
    p.putpalette([0, 0, 0, 10, 200, 10] + [0] * 762)
    p.putpixel((1, 0), 1)
    out = open_reference(encode(p, transparency=0))
    assert (rgb(out, (0, 0)), rgb(out, (1, 0))) == ((255, 255, 255), (10, 200, 10))


def test_rgba_is_composited_on_white():
    img = Image.new("RGBA", (3, 1))
    img.putpixel((0, 0), (0, 0, 0, 0))  # fully transparent black -> white, not black
    img.putpixel((1, 0), (255, 0, 0, 128))  # half red over white
    img.putpixel((2, 0), (0, 0, 255, 255))  # opaque stays
    out = open_reference(encode(img))
    assert rgb(out, (0, 0)) == (255, 255, 255)
    r, g, b = rgb(out, (1, 0))
    assert r == 255 and abs(g - 127) <= 1 and abs(b - 127) <= 1
    assert rgb(out, (2, 0)) == (0, 0, 255)


def test_la_is_composited_on_white():
    img = Image.new("LA", (2, 1))
    img.putpixel((0, 0), (0, 0))
    img.putpixel((1, 0), (40, 255))
    out = open_reference(encode(img))
    assert (rgb(out, (0, 0)), rgb(out, (1, 0))) == ((255, 255, 255), (40, 40, 40))


def test_cmyk():
    img = Image.new("CMYK", (4, 4), (0, 255, 255, 0))  # no cyan/black, full magenta+yellow = red
    out = open_reference(encode(img, "TIFF"))
    assert rgb(out, (1, 1)) == (255, 0, 0)


def test_greyscale():
    out = open_reference(encode(Image.new("L", (4, 2), 77)))
    assert rgb(out, (3, 1)) == (77, 77, 77)


def test_i16_is_scaled_not_clipped():
    img = Image.new("I;16", (3, 1))
    for x, v in enumerate((65535, 128 * 257, 0)):
        img.putpixel((x, 0), v)
    data = encode(img)
    assert Image.open(io.BytesIO(data)).mode == "I;16"
    out = open_reference(data)
    assert [rgb(out, (x, 0)) for x in range(3)] == [(255, 255, 255), (128, 128, 128), (0, 0, 0)]


def test_16_bit_rgb_png():
    row = b"\x00" + struct.pack(">6H", 65535, 0, 128 * 257, 0, 65535, 0)
    out = open_reference(png(2, 1, 16, 2, row))
    assert (rgb(out, (0, 0)), rgb(out, (1, 0))) == ((255, 0, 128), (0, 255, 0))


def test_16_bit_grey_alpha_png():
    row = b"\x00" + struct.pack(">4H", 0, 0, 0, 65535)  # transparent black, opaque black
    out = open_reference(png(2, 1, 16, 4, row))
    assert (rgb(out, (0, 0)), rgb(out, (1, 0))) == ((255, 255, 255), (0, 0, 0))


def test_exif_orientation_is_applied():
    img = Image.new("RGB", (40, 20), (0, 0, 255))
    img.putpixel((0, 0), (255, 0, 0))
    exif = img.getexif()
    exif[0x0112] = 6  # "rotate 90° clockwise to display"
    out = open_reference(encode(img, exif=exif))
    assert out.size == (20, 40)
    assert rgb(out, (19, 0)) == (255, 0, 0)  # the top-left corner ends up top-right
    assert rgb(out, (0, 0)) == (0, 0, 255)


def test_first_frame_of_animation():
    frames = [Image.new("RGB", (4, 4), c) for c in ((255, 0, 0), (0, 255, 0))]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
    assert rgb(open_reference(data), (0, 0)) == (255, 0, 0)


# ---------------------------------------------------------------------------------------------
# Refusals


def test_empty_data():
    with pytest.raises(ReferenceImageError) as e:
        open_reference(b"", "upload 'a.png'")
    assert str(e.value) == "upload 'a.png': empty file (0 bytes), expected an image"


def test_text_file():
    with pytest.raises(ReferenceImageError) as e:
        open_reference(b"just some text\n", "notes.txt")
    assert str(e.value) == "notes.txt: not an image format PIL can read (15 bytes, starting b'just some text\\n')"


def test_truncated_png():
    noise = Image.frombytes("RGB", (64, 64), bytes(range(256)) * 48)
    data = encode(noise)
    with pytest.raises(
        ReferenceImageError,
        match=r"^ref\.png: cannot decode the image, the file is truncated or"
        r" corrupt \(OSError: ",
    ):
        open_reference(data[: len(data) // 2], "ref.png")


def test_png_cut_inside_header():
    data = encode(Image.new("RGB", (8, 8)))
    with pytest.raises(ReferenceImageError, match=r"^ref\.png: "):
        open_reference(data[:20], "ref.png")


def test_corrupt_jpeg():
    data = bytearray(encode(Image.new("RGB", (64, 64), (9, 9, 9)), "JPEG"))
    data[200:] = b"\xff" * (len(data) - 200)
    with pytest.raises(ReferenceImageError, match="^bad.jpg: "):
        open_reference(bytes(data), "bad.jpg")


def test_decompression_bomb_is_refused_from_the_header():
    # 81 M pixels: under PIL's own limit (89 M), over ours. The file is a few dozen bytes and no
    # pixel is ever decoded.
    with pytest.raises(ReferenceImageError) as e:
        open_reference(png(9_000, 9_000, 8, 2), "bomb.png")
    assert str(e.value) == (
        f"bomb.png: image is 9000x9000 = 81,000,000 pixels, more than the"
        f" {MAX_REFERENCE_PIXELS:,} allowed for a reference (possible decompression bomb)"
    )


@pytest.mark.parametrize("side", [50_000, 10_000])
def test_pils_bomb_checks_become_our_error(side):
    # 2.5 G pixels makes PIL raise DecompressionBombError while opening, 100 M makes it warn.
    with pytest.raises(ReferenceImageError) as e:
        open_reference(png(side, side, 8, 2), "bomb.png")
    assert str(e.value).startswith(
        f"bomb.png: refused as a possible decompression bomb: Image size ({side * side} pixels) exceeds limit of"
    )


def test_our_limit_does_not_depend_on_pils(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    with pytest.raises(ReferenceImageError, match="81,000,000 pixels"):
        open_reference(png(9_000, 9_000, 8, 2))


def test_pils_bomb_error_becomes_ours(monkeypatch):
    # With PIL's limit set below ours, PIL refuses first: that must still be a ReferenceImageError.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(ReferenceImageError, match=r"^big\.png: refused as a possible decompression bomb: "):
        open_reference(encode(Image.new("RGB", (100, 100))), "big.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 8000)  # 10,000 px: over the warning level, under the error
    with pytest.raises(ReferenceImageError, match=r"^big\.png: refused as a possible decompression bomb: "):
        open_reference(encode(Image.new("RGB", (100, 100))), "big.png")


def test_real_but_large_compressible_image_is_fine():
    img = Image.new("RGB", (4000, 3000), (250, 250, 250))  # 12 MP of one colour: a few kB as PNG
    out = open_reference(encode(img))
    assert out.size == (4000, 3000)


# ---------------------------------------------------------------------------------------------
# Fitting, stitching, pixels


@pytest.mark.parametrize(
    "size, megapixels, expected",
    [
        ((1024, 1024), 1.0, (992, 992)),  # 1,048,576 px > 1e6: scaled to 1000x1000, then down to 992
        ((4000, 3000), 1.0, (1152, 864)),  # 1154.7x866.0 -> multiples of 16
        ((832, 1216), 1.0, (816, 1200)),  # 1.01 MP -> 827x1209 -> 816x1200
        ((500, 300), 1.0, (496, 288)),  # small: never enlarged, only rounded down
        ((512, 768), 1.0, (512, 768)),  # already fine: unchanged
        ((3000, 1000), 0.25, (864, 288)),  # 866.0x288.7
    ],
)
def test_fit_megapixels(size, megapixels, expected):
    img = Image.new("RGB", size, (1, 2, 3))
    out = fit_megapixels(img, megapixels)
    assert out.size == expected
    w, h = out.size
    assert w % 16 == 0 and h % 16 == 0
    assert w * h <= megapixels * 1e6
    assert w <= size[0] and h <= size[1]
    # Aspect kept up to the rounding to 16 px (one step on each side at most).
    assert abs(w / h - size[0] / size[1]) <= (16 / h) * (1 + size[0] / size[1])


def test_fit_returns_same_image_when_nothing_changes():
    img = Image.new("RGB", (512, 768))
    assert fit_megapixels(img) is img


def test_fit_keeps_content():
    img = Image.new("RGB", (2000, 1000), (255, 0, 0))
    img.paste((0, 0, 255), (1000, 0, 2000, 1000))
    out = fit_megapixels(img, 0.5)
    assert out.size == (992, 496)
    assert rgb(out, (10, 10)) == (255, 0, 0) and rgb(out, (981, 485)) == (0, 0, 255)


def test_fit_refuses_slivers():
    with pytest.raises(
        ReferenceImageError,
        match=r"a 4000x10 reference fitted to 1.0 MP would be 4000x10, less than"
        r" 16 px on a side",
    ):
        fit_megapixels(Image.new("RGB", (4000, 10)))
    with pytest.raises(ValueError, match="megapixels must be > 0"):
        fit_megapixels(Image.new("RGB", (64, 64)), 0)


def test_stitch_side_by_side():
    left = Image.new("RGB", (300, 600), (255, 0, 0))
    right = Image.new("RGB", (200, 400), (0, 0, 255))
    out = stitch_side_by_side(left, right)
    assert out.size == (200 + 200, 400)  # the taller one is scaled down to the smaller height: 300x600 -> 200x400
    assert rgb(out, (0, 0)) == (255, 0, 0) and rgb(out, (199, 399)) == (255, 0, 0)
    assert rgb(out, (200, 0)) == (0, 0, 255) and rgb(out, (399, 399)) == (0, 0, 255)
    same = stitch_side_by_side(right, right.copy())
    assert same.size == (400, 400)


def test_image_to_pixels():
    img = Image.new("RGB", (3, 2), (0, 0, 0))
    img.putpixel((2, 1), (255, 128, 0))
    px = image_to_pixels(img)
    assert px.shape == (1, 3, 2, 3) and px.dtype == torch.float32
    assert px[0, :, 1, 2].tolist() == pytest.approx([1.0, 128 / 127.5 - 1, -1.0], abs=1e-6)
    assert px[0, :, 0, 0].tolist() == [-1.0, -1.0, -1.0]


def test_content_hash():
    data = encode(Image.new("RGB", (4, 4)))
    assert content_hash(data) == hashlib.sha256(data).hexdigest()
    assert content_hash(data) != content_hash(data + b"\x00")


def test_prepare_single():
    (px,) = prepare_reference([encode(Image.new("RGB", (1600, 900), (255, 255, 255)))], layout="single")
    assert px.shape == (1, 3, 736, 1328)  # 1333.3x750 -> multiples of 16
    assert float(px.min()) == 1.0


def test_prepare_pair_stitches_left_then_right():
    left = encode(Image.new("RGB", (600, 1200), (255, 0, 0)))
    right = encode(Image.new("RGBA", (400, 800), (0, 0, 255, 255)))
    (px,) = prepare_reference([left, right], layout="pair", megapixels=0.5)
    _, _, h, w = px.shape
    assert h % 16 == 0 and w % 16 == 0 and h * w <= 0.5e6
    assert abs(w / h - 1.0) < 0.05  # two 1:2 portraits side by side make a square
    assert px[0, :, h // 2, 5].tolist() == [1.0, -1.0, -1.0]  # red on the left
    assert px[0, :, h // 2, w - 5].tolist() == [-1.0, -1.0, 1.0]  # blue on the right


def test_prepare_multi_keeps_each():
    images = [encode(Image.new("RGB", (64, 64))), encode(Image.new("RGB", (2000, 1000)))]
    out = prepare_reference(images, layout="multi")
    assert [tuple(p.shape) for p in out] == [(1, 3, 64, 64), (1, 3, 704, 1408)]


@pytest.mark.parametrize(
    "layout, n, message",
    [
        ("single", 2, "reference layout 'single' needs exactly 1 image(s), got 2"),
        ("pair", 1, "reference layout 'pair' needs exactly 2 image(s), got 1"),
        ("multi", 0, "reference layout 'multi' needs at least 1 image(s), got 0"),
        ("grid", 1, "reference layout must be one of single, pair, multi, found 'grid'"),
    ],
)
def test_prepare_counts(layout, n, message):
    images = [encode(Image.new("RGB", (32, 32)))] * n
    with pytest.raises(ReferenceImageError) as e:
        prepare_reference(images, layout=layout)  # type: ignore[arg-type]
    assert str(e.value) == message


def test_prepare_names_the_bad_source():
    good = encode(Image.new("RGB", (32, 32)))
    with pytest.raises(ReferenceImageError, match=r"^reference image 2: empty file"):
        prepare_reference([good, b""], layout="pair")
    with pytest.raises(ReferenceImageError, match=r"^s3://bucket/b\.png: not an image"):
        prepare_reference([good, b"<html>"], layout="multi", sources=["s3://bucket/a.png", "s3://bucket/b.png"])


def test_limits_are_sane():
    assert MAX_REFERENCE_PIXELS == 64_000_000
    assert math.isclose(MAX_REFERENCE_PIXELS / 1e6, 64)
