"""Wan 2.1 latent normalisation: between VAE space (what the VAE encodes/decodes) and model space (what the DiT sees).

ComfyUI's `latent_formats.Wan21` (scale factor 1.0; docs/design.md#latent-normalisation):
`process_in` maps a VAE latent μ into the DiT's space before sampling, `process_out` maps the
sampler's result back before decoding. The same constants are diffusers' `AutoencoderKLQwenImage` defaults.
"""

from __future__ import annotations

import torch

WAN21_MEAN: tuple[float, ...] = (
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
)
WAN21_STD: tuple[float, ...] = (
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
)


def _per_channel(values: tuple[float, ...], z: torch.Tensor) -> torch.Tensor:
    if z.ndim < 3 or z.shape[1] != len(values):
        raise ValueError(
            f"latent: expected shape [B, {len(values)}, H, W] or [B, {len(values)}, T, H, W], got {list(z.shape)}"
        )
    # Constants in the latent's dtype, as ComfyUI does it.
    return torch.tensor(values, device=z.device, dtype=z.dtype).reshape(1, -1, *[1] * (z.ndim - 2))


def process_in(z: torch.Tensor) -> torch.Tensor:
    """VAE space → model space: (z − mean) / std per channel; [B,16,H,W] or [B,16,T,H,W]."""
    return (z - _per_channel(WAN21_MEAN, z)) / _per_channel(WAN21_STD, z)


def process_out(z: torch.Tensor) -> torch.Tensor:
    """Model space → VAE space: z · std + mean per channel (the inverse of `process_in`)."""
    return z * _per_channel(WAN21_STD, z) + _per_channel(WAN21_MEAN, z)
