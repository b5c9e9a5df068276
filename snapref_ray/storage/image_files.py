"""Image files that carry their own generation parameters.

Every image says how it was made, in the places tools already look:

- PNG: a ``parameters`` text chunk in the A1111 format (prompt, ``Negative prompt: ...``,
  ``Steps: N, Sampler: ..., CFG scale: ..., Seed: ..., Size: WxH, ...``) that WebUI-style readers
  show, and an iTXt chunk ``snapref`` with the full record as JSON (reference hash, adapter, seed,
  sampler, item id, all settings). Pillow writes ``parameters`` as tEXt, or as iTXt when the text
  is not Latin-1 (tEXt cannot hold it).
- WebP and JPEG: the A1111 text in EXIF ``UserComment`` (charset ``UNICODE``, UTF-16, as A1111
  itself writes it, so the same readers work), and the JSON in XMP as the text of a
  ``snapref:info`` element (namespace `XMP_NS`).

`read_image_info` reads the JSON back from any of the three formats.
"""

from __future__ import annotations

import io
import json
import xml.etree.ElementTree as ET
from typing import Any, Literal
from xml.sax.saxutils import escape

from PIL import ExifTags, Image
from PIL.PngImagePlugin import PngInfo

ImageFormat = Literal["png", "webp", "jpeg"]
EXTENSIONS: dict[str, str] = {"png": "png", "webp": "webp", "jpeg": "jpg"}

INFO_KEY = "snapref"
XMP_NS = "https://github.com/snapref-ray/ns/1.0/"

# Lossy formats: high enough that a dataset is not visibly degraded, far smaller than PNG.
_LOSSY_QUALITY = 95
_USER_COMMENT_UNICODE = b"UNICODE\0"


def _quote(value: Any) -> str:
    """A1111's rule: values with a comma, colon or newline are JSON-quoted so the line stays parseable."""
    text = str(value)
    return json.dumps(text, ensure_ascii=False) if any(c in text for c in ",:\n") else text


# Settings that have an A1111 name, in A1111's order; the rest keep a readable form of their own name.
_A1111_NAMES = {"steps": "Steps", "sampler": "Sampler", "scheduler": "Schedule type", "cfg": "CFG scale"}
_NOT_IN_LINE = {"negative_prompt", "width", "height", *_A1111_NAMES}


def a1111_parameters(prompt: str, negative: str, settings: dict, seed: int, extra: dict) -> str:
    """The A1111 ``parameters`` text: prompt, negative line (omitted when empty), settings line.

    The settings line starts with A1111's own keys (Steps, Sampler, Schedule type, CFG scale, Seed,
    Size), then every other setting (``ref_weight`` -> ``Ref weight``), then `extra` as given
    (model, adapter, item id, ...).
    """
    fields: list[tuple[str, Any]] = [(name, settings[key]) for key, name in _A1111_NAMES.items() if key in settings]
    fields.append(("Seed", seed))
    if "width" in settings and "height" in settings:
        fields.append(("Size", f"{settings['width']}x{settings['height']}"))
    # Unset (None) settings say nothing: they took the adapter kind's default, which a resolved copy names.
    fields += [
        (k.replace("_", " ").capitalize(), v) for k, v in settings.items() if k not in _NOT_IN_LINE and v is not None
    ]
    fields += list(extra.items())
    lines = [prompt]
    if negative:
        lines.append(f"Negative prompt: {negative}")
    lines.append(", ".join(f"{name}: {_quote(value)}" for name, value in fields))
    return "\n".join(lines)


def _xmp_packet(info_json: str) -> bytes:
    return (
        '<?xpacket begin="\ufeff" id="W5M0MpCehiHzreSzNTczkc9d"?>'
        '<x:xmpmeta xmlns:x="adobe:ns:meta/">'
        '<rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
        f'<rdf:Description rdf:about="" xmlns:snapref="{XMP_NS}">'
        f"<snapref:info>{escape(info_json)}</snapref:info>"
        "</rdf:Description></rdf:RDF></x:xmpmeta>"
        '<?xpacket end="w"?>'
    ).encode()


