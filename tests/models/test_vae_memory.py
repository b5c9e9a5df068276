"""The VAE within memory: per-image equals batched, tiled equals untiled, plans, estimates, peaks.

Oracles: `WanVAE.decode` / `encode` of the whole batch in one call (the path tests/models/test_vae.py
holds to diffusers) for the pixels, and the peak RSS of fresh subprocesses for the memory.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.vae_memory import measure
from snapref_ray.engine import Renderer
from snapref_ray.models.latent_format import process_out
from snapref_ray.models.tiny_vae import make_tiny_vae
from snapref_ray.models.vae_config import VAEConfig
from snapref_ray.models.vae_estimates import decode_peak_bytes, tiled_decode_peak_bytes
from snapref_ray.models.vae_memory import (
    VAEMemoryPolicy,
    choose_decode,
    choose_encode,
    decode_in_budget,
    encode_in_budget,
)
from snapref_ray.models.vae_tiles import (
    decode_reach,
    decode_tiled,
    encode_reach,
    encode_tiled,
    exact_overlap,
    tile_spans,
    tile_weights,
)
from snapref_ray.tiny import TinyConfig

TINY = VAEConfig(base_dim=8)
GiB = 2**30
# Tiled against untiled decode, in 0..255 units, at the default overlap: measured 0 (tiny VAE) and
# 2.6e-4 (real-size VAE, benchmarks/vae_memory.py --tiling-vae real), float rounding. 0.01 is 1%
# of one 8-bit level: the PNGs differ by one level at most, only where an untiled value sits
# within 0.01 of a rounding boundary.
TILED_MAX_ABS_255 = 0.01


@pytest.fixture(scope="module")
def vae():
    """The tiny model set's VAE (`tiny_renderer`'s weights: the same width and seed)."""
    return make_tiny_vae(base_dim=TinyConfig().vae_base_dim, seed=TinyConfig().seed)


def model_latent_of(batch: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    """A model-space latent [B, 16, 1, h, w], as the sampler hands to Renderer.decode."""
    return torch.randn(batch, 16, 1, h, w, generator=torch.Generator().manual_seed(seed))


def latent_of(batch: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    """The VAE-space latent [B, 16, h, w] Renderer.decode makes of `model_latent_of(...)`."""
    return process_out(model_latent_of(batch, h, w, seed))[:, :, 0]


def to_uint8(pixels: torch.Tensor) -> torch.Tensor:
    """The engine's conversion (Renderer.decode): (x+1)/2, clamped, x255, rounded."""
    return ((pixels.float() + 1.0) / 2.0).clamp(0, 1).mul(255).round().to(torch.uint8)


def max_abs_255(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() * 127.5).item()


@pytest.fixture()
def policy_of(tiny_renderer):
    """Sets tiny_renderer.vae.memory_policy for one test, and restores it."""
    saved = tiny_renderer.vae.memory_policy

    def set_policy(policy: VAEMemoryPolicy | None) -> Renderer:
        tiny_renderer.vae.memory_policy = policy
        return tiny_renderer

    yield set_policy
    tiny_renderer.vae.memory_policy = saved


# --- per image = batched ----------------------------------------------------------------------


def test_per_image_decode_equals_batched_decode_bit_for_bit(vae, tiny_renderer, policy_of):
    # 40x36 cells: every convolution takes the same (oneDNN) path for one image as for a batch.
    # Where a batch of one has at most 20480 input elements (16*h*w for the first convolution),
    # PyTorch runs it through its native im2col convolution instead, which rounds differently:
    # up to 5.2e-6 (6.6e-4 of a level) at 6x5 cells. The default policy decodes such small
    # batches whole anyway (max_batch_bytes).
    latent = latent_of(3, 40, 36)
    with torch.inference_mode():
        batched = vae.decode(latent)
        per_image = decode_in_budget(vae, latent, VAEMemoryPolicy(mode="per_image"))
    assert per_image.shape == batched.shape == (3, 3, 320, 288)
    assert torch.equal(per_image, batched)

    renderer = policy_of(VAEMemoryPolicy(mode="per_image"))
    images = renderer.decode(model_latent_of(3, 40, 36))
    assert [im.size for im in images] == [(288, 320)] * 3
    expected = to_uint8(batched).permute(0, 2, 3, 1)
    for image, want in zip(images, expected):
        assert torch.equal(torch.from_numpy(np.array(image)), want)


