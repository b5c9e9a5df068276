"""Reference images: bytes in, RGB pixels out, sized for the reference stream.

How a reference is prepared: docs/design.md#snapref-cached-reference-kv; pairs and several images of one
character: docs/design.md#several-references.

References arrive from users (HTTP uploads, job manifests, S3), so every input is untrusted:
any PIL mode is accepted and normalised to RGB, transparency is composited on white (the
adapter was trained on white-background character art, and black would read as a dark
outfit), EXIF orientation is applied, and anything that is not a decodable image of sane size
is refused with a ReferenceImageError that names the source and the reason.
"""

from __future__ import annotations

import hashlib
import io
import math
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from snapref_ray.geometry import PIXELS_PER_TOKEN
from snapref_ray.input_errors import InputError

if TYPE_CHECKING:  # imported where pixels are made: Serve's ingress checks images without torch
    import torch

# 64 MP: larger than any camera or scan a user would send as a character reference (the
# reference is resized to ~1 MP anyway), and small enough that decoding one stays < 256 MB.
# Checked on the header, before any pixel is decoded, independently of PIL's global limit.
MAX_REFERENCE_PIXELS = 64_000_000
# Sides must be whole tokens (16 px): the VAE downsamples by 8 and the DiT patchifies by 2.
SIDE_MULTIPLE = PIXELS_PER_TOKEN

Layout = Literal["single", "pair", "multi"]
_LAYOUT_COUNTS = {"single": "exactly 1", "pair": "exactly 2", "multi": "at least 1"}


class ReferenceImageError(InputError):
    """A reference image that cannot be used; `source` names it (None: the reference as a whole), `reason` why."""

    def __init__(self, reason: str, source: str | None = None) -> None:
        super().__init__(f"{source}: {reason}" if source is not None else reason, reason=reason, source=source)


def content_hash(data: bytes) -> str:
    """The reference's identity: sha256 hex of the file bytes (what RefKV caches are keyed by)."""
    return hashlib.sha256(data).hexdigest()


def open_reference(data: bytes, source: str = "<bytes>") -> Image.Image:
    """Decode image bytes into a fully loaded RGB image (EXIF orientation applied, alpha on white)."""
    if not data:
        raise ReferenceImageError("empty file (0 bytes), expected an image", source)
    try:
        # PIL warns at 89 MP and raises at twice that, from a process-global limit; make both
        # an exception here and convert it below. (Our own, lower limit is checked first anyway.)
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            _check_size(img.size, source)
            img.load()
            img = ImageOps.exif_transpose(img)
    except ReferenceImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ReferenceImageError(f"refused as a possible decompression bomb: {e}", source) from None
    except UnidentifiedImageError:
        raise ReferenceImageError(
            f"not an image format PIL can read ({len(data)} bytes, starting {data[:16]!r})", source
        ) from None
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, KeyError, TypeError) as e:
        # PIL's decoders report truncated or corrupt data with any of these.
        raise ReferenceImageError(
            f"cannot decode the image, the file is truncated or corrupt ({type(e).__name__}: {e})", source
        ) from None
    return _to_rgb(img, source)


def fit_megapixels(img: Image.Image, megapixels: float = 1.0, multiple: int = SIDE_MULTIPLE) -> Image.Image:
    """Shrink to an area of at most `megapixels`·1e6 keeping the aspect ratio, never enlarging,
    then round each side down to a multiple of `multiple` (LANCZOS). Returns `img` when nothing changes."""
    new_w, new_h = fitted_size(img.size, megapixels, multiple)
    if (new_w, new_h) == img.size:
        return img
    return img.resize((new_w, new_h), Image.Resampling.LANCZOS)


def fitted_size(size: tuple[int, int], megapixels: float = 1.0, multiple: int = SIDE_MULTIPLE) -> tuple[int, int]:
    """The (width, height) `fit_megapixels` gives an image of `size`, without touching its pixels."""
    if not megapixels > 0:
        raise ValueError(f"megapixels must be > 0, found {megapixels}")
    w, h = size
    limit = megapixels * 1e6
    factor = min(1.0, math.sqrt(limit / (w * h)))
    fit_w, fit_h = math.floor(w * factor), math.floor(h * factor)
    if fit_w * fit_h > limit:  # sqrt rounding can overshoot by a hair; one pixel less on the long side fixes it
        fit_w, fit_h = (fit_w - 1, fit_h) if fit_w >= fit_h else (fit_w, fit_h - 1)
    new_w = fit_w // multiple * multiple
    new_h = fit_h // multiple * multiple
    if new_w < multiple or new_h < multiple:
        raise ReferenceImageError(
            f"a {w}x{h} reference fitted to {megapixels} MP would be {fit_w}x{fit_h},"
            f" less than {multiple} px on a side; use a larger or less elongated image"
        )
    return new_w, new_h


def stitch_side_by_side(left: Image.Image, right: Image.Image) -> Image.Image:
    """Two references as one image: both scaled to the smaller height, `left` then `right`."""
    height = min(left.height, right.height)

    def at_height(img: Image.Image) -> Image.Image:
        if img.height == height:
            return img.convert("RGB")
        width = max(1, round(img.width * height / img.height))
        return img.convert("RGB").resize((width, height), Image.Resampling.LANCZOS)

    left, right = at_height(left), at_height(right)
    out = Image.new("RGB", (left.width + right.width, height), (255, 255, 255))
    out.paste(left, (0, 0))
    out.paste(right, (left.width, 0))
    return out