def encode_image(
    img: Image.Image, fmt: ImageFormat = "png", *, parameters: str = "", info: dict | None = None
) -> bytes:
    """Encode `img` with the A1111 `parameters` text and the JSON `info` embedded (see the module doc)."""
    if fmt not in EXTENSIONS:
        raise ValueError(f"image format must be one of {sorted(EXTENSIONS)}, got {fmt!r}")
    info_json = json.dumps(info or {}, ensure_ascii=False, sort_keys=True)
    buf = io.BytesIO()
    if fmt == "png":
        chunks = PngInfo()
        if parameters:
            chunks.add_text("parameters", parameters)
        chunks.add_itxt(INFO_KEY, info_json)
        # compress_level 4: most of level 9's size at a fraction of its CPU, which the uploader thread pays.
        img.save(buf, "PNG", pnginfo=chunks, compress_level=4)
    else:
        exif = Image.Exif()
        if parameters:
            exif.get_ifd(ExifTags.IFD.Exif)[ExifTags.Base.UserComment] = _USER_COMMENT_UNICODE + parameters.encode(
                "utf-16-be"
            )
        rgb = img if img.mode in ("RGB", "L") or (fmt == "webp" and img.mode == "RGBA") else img.convert("RGB")
        rgb.save(
            buf, "WEBP" if fmt == "webp" else "JPEG", quality=_LOSSY_QUALITY, exif=exif, xmp=_xmp_packet(info_json)
        )
    return buf.getvalue()


def encode_rendered_image(
    image: Image.Image,
    *,
    prompt: str,
    seed: int,
    settings: dict,
    model: str,
    adapter: str | None,
    reference_hash: str | None = None,
    item_id: str | None = None,
    fmt: ImageFormat = "png",
    extra_info: dict | None = None,
) -> bytes:
    """The one writer of rendered images: job outputs, Ray Data rows, Serve replies and `txt2img` files.

    `settings` is `RenderSettings.model_dump()`. The JSON record holds prompt, seed, settings,
    model, adapter, and the reference hash and item id where there is one (plus `extra_info`);
    the A1111 line adds ``Model``, and for renders with a reference ``SnapRef reference`` (hash
    prefix), ``SnapRef mode`` and ``SnapRef adapter``. Keeping this in one place is what makes every
    image the project writes readable by the same tools (`read_image_info`, WebUI PNG info).
    """
    info: dict = {"prompt": prompt, "seed": seed, "settings": settings, "model": model, "adapter": adapter}
    extra: dict = {"Model": model}
    if reference_hash is not None:
        info["reference_hash"] = reference_hash
        extra.update({"SnapRef reference": reference_hash[:12], "SnapRef mode": settings.get("mode", "")})
        if adapter:
            extra["SnapRef adapter"] = adapter[:16]
    if item_id is not None:
        info["item_id"] = item_id
    info.update(extra_info or {})
    parameters = a1111_parameters(prompt, settings.get("negative_prompt", ""), settings, seed, extra)
    return encode_image(image, fmt, parameters=parameters, info=info)


def _info_from_xmp(xmp: bytes | str) -> dict:
    root = ET.fromstring(xmp.encode("utf-8") if isinstance(xmp, str) else xmp)
    node = root.find(f".//{{{XMP_NS}}}info")
    return json.loads(node.text or "{}") if node is not None else {}


def read_image_info(data: bytes) -> dict:
    """The JSON record embedded by `encode_image` (PNG iTXt, or XMP for WebP/JPEG); {} if the image has none."""
    with Image.open(io.BytesIO(data)) as img:
        if img.format == "PNG":
            text = img.info.get(INFO_KEY)
            return json.loads(text) if text else {}
        xmp = img.info.get("xmp")
        return _info_from_xmp(xmp) if xmp else {}


def read_image_parameters(data: bytes) -> str:
    """The A1111 ``parameters`` text embedded by `encode_image` ('' if the image has none)."""
    with Image.open(io.BytesIO(data)) as img:
        if img.format == "PNG":
            return str(img.info.get("parameters", ""))
        raw = img.getexif().get_ifd(ExifTags.IFD.Exif).get(ExifTags.Base.UserComment)
        if not raw:
            return ""
        if raw.startswith(_USER_COMMENT_UNICODE):
            return raw[len(_USER_COMMENT_UNICODE) :].decode("utf-16-be")
        return raw[8:].decode("utf-8", errors="replace")  # ASCII / undefined charset prefix


def make_thumbnail(img: Image.Image, max_side: int = 256) -> bytes:
    """A JPEG (quality 85) whose longer side is at most `max_side`; never enlarged.

    Used for ``thumbs/`` (256) and for the gallery copy of each reference (512).
    """
    thumb = img.convert("RGB") if img.mode != "RGB" else img.copy()
    thumb.thumbnail((max_side, max_side), Image.Resampling.LANCZOS)
    buf = io.BytesIO()
    thumb.save(buf, "JPEG", quality=85)
    return buf.getvalue()
