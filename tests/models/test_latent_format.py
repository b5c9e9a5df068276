"""Wan 2.1 latent normalisation constants and their inverse pair."""

from __future__ import annotations

import inspect

import pytest
import torch

from snapref_ray.models.latent_format import WAN21_MEAN, WAN21_STD, process_in, process_out

# docs/design.md#latent-normalisation (ComfyUI latent_formats.Wan21).
DOC_MEAN = [
    -0.7571,
    -0.7089,
    -0.9113,
    0.1075,
    -0.1745,
    0.9653,
    -0.1517,
    1.5508,
    0.4134,
    -0.0715,
    0.5517,
    -0.3632,
    -0.1922,
    -0.9497,
    0.2503,
    -0.2921,
]
DOC_STD = [
    2.8184,
    1.4541,
    2.3275,
    2.6558,
    1.2196,
    1.7708,
    2.6052,
    2.0743,
    3.2687,
    2.1526,
    2.8652,
    1.5579,
    1.6382,
    1.1253,
    2.8251,
    1.9160,
]


def test_constants_match_the_design_doc_and_diffusers():
    assert list(WAN21_MEAN) == DOC_MEAN
    assert list(WAN21_STD) == DOC_STD
    from diffusers import AutoencoderKLQwenImage

    params = inspect.signature(AutoencoderKLQwenImage.__init__).parameters
    assert list(WAN21_MEAN) == params["latents_mean"].default
    assert list(WAN21_STD) == params["latents_std"].default


def test_process_in_values():
    z = torch.zeros(1, 16, 2, 3)
    z[:, 7] = 1.5508 + 2.0743  # channel 7: one std above its mean
    out = process_in(z)
    torch.testing.assert_close(out[0, 7], torch.ones(2, 3))
    torch.testing.assert_close(out[0, 0], torch.full((2, 3), 0.7571 / 2.8184))


@pytest.mark.parametrize("shape", [(2, 16, 5, 7), (2, 16, 1, 5, 7)])
def test_process_out_inverts_process_in(shape):
    z = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3
    torch.testing.assert_close(process_out(process_in(z)), z, rtol=0, atol=1e-5)
    torch.testing.assert_close(process_in(process_out(z)), z, rtol=0, atol=1e-5)
    # Per channel, not per any other axis: channel c is shifted by mean[c] only.
    torch.testing.assert_close(process_out(torch.zeros(shape)).flatten(2)[0, :, 0], torch.tensor(DOC_MEAN))


def test_process_keeps_dtype_and_refuses_wrong_channels():
    assert process_in(torch.zeros(1, 16, 4, 4, dtype=torch.bfloat16)).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"expected shape \[B, 16, H, W\] or \[B, 16, T, H, W\], got \[1, 4, 8, 8\]"):
        process_in(torch.zeros(1, 4, 8, 8))
