"""The render service decides what a render reads of its reference (render_service/service.py `read_reference`), and
every front door checks a reference the same way before any device work (render_service/references.py)."""

from __future__ import annotations

import pytest

from snapref_ray.adapter.images import ReferenceImageError
from snapref_ray.render_service.references import Reference, ReferenceIdentity, RefKVKey, check_reference
from snapref_ray.requests import RenderError, RenderRequest, RenderSettings

SMALL = RenderSettings(width=256, height=256, steps=1, cfg=1.0, sampler="euler")
RECOMPUTE = SMALL.model_copy(update={"recompute_reference_every_step": True})


class Loads:
    """A reference's `load`, counting its calls (the service must read the files only when it needs them)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.calls = data, 0

    def __call__(self) -> list[bytes]:
        self.calls += 1
        return [self.data]


def _reference(data: bytes, load: Loads, fetch=None) -> Reference:
    key = RefKVKey.for_settings(ReferenceIdentity.of_images("single", [data]).hash, SMALL)
    return Reference(key, "single", ("reference.png",), load, fetch)


@pytest.mark.slow  # a few tiny encodes and renders on the CPU
def test_a_refkv_is_encoded_once_then_read_from_the_cache_and_encode_s_says_which(service, reference_png):
    load = Loads(reference_png)
    first = service.read_reference(_reference(reference_png, load), SMALL)
    again = service.read_reference(_reference(reference_png, load), SMALL)
    assert (first.source, again.source, load.calls) == ("encoded", "cache", 1)
    assert first.encode_s > 0 and again.encode_s == 0 and again.refkv is first.refkv and first.images is None
    request = RenderRequest(prompt="1girl", settings=SMALL)
    (rendered,) = service.render([request], reference=_reference(reference_png, load))
    assert (rendered.reference_source, rendered.timings["encode_s"], load.calls) == ("cache", 0.0, 1)
    assert rendered.reference_hash == first.reference.hash


@pytest.mark.slow  # a few tiny encodes and renders on the CPU
def test_a_refkv_someone_else_holds_is_fetched_without_reading_the_files(service, reference_png, tiny_renderer):
    held = tiny_renderer.encode_reference([reference_png], width=256, height=256)
    load = Loads(reference_png)
    read = service.read_reference(_reference(reference_png, load, fetch=lambda: held), SMALL)
    assert (read.source, read.encode_s, load.calls) == ("fetched", 0.0, 0) and read.refkv is held


@pytest.mark.slow  # a few tiny encodes and renders on the CPU
def test_recompute_reference_every_step_reads_the_images_at_every_door(service, reference_png):
    load = Loads(reference_png)
    read = service.read_reference(_reference(reference_png, load), RECOMPUTE)
    assert (read.source, read.refkv, read.images, load.calls) == ("recomputed", None, (reference_png,), 1)
    assert len(service.cache) == 0  # nothing was encoded for the cache
    (rendered,) = service.render([RenderRequest(prompt="1girl", settings=RECOMPUTE)], reference=read)
    # encode_s: the images' preparation inside the render (the stream itself runs at every step).
    assert rendered.reference_source == "recomputed" and rendered.timings["encode_s"] > 0
    # A read made for other settings is not silently reused.
    with pytest.raises(RenderError, match="recompute_reference_every_step differs") as refused:
        service.render([RenderRequest(prompt="1girl", settings=SMALL)], reference=read)
    assert refused.value.field == "recompute_reference_every_step"


def test_a_reference_is_checked_the_same_way_at_every_door(reference_png):
    check_reference([reference_png, reference_png], "multi", ["a.png", "b.png"], "snapref")
    with pytest.raises(ReferenceImageError, match=r"^b\.png: not an image format PIL can read") as unreadable:
        check_reference([reference_png, b"not an image"], "pair", ["a.png", "b.png"], "snapref")
    # The error names the file and the reason as fields: no door finds the file by parsing the message.
    assert unreadable.value.source == "b.png"
    assert unreadable.value.reason.startswith("not an image format PIL can read")
    with pytest.raises(RenderError, match="several references of one character are a SnapRef feature") as refused:
        check_reference([reference_png, reference_png], "multi", ["a.png", "b.png"], "arcanima-v2")
    assert refused.value.field == "layout"
    assert refused.value.reason == str(refused.value).removeprefix("layout: ")
    check_reference([reference_png, reference_png], "pair", ["a.png", "b.png"], "arcanima-v2")
