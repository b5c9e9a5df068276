"""What the render service offers its doors instead of its renderer (render_service/service.py): the private copy
of a RefKV read from elsewhere, the reference as one picture, the identity-gap loss grids and the device."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapref_ray.render_service.references import Reference, ReferenceIdentity, RefKVKey

EXAMPLES = Path(__file__).parents[2] / "snapref_ray" / "examples" / "example_refs"


def _reference(images: list[bytes], layout: str, width: int = 256, height: int = 256) -> Reference:
    identity = ReferenceIdentity.of_images(layout, images)
    key = RefKVKey.for_size(identity.hash, "", 1.0, width=width, height=height)
    return Reference(key, layout, tuple(f"ref{i}.png" for i in range(len(images))), lambda: images)


def test_the_renderer_is_the_services_own(service):
    assert not hasattr(service, "renderer")
    described = service.device_description()
    assert (described.device, described.dtype) == ("cpu", "float32")


def test_a_refkv_from_shared_memory_becomes_a_private_copy(service, tiny_renderer, reference_png):
    shared = tiny_renderer.encode_reference([reference_png], width=256, height=256)
    private = service.private_refkv(shared)
    # Same device: the tensor would still map the other process's memory, so the cache must hold a clone.
    assert private.kv_N2HLD.data_ptr() != shared.kv_N2HLD.data_ptr()
    assert private.kv_N2HLD.equal(shared.kv_N2HLD) and private.reference_id == shared.reference_id


def test_the_reference_picture_of_a_pair_stands_side_by_side(service):
    left, right = (EXAMPLES / "blue_hair_girl.png").read_bytes(), (EXAMPLES / "brown_hair_boy.png").read_bytes()
    single = service.reference_picture(_reference([left], "single"))
    pair = service.reference_picture(_reference([left, right], "pair"))
    assert pair.height == min(single.height, service.reference_picture(_reference([right], "single")).height)
    assert pair.width > single.width


@pytest.mark.slow  # two tiny encodes and four loss evaluations on the CPU
def test_identity_gap_losses_read_each_reference_once_per_target_size(service, reference_png):
    from PIL import Image

    other = (EXAMPLES / "blue_hair_girl.png").read_bytes()
    target = Image.new("RGB", (256, 256), (128, 64, 32))
    right, wrong = _reference([reference_png], "single"), _reference([other], "single")
    first = service.identity_gap_losses(target, "1girl", right, wrong, [0.5, 0.9], [1], mode="cs", ref_weight=1.0)
    again = service.identity_gap_losses(target, "1girl", right, wrong, [0.5, 0.9], [1], mode="cs", ref_weight=1.0)
    assert (first.right_cache_hit, first.wrong_cache_hit, again.right_cache_hit) == (False, False, True)
    assert len(first.loss_right) == 2 and len(first.loss_right[0]) == 1
    assert first.loss_right == again.loss_right and first.loss_right != first.loss_wrong


class _CountingRenderer:
    """A renderer on `device` that counts the images asked of it (the warm-up's is the only render here)."""

    def __init__(self, device: str) -> None:
        self.device, self.load_seconds, self.images_rendered, self.asked = device, 0.0, 0, []

    def render(self, requests):
        self.asked.extend(r.settings for r in requests)
        self.images_rendered += len(requests)
        return []


@pytest.mark.parametrize("device, warmed", [("cpu", []), ("cuda:0", [(256, 256, 1)])])
def test_the_warm_up_image_is_rendered_on_a_gpu_and_skipped_on_a_cpu(device, warmed):
    from snapref_ray.render_service.service import RenderService

    renderer = _CountingRenderer(device)
    RenderService(renderer).warm_up_image()
    assert [(s.width, s.height, s.steps) for s in renderer.asked] == warmed