def test_per_image_encode_equals_batched_encode_bit_for_bit(vae):
    pixels = torch.rand(3, 3, 320, 288, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.inference_mode():
        batched = vae.encode(pixels)
        per_image = encode_in_budget(vae, pixels, VAEMemoryPolicy(mode="per_image"))
    assert per_image.shape == (3, 16, 40, 36)
    assert torch.equal(per_image, batched)


# --- tiles ------------------------------------------------------------------------------------


def test_tile_spans_cover_the_axis_with_the_overlap():
    for length, tile, overlap in [(48, 32, 28), (37, 30, 28), (128, 52, 28), (100, 10, 0), (7, 8, 4)]:
        spans = tile_spans(length, tile, overlap)
        assert spans[0][0] == 0 and spans[-1][1] == length
        assert all(stop - start == min(tile, length) for start, stop in spans)
        shared = [a_stop - b_start for (_, a_stop), (b_start, _) in zip(spans, spans[1:])]
        assert all(s >= overlap for s in shared), (length, tile, overlap, spans)
    assert len(tile_spans(128, 52, 28)) == 5  # ceil((128 - 28) / (52 - 28))
    with pytest.raises(ValueError, match=r"overlap must be in \[0, tile=8\)"):
        tile_spans(20, 8, 8)


def test_tile_weights_sum_to_one_and_ignore_each_tiles_border_zone():
    length, tile, overlap, reach, scale = 48, 32, 28, 13, 8
    spans = tile_spans(length, tile, overlap)
    weights = tile_weights(spans, length, overlap, reach, scale)
    total = torch.zeros(length * scale, dtype=torch.float64)
    for (start, stop), w in zip(spans, weights):
        assert w.shape == (scale * (stop - start),)
        total[scale * start : scale * stop] += w.double()
        # Within `reach` cells of an inner border a tile's pixels see its zero padding: weight 0.
        if start > 0:
            assert torch.all(w[: scale * reach] == 0)
        if stop < length:
            assert torch.all(w[-scale * reach :] == 0)
    torch.testing.assert_close(total, torch.ones_like(total), rtol=0, atol=1e-6)


def test_reach_counts_the_convolutions_of_the_real_layout():
    # Decoder local stage: per stage 3 residual blocks (6 convs), 3 upsamplings, the head:
    # ((((6*2+1)+6)*2+1+6)*2+1+6)+1 = 98 pixels = 12.25 cells → 13. Encoder: 10 cells.
    assert decode_reach(VAEConfig()) == decode_reach(TINY) == 13
    assert encode_reach(VAEConfig()) == 10
    assert exact_overlap(13) == 28


def test_tiled_decode_matches_untiled_within_the_stated_bound(vae):
    latent = latent_of(1, 40, 36, seed=2)  # 2 x 2 tiles of 34 cells
    with torch.inference_mode():
        untiled = vae.decode(latent)
        tiled = decode_tiled(vae, latent, tile=34, overlap=exact_overlap(decode_reach(vae.config)))
    assert (untiled.abs() < 1).float().mean() > 0.9  # mostly unclamped: the comparison means something
    assert tiled.shape == untiled.shape == (1, 3, 320, 288)
    assert max_abs_255(tiled, untiled) <= TILED_MAX_ABS_255
    assert (to_uint8(tiled).int() - to_uint8(untiled).int()).abs().max() <= 1


def test_tiled_encode_matches_untiled(vae):
    pixels = torch.rand(1, 3, 320, 288, generator=torch.Generator().manual_seed(3)) * 2 - 1
    pixels = torch.nn.functional.avg_pool2d(pixels, 5, 1, 2)  # an image is smoother than noise
    with torch.inference_mode():
        untiled = vae.encode(pixels)
        tiled = encode_tiled(vae, pixels, tile=30, overlap=exact_overlap(encode_reach(vae.config)))  # 3 x 2 tiles
    assert tiled.shape == untiled.shape == (1, 16, 40, 36)
    assert ((tiled - untiled).abs().max() / untiled.abs().max()).item() < 1e-5


def test_a_small_overlap_costs_what_the_border_zone_sees(vae):
    # The zero padding reaches 13 cells into a tile; overlaps that do not cover it are visible.
    # This is what the default overlap buys (and shows the tiled test above can fail).
    latent = latent_of(1, 40, 36, seed=2)
    with torch.inference_mode():
        untiled = vae.decode(latent)
        small = decode_tiled(vae, latent, tile=20, overlap=4)
    assert max_abs_255(small, untiled) > 5


def test_forced_tiny_tiles_decode_the_right_size_without_a_seam(tiny_renderer, policy_of):
    latent = latent_of(1, 30, 31, seed=4)  # odd sizes: the last tiles are shifted, not cut
    with torch.inference_mode():
        untiled = tiny_renderer.vae.decode(latent)
    # 29 cells, the smallest tile the default overlap (28) allows: 2 x 3 tiles, each one cell apart.
    renderer = policy_of(VAEMemoryPolicy(tile=29))
    images = renderer.decode(model_latent_of(1, 30, 31, seed=4))
    assert images[0].size == (248, 240)
    got = torch.from_numpy(np.array(images[0])).permute(2, 0, 1)
    assert (got.int() - to_uint8(untiled)[0].int()).abs().max() <= 1
    with torch.inference_mode():
        tiled = decode_in_budget(tiny_renderer.vae, latent)  # the same policy, through vae.memory_policy
    assert max_abs_255(tiled, untiled) <= TILED_MAX_ABS_255


# --- plans ------------------------------------------------------------------------------------


def test_plan_chooses_whole_then_per_image_then_tiles_as_the_budget_shrinks():
    one = decode_peak_bytes(TINY, (128, 128), torch.float32)
    four = decode_peak_bytes(TINY, (128, 128), torch.float32, batch=4)
    assert one < four < 4 * one  # the fixed part is counted once

    roomy = VAEMemoryPolicy(max_batch_bytes=four)
    assert choose_decode(TINY, (4, 128, 128), torch.float32, four, roomy).mode == "whole"
    # By default a batch of 1024x1024 images is not joined, whatever the budget.
    assert choose_decode(TINY, (4, 128, 128), torch.float32, 100 * GiB).mode == "per_image"
    assert choose_decode(TINY, (1, 128, 128), torch.float32, one).mode == "whole"
    plan = choose_decode(TINY, (4, 128, 128), torch.float32, one - 1)
    assert plan.mode == "tiled" and plan.overlap == 28
    # The largest tile whose estimate fits: one more cell would not.
    assert plan.peak_bytes <= one - 1
    assert tiled_decode_peak_bytes(TINY, (128, 128), plan.tile + 1, torch.float32, 4) > one - 1


def test_forced_modes_and_tiles_need_no_budget():
    assert choose_decode(TINY, (4, 16, 16), torch.float32, None, VAEMemoryPolicy(mode="whole")).mode == "whole"
    assert choose_decode(TINY, (4, 16, 16), torch.float32, None, VAEMemoryPolicy(mode="per_image")).mode == "per_image"
    forced = choose_decode(TINY, (1, 64, 64), torch.float32, None, VAEMemoryPolicy(tile=40, overlap=8))
    assert (forced.mode, forced.tile, forced.overlap) == ("tiled", 40, 8)
    assert choose_encode(TINY, (1, 512, 512), torch.float32, None, VAEMemoryPolicy(tile=30)).overlap == 22
    with pytest.raises(ValueError, match="needs budget_bytes"):
        choose_decode(TINY, (1, 16, 16), torch.float32, None, VAEMemoryPolicy(mode="tiled"))
    with pytest.raises(ValueError, match=r"tile=20 latent cells must exceed the overlap \(28 cells\)"):
        choose_decode(TINY, (1, 64, 64), torch.float32, None, VAEMemoryPolicy(tile=20))
    with pytest.raises(ValueError, match=r"tile=16 asks for tiles, but mode is 'whole'"):
        VAEMemoryPolicy(mode="whole", tile=16)


def test_the_decision_is_logged_at_debug_level(vae, caplog):
    with caplog.at_level(logging.DEBUG, logger="snapref_ray.models.vae_memory"), torch.inference_mode():
        decode_in_budget(vae, latent_of(2, 8, 8), VAEMemoryPolicy(budget_bytes=GiB))
        decode_in_budget(vae, latent_of(1, 30, 30), VAEMemoryPolicy(tile=29))
        encode_in_budget(vae, torch.zeros(1, 3, 64, 64), VAEMemoryPolicy(mode="per_image"))
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("VAE decode of 2 x 8x8 latent: whole, estimated peak")
    assert lines[0].endswith("(budget 1024 MiB)")
    assert lines[1].startswith("VAE decode of 1 x 30x30 latent: tiled, tile 29 overlap 28 latent cells")
    assert lines[2].startswith("VAE encode of 1 x 64x64 pixels: per_image")


def test_engine_encodes_references_and_init_images_through_the_budget(tiny_renderer, tiny_models: Path, caplog):
    from PIL import Image

    from snapref_ray.requests import RenderRequest, RenderSettings

    reference = (tiny_models / "reference.png").read_bytes()
    settings = RenderSettings(width=256, height=256, steps=2, sampler="euler", denoise=0.5)
    init = Image.new("RGB", (256, 256), (200, 120, 40))
    with caplog.at_level(logging.DEBUG, logger="snapref_ray.models.vae_memory"):
        tiny_renderer.encode_reference(reference, width=256, height=256)
        tiny_renderer.render([RenderRequest(prompt="1girl", seed=1, settings=settings)], init_image=init)
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(" of ")[0] for line in lines] == ["VAE encode", "VAE encode", "VAE decode"]
    assert "x 256x256 pixels" in lines[1] and "x 32x32 latent" in lines[2]