def fit_output_size(img: Image.Image, width: int, height: int) -> Image.Image:
    """Exactly `width` x `height`: scaled to cover the size keeping the aspect ratio, centre-cropped.

    The ArcAnima pilot reads its reference as a second frame at the output size; cropping the
    overflow keeps the character's proportions (a stretch would change them).
    """
    scale = max(width / img.width, height / img.height)
    w, h = max(width, round(img.width * scale)), max(height, round(img.height * scale))
    resized = img.resize((w, h), Image.LANCZOS)
    left, top = (w - width) // 2, (h - height) // 2
    return resized.crop((left, top, left + width, top + height))


def image_to_pixels(img: Image.Image) -> torch.Tensor:
    """RGB image -> float32 [1, 3, H, W] in [-1, 1] (the VAE's input range)."""
    import torch

    hwc = np.asarray(img.convert("RGB"), dtype=np.float32)  # [H, W, 3] in 0..255
    return torch.from_numpy(hwc).permute(2, 0, 1).unsqueeze(0).div(127.5).sub(1.0).contiguous()


def prepare_reference(
    images: Sequence[bytes], *, layout: Layout, megapixels: float = 1.0, sources: Sequence[str] | None = None
) -> list[torch.Tensor]:
    """Reference bytes -> the pixel tensors the reference stream encodes, each [1, 3, H, W].

    single: one image -> one tensor. pair: two characters stitched side by side (left, right)
    -> one tensor. multi: several references of one character -> one tensor each. Every tensor
    is fitted to `megapixels` with sides multiples of 16.
    """
    if layout not in _LAYOUT_COUNTS:
        raise ReferenceImageError(f"reference layout must be one of {', '.join(_LAYOUT_COUNTS)}, found {layout!r}")
    n = len(images)
    if (layout == "single" and n != 1) or (layout == "pair" and n != 2) or n == 0:
        raise ReferenceImageError(f"reference layout {layout!r} needs {_LAYOUT_COUNTS[layout]} image(s), got {n}")
    if sources is None:
        sources = [f"reference image {i + 1}" for i in range(n)]
    elif len(sources) != n:
        raise ValueError(f"{len(sources)} sources given for {n} reference images")
    opened = [open_reference(data, source) for data, source in zip(images, sources)]
    if layout == "pair":
        # Shrink each to the budget first so stitching two large photos stays cheap; the final
        # fit then brings the pair to the budget with sides multiples of 16.
        left, right = (fit_megapixels(img, megapixels, multiple=1) for img in opened)
        opened = [stitch_side_by_side(left, right)]
    return [image_to_pixels(fit_megapixels(img, megapixels)) for img in opened]


def _check_size(size: tuple[int, int], source: str) -> None:
    w, h = size
    if w <= 0 or h <= 0:
        raise ReferenceImageError(f"image has no pixels ({w}x{h})", source)
    if w * h > MAX_REFERENCE_PIXELS:
        raise ReferenceImageError(
            f"image is {w}x{h} = {w * h:,} pixels, more than the"
            f" {MAX_REFERENCE_PIXELS:,} allowed for a reference (possible decompression bomb)",
            source,
        )


def _to_rgb(img: Image.Image, source: str) -> Image.Image:
    """Any PIL mode -> RGB; transparency (alpha channel or a transparent palette/colour) goes on white."""
    if img.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I", "F"):
        img = _high_depth_to_l(img)
    has_alpha = img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info
    if has_alpha:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    if img.mode == "RGB":
        return img
    try:
        return img.convert("RGB")
    except ValueError as e:
        raise ReferenceImageError(f"image mode {img.mode!r} cannot be converted to RGB ({e})", source) from None


def _high_depth_to_l(img: Image.Image) -> Image.Image:
    """16/32-bit integer or float greyscale -> 8-bit L, scaling instead of clipping (PIL clips at 255)."""
    values = np.asarray(img, dtype=np.float64)
    if img.mode.startswith("I;16"):
        scaled = values / 257.0  # 0..65535 -> 0..255
    elif img.mode == "I":
        # 16-bit PNGs decode to "I" in some PIL versions; values above 255 can only mean 16-bit data.
        scaled = values / 257.0 if values.max(initial=0) > 255 else values
    else:  # "F": [0, 1] floats (common in scientific TIFFs) or already 0..255
        scaled = values * 255.0 if values.max(initial=0) <= 1.0 else values
    l_img = Image.fromarray(np.clip(np.rint(scaled), 0, 255).astype(np.uint8))  # 2-D uint8 -> mode L
    if "transparency" in img.info and isinstance(img.info["transparency"], int):
        # A tRNS grey level refers to the original 16-bit value: carry it as an alpha channel.
        alpha = np.where(values == img.info["transparency"], 0, 255).astype(np.uint8)
        return Image.merge("LA", (l_img, Image.fromarray(alpha)))
    return l_img
