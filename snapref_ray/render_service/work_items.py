"""A unit of work and its stable id: one image to render (reference, scene prompt, seed, settings as rendered).

What every door that names its images agrees on: a batch job's planning (snapref_ray/jobs/manifest_check.py) makes
`WorkItem`s and the cluster renders them; the Ray Data door gives its rows the same `item_id_for`, so one image has
one id whichever door rendered it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace

from snapref_ray.render_service.references import ReferenceInput
from snapref_ray.requests import RenderRequest, RenderSettings


@dataclass(frozen=True)
class WorkItem:
    """One image to render: reference + scene prompt + seed + settings (as rendered), with a stable id."""

    item_id: str
    manifest_row: int
    reference: ReferenceInput  # paths / URIs (a job's references are files)
    reference_hash: str  # render_service/references.py: the content hash, or the pair's / several images' hash
    prompt: str
    seed: int
    settings: RenderSettings  # resolved for the job's adapter kind
    image_index: int  # k-th image of its row
    # The content id (item_id_for without an explicit id) where item_id is an explicit one, else None (item_id is it):
    # what a resume compares a committed explicit id against (storage/item_contents.py).
    content_id: str | None = None
    # A judged job's re-render (`rerender_of`): the manifest item it renders again, and which render it is.
    render_of: str | None = None  # None: the item's first render (render 0), whose id is the item's
    render_index: int = 0

    def request(self) -> RenderRequest:
        """The item as the one request model (prompt, seed, settings)."""
        return RenderRequest(prompt=self.prompt, seed=self.seed, settings=self.settings)


def render_seed(seed: int, render_index: int) -> int:
    """The seed of an item's render `render_index`: its own seed for render 0; for render k > 0, the first 8
    bytes (big-endian) of sha256 of the ASCII text "<seed>:<k>", top bit cleared (seeds are < 2**63). A hash,
    not seed + k: an item's image k of a row already uses seed + k, and re-renders must not repeat them."""
    if render_index == 0:
        return seed
    digest = hashlib.sha256(f"{int(seed)}:{int(render_index)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


def render_id(item_id: str, render_index: int) -> str:
    """The row id of an item's render `render_index`: the item's id for render 0, else "<item_id>-r<k>" (no '.'
    or '/': a webdataset member key; no item id of a plan ends in "-r<k>": explicit ids end "-<image index>",
    hashed ones are hex)."""
    return item_id if render_index == 0 else f"{item_id}-r{render_index}"


def rerender_of(item: WorkItem, render_index: int) -> WorkItem:
    """Render `render_index` of a plan's `item` (render 0 is the item itself): its id, seed and place in the
    sequence; the reference, prompt and settings stay the item's."""
    if render_index == 0:
        return item
    return replace(
        item,
        item_id=render_id(item.item_id, render_index),
        seed=render_seed(item.seed, render_index),
        render_of=item.item_id,
        render_index=render_index,
    )


def item_id_for(
    explicit_id: str | None, image_index: int, reference_hash: str, prompt: str, seed: int, settings: RenderSettings
) -> str:
    """Stable item id: "<id>-<image index>" for rows with an id, else a hash of what makes the image.

    `settings` are the resolved ones (as rendered), so the id is the image's and not the wording of
    the request: a row that spells out an adapter kind's default gets the id of one that leaves it unset.
    The hash is sha256 of the canonical JSON (sorted keys, no spaces, UTF-8) of
    ``{"reference", "prompt", "seed", "settings": the settings that are set}``, cut to 20 hex digits.
    """
    return item_id_for_json(explicit_id, image_index, reference_hash, prompt, seed, settings_json(settings))


def content_id_for(reference_hash: str, prompt: str, seed: int, settings: RenderSettings) -> str:
    """The id an item has without an explicit id: a hash of what makes its image (see item_id_for). A metadata row
    records it beside an explicit id, so that a row edited under the same id is seen (storage/item_contents.py)."""
    return item_id_for_json(None, 0, reference_hash, prompt, seed, settings_json(settings))


def settings_json(settings: RenderSettings) -> str:
    """The settings that are set, as the canonical JSON an item id hashes (computed once per distinct settings)."""
    chosen = {k: v for k, v in settings.model_dump(mode="json").items() if v is not None}
    return json.dumps(chosen, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def item_id_for_json(
    explicit_id: str | None, image_index: int, reference_hash: str, prompt: str, seed: int, settings_json: str
) -> str:
    """`item_id_for` with the settings already as their canonical JSON (a job plans many items per settings)."""
    if explicit_id is not None:
        return _explicit_item_id(explicit_id, image_index)
    # The canonical JSON of item_id_for's docstring, written out: its four keys in sorted order.
    canonical = (
        f'{{"prompt":{_json_text(prompt)},"reference":{_json_text(reference_hash)},'
        f'"seed":{int(seed)},"settings":{settings_json}}}'
    )
    return hashlib.sha256(canonical.encode()).hexdigest()[:20]


def _explicit_item_id(explicit_id: str, image_index: int) -> str:
    return f"{explicit_id}-{image_index}"


# What json.dumps(text, ensure_ascii=False) returns for a str, without building an encoder per call.
_json_text = json.encoder.encode_basestring