@pytest.mark.slow
def test_an_untiled_decode_that_runs_out_of_memory_is_retried_in_tiles(caplog):
    vae = make_tiny_vae(seed=0)  # its own: a hook is attached
    latent = latent_of(1, 64, 64, seed=5)
    with torch.inference_mode():
        untiled = vae.decode(latent)

    def fail_on_whole_images(module, args):
        # The last residual block's input is [1, 8, 512, 512] for the whole image; a tile's is smaller.
        if args[0].shape[-2:] == (512, 512):
            raise torch.OutOfMemoryError("simulated: the estimate was too small for this device")

    hook = vae.decoder.upsamples[-1].register_forward_pre_hook(fail_on_whole_images)
    try:
        with caplog.at_level(logging.WARNING, logger="snapref_ray.models.vae_memory"), torch.inference_mode():
            # Half of one image's activations (estimated) gives 3 x 3 tiles of 42 cells here.
            out = decode_in_budget(vae, latent, VAEMemoryPolicy(mode="per_image"))
    finally:
        hook.remove()
    assert out.shape == untiled.shape
    assert max_abs_255(out, untiled) <= TILED_MAX_ABS_255
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith("VAE decode ran out of memory per image (estimated ")
    assert "; retrying tiled, tile 42 overlap 28 latent cells" in warning


