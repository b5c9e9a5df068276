"""A reference's identity, and the key its RefKV is cached under: one rule for every front door.

A reference is one image of one character (`single`), two characters stitched left and right
(`pair`), or several images of one character read together (`multi`). Its identity is a content
hash: the sha256 of the file for one image; for a pair or several images, a sha256 over the layout
and the member hashes in order, so the same files in the same roles are the same reference in a job,
in Ray Data, over HTTP and on the command line — and a job's `reference_hash` column, an image's
`snapref` chunk and an endpoint upload's `content_hash` agree.

What a RefKV is valid for is more than the pixels: the reference's caption and size, and the target
token grid it was encoded for (RoPE offsets depend on it). `RefKVKey` holds exactly those.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from snapref_ray.adapter.images import content_hash
from snapref_ray.requests import RenderSettings

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
        return cls(
            reference_hash, settings.ref_caption, settings.ref_megapixels, settings.height // 16, settings.width // 16
        )

    @property
    def width(self) -> int:
        return self.grid_w * 16

    @property
    def height(self) -> int:
        return self.grid_h * 16

    def token(self) -> str:
        """The key as one string (Serve's multiplexed model id, log lines); the caption enters as a hash."""
        caption = hashlib.sha256(self.ref_caption.encode()).hexdigest()[:16]
        return f"{self.reference_hash}:{self.width}x{self.height}:{self.ref_megapixels!r}mp:{caption}"
