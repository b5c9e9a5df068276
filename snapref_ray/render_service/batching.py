"""What may share one batched forward, decided in one function, and how pending work is cut into batches.

Requests share a forward when they read the same RefKV (or none) and agree on every setting but the
prompts and the seed: the schedule, guidance rows and the reference read are per forward, while each
request keeps its own prompt, negative prompt and noise (engine.py encodes one context per request).
A job's scheduler, a Serve replica's device loop and a Ray Data batch all batch by `batch_key`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from snapref_ray.render_service.references import RefKVKey
from snapref_ray.requests import RenderSettings

T = TypeVar("T")


def batch_key(reference: RefKVKey | None, settings: RenderSettings) -> tuple:
    """Requests with equal keys can share one batched forward."""
    return (reference, settings.batch_key())


def take_batch(
    pending: Sequence[T], key_of: Callable[[T], tuple], max_images: int, images_of: Callable[[T], int] = lambda _: 1
) -> tuple[list[T], list[T]]:
    """(the oldest pending item plus every later one with its key, up to `max_images`; the rest), both
    in their order. The oldest item is always taken, however many images it has."""
    if not pending:
        return [], []
    key = key_of(pending[0])
    batch, rest, images = [pending[0]], [], images_of(pending[0])
    for index in range(1, len(pending)):
        if images >= max_images:  # full: the rest stays as it is, without computing its keys
            rest.extend(pending[index:])
            break
        item = pending[index]
        if key_of(item) == key and images + images_of(item) <= max_images:
            batch.append(item)
            images += images_of(item)
        else:
            rest.append(item)
    return batch, rest


def group_batches(items: Iterable[T], key_of: Callable[[T], tuple], max_images: int) -> list[list[T]]:
    """Every item in a batch: by key, in order of first appearance, each batch at most `max_images`."""
    by_key: dict[tuple, list[T]] = {}
    for item in items:
        by_key.setdefault(key_of(item), []).append(item)
    return [group[i : i + max_images] for group in by_key.values() for i in range(0, len(group), max_images)]


def rows_per_image(settings: RenderSettings, reads_reference: bool) -> int:
    """Rows one image runs per step: cond, uncond when CFG is on, and the reference-guidance row."""
    rows = 1 + (settings.cfg != 1.0)
    if reads_reference and settings.ref_guidance not in (None, 1.0):
        rows += 1
    return rows


def batch_shape(settings: RenderSettings) -> tuple[int, int, int]:
    """(width, height, rows per image) of a job's forward (its items read a reference): what its memory grows
    with, counted as the render service's memory fit counts it."""
    return settings.width, settings.height, rows_per_image(settings, reads_reference=True)