# --- memory -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_batch_of_four_decode_peaks_about_as_one_image(tiny_models: Path):
    # Renderer.decode of 1024x1024 latents on the tiny model, each batch in a fresh process.
    # Decoded in one call the batch of four peaks at 2.4x one image's (measured on the base commit).
    spec = {"case": "real_vae_decode", "models": str(tiny_models), "width": 1024, "height": 1024, "vae_base_dim": 8}
    one = measure({**spec, "batch": 1})
    four = measure({**spec, "batch": 4})
    ratio = four["peak_rss_bytes"] / one["peak_rss_bytes"]
    print(f"peak RSS batch 4 / batch 1 = {ratio:.3f} ({four['peak_rss_bytes']} / {one['peak_rss_bytes']} B)")
    assert ratio <= 1.35
    assert len(four["vae_plans"]) == 1
    assert four["vae_plans"][0].startswith("VAE decode of 4 x 128x128 latent: per_image")


@pytest.mark.slow
def test_one_image_estimate_bounds_the_measured_peak(tiny_models: Path):
    spec = {"case": "real_vae_decode", "models": str(tiny_models), "width": 1024, "height": 1024, "batch": 1}
    result = measure({**spec, "vae_base_dim": 8})
    measured = result["call_peak_above_start_bytes"]
    estimate = decode_peak_bytes(TINY, (128, 128), torch.float32)
    print(f"one 1024x1024 decode: measured {measured / 2**20:.0f} MiB, estimated {estimate / 2**20:.0f} MiB")
    assert measured <= estimate <= 2 * measured
