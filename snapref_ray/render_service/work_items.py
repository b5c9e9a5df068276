"""A unit of work and its stable id: one image to render (reference, scene prompt, seed, settings as rendered).

What every door that names its images agrees on: a batch job's planning (snapref_ray/jobs/manifest_check.py) makes
`WorkItem`s and the cluster renders them; the Ray Data door gives its rows the same `item_id_for`, so one image has
one id whichever door rendered it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

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

    def request(self) -> RenderRequest:
        """The item as the one request model (prompt, seed, settings)."""
        return RenderRequest(prompt=self.prompt, seed=self.seed, settings=self.settings)


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


def settings_json(settings: RenderSettings) -> str:
    """The settings that are set, as the canonical JSON an item id hashes (computed once per distinct settings)."""
    chosen = {k: v for k, v in settings.model_dump(mode="json").items() if v is not None}
    return json.dumps(chosen, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def item_id_for_json(
    explicit_id: str | None, image_index: int, reference_hash: str, prompt: str, seed: int, settings_json: str
) -> str:
    """`item_id_for` with the settings already as their canonical JSON (a job plans many items per settings)."""
    if explicit_id is not None:
        return f"{explicit_id}-{image_index}"
    # The canonical JSON of item_id_for's docstring, written out: its four keys in sorted order.
    canonical = (
        f'{{"prompt":{_json_text(prompt)},"reference":{_json_text(reference_hash)},'
        f'"seed":{int(seed)},"settings":{settings_json}}}'
    )
    return hashlib.sha256(canonical.encode()).hexdigest()[:20]


# What json.dumps(text, ensure_ascii=False) returns for a str, without building an encoder per call.
_json_text = json.encoder.encode_basestring
