"""A reference's identity, and the key its RefKV is cached under: one rule for every front door.

A reference is one image of one character (`single`), two characters stitched left and right
(`pair`), or several images of one character read together (`multi`). Its identity is a content
hash: the sha256 of the file for one image; for a pair or several images, a sha256 over the layout
and the member hashes in order, so the same files in the same roles are the same reference in a job,
in Ray Data, over HTTP and on the command line — and a job's `reference_hash` column, an image's
`snapref` chunk and an endpoint upload's `content_hash` agree.

What a RefKV is valid for is more than the pixels: the reference's caption and size, and the target
token grid it was encoded for (RoPE offsets depend on it). `RefKVKey` holds exactly those.

`Reference` is a render's reference as every front door hands it to the render service: its key, its
layout, a name per image and how to load the images (and, in a job, where a RefKV encoded elsewhere may
be fetched). The door only carries it; whether the render reads a cached RefKV or the images themselves
is the service's decision (`RenderService.read_reference`). `check_reference` is the one check a door
runs on a reference before any device work (docs/design.md, "The front-door contract").
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from snapref_ray.adapter.images import ReferenceImageError as ReferenceImageError  # raised by check_reference
from snapref_ray.adapter.images import content_hash, fitted_size, open_reference, stitch_side_by_side
from snapref_ray.geometry import PIXELS_PER_TOKEN, token_grid
from snapref_ray.requests import RenderError, RenderSettings

if TYPE_CHECKING:  # Serve's ingress imports this module without torch
    from PIL import Image

    from snapref_ray.adapter.refkv import RefKV

Layout = Literal["single", "pair", "multi"]
LAYOUTS: tuple[str, ...] = ("single", "pair", "multi")


def reference_hash(layout: str, member_hashes: Sequence[str]) -> str:
    """The identity of a reference from its members' content hashes (see the module docstring)."""
    if layout not in LAYOUTS:
        raise ValueError(f"reference layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if layout == "single":
        if len(member_hashes) != 1:
            raise ValueError(f"a single reference has one image, got {len(member_hashes)}")
        return member_hashes[0]
    return hashlib.sha256("\n".join([layout, *member_hashes]).encode()).hexdigest()


@dataclass(frozen=True)
class ReferenceIdentity:
    """A reference's layout and the content hashes of its images, in order; `hash` is its identity."""

    layout: Layout
    member_hashes: tuple[str, ...]

    @property
    def hash(self) -> str:
        return reference_hash(self.layout, self.member_hashes)

    @classmethod
    def of_images(cls, layout: Layout, images: Sequence[bytes]) -> ReferenceIdentity:
        return cls(layout, tuple(content_hash(data) for data in images))


@dataclass(frozen=True)
class ReferenceInput:
    """A reference as a request names it: its images (paths/URIs, or the image bytes themselves), in
    order, how they are read together, and the column or field each came from (for messages)."""

    members: tuple[bytes | str, ...]
    layout: Layout
    columns: tuple[str, ...]

    def sources(self) -> list[str]:
        """A name per member for messages and metadata: the path/URI, or ``inline:<column>``."""
        return [m if isinstance(m, str) else f"inline:{c}" for m, c in zip(self.members, self.columns)]

    @property
    def uris(self) -> tuple[str, ...]:
        """The members that are paths or URIs (all of them for a job's references)."""
        return tuple(m for m in self.members if isinstance(m, str))


@dataclass(frozen=True)
class RefKVKey:
    """Everything a cached RefKV depends on besides the loaded adapter (each renderer caches its own)."""

    reference_hash: str
    ref_caption: str
    ref_megapixels: float
    grid_h: int  # target token grid: height // 16 (VAE 8 x patch 2)
    grid_w: int

    @classmethod
    def for_settings(cls, reference_hash: str, settings: RenderSettings) -> RefKVKey:
        return cls.for_size(
            reference_hash, settings.ref_caption, settings.ref_megapixels, width=settings.width, height=settings.height
        )

    @classmethod
    def for_size(
        cls, reference_hash: str, ref_caption: str, ref_megapixels: float, *, width: int, height: int
    ) -> RefKVKey:
        """The key of a reference read for a target of `width` x `height` pixels."""
        return cls(reference_hash, ref_caption, ref_megapixels, *token_grid(height=height, width=width))

    @property
    def width(self) -> int:
        return self.grid_w * PIXELS_PER_TOKEN

    @property
    def height(self) -> int:
        return self.grid_h * PIXELS_PER_TOKEN

    def token(self) -> str:
        """The key as one string (Serve's multiplexed model id, log lines); the caption enters as a hash."""
        caption = hashlib.sha256(self.ref_caption.encode()).hexdigest()[:16]
        return f"{self.reference_hash}:{self.width}x{self.height}:{self.ref_megapixels!r}mp:{caption}"


@dataclass(frozen=True)
class Reference:
    """A render's reference as a front door hands it to `RenderService.render` / `read_reference`.

    `load()` returns the image files' bytes in order; the service calls it only when it needs them (a
    cache miss, or `recompute_reference_every_step`), on the thread that renders. `fetch()` is a RefKV
    someone else holds (a job's object store), None when it is gone; the service tries it before
    encoding. `sources` name the images in messages and metadata (paths or URIs, ``inline:<column>``,
    ``reference <id>``).
    """

    key: RefKVKey
    layout: Layout
    sources: tuple[str, ...]
    load: Callable[[], Sequence[bytes]] = field(repr=False, compare=False)
    fetch: Callable[[], RefKV | None] | None = field(default=None, repr=False, compare=False)

    @property
    def hash(self) -> str:
        """The reference's identity (see the module docstring)."""
        return self.key.reference_hash

    @classmethod
    def of_images(
        cls, images: Sequence[bytes], layout: Layout, settings: RenderSettings, sources: Sequence[str]
    ) -> Reference:
        """A reference whose files are already in memory (the command line, Ray Data, an upload)."""
        files = tuple(images)
        identity = ReferenceIdentity.of_images(layout, files)
        return cls(RefKVKey.for_settings(identity.hash, settings), layout, tuple(sources), lambda: files)


@dataclass(frozen=True)
class CheckedImage:
    """A reference image that decodes: its content hash and its size (fitted to the megapixels asked, if any)."""

    content_hash: str
    width: int
    height: int


def check_reference(
    images: Sequence[bytes],
    layout: str,
    sources: Sequence[str],
    adapter_kind: str | None,
    *,
    megapixels: float | None = None,
) -> list[CheckedImage]:
    """Refuse, before any device work, a reference the render could not read: an image that does not decode
    (`ReferenceImageError` naming its source) or a layout the loaded adapter kind does not read
    (`RenderError` with field "layout"). Every front door runs this same check. Per image it returns the
    content hash and the size: as decoded, or, given `megapixels`, the size the image is encoded at (an image
    too elongated to fit is refused too); Serve's uploads report that."""
    refused = layout_refusal(layout, adapter_kind)
    if refused:
        raise RenderError(f"layout: {refused}", field="layout", reason=refused)
    checked = []
    for data, source in zip(images, sources):
        with open_reference(data, source) as img:
            size = img.size if megapixels is None else fitted_size(img.size, megapixels)
        checked.append(CheckedImage(content_hash(data), *size))
    return checked


def reference_picture(images: Sequence[bytes], sources: Sequence[str], layout: str) -> Image.Image:
    """A reference's images as one picture: a pair side by side, else the first image."""
    pictures = [open_reference(data, source) for data, source in zip(images, sources)]
    return stitch_side_by_side(*pictures) if layout == "pair" else pictures[0]


def layout_refusal(layout: str, adapter_kind: str | None) -> str | None:
    """Why `adapter_kind` does not read references laid out as `layout`; None when it does."""
    if layout == "single":  # every kind reads one image of one character (and Serve's ingress has no torch)
        return None
    from snapref_ray.adapter.kinds import KINDS

    kind = KINDS.get(adapter_kind or "snapref")
    return kind.refused_layouts.get(layout) if kind is not None else None
