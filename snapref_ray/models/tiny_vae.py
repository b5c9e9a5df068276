"""Seeded random VAE weights in the real file layout, for tests and for smoke runs without the real file.

The tensors have exactly the real key names and ranks (5-D causal-conv weights, [C,1,1,1]
gammas, the unused `time_conv`s), only narrower, so anything that loads, saves or converts the
real file can be exercised with them.
"""

from __future__ import annotations

import math

import torch

from snapref_ray.models.checkpoint import StateDict
from snapref_ray.models.vae import WanVAE, load_vae
from snapref_ray.models.vae_config import VAEConfig


def random_vae_state_dict(config: VAEConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> StateDict:
    """Random weights for `config` in original Wan key names, reproducible from `seed`.

    Scales keep activations of order one through every block (weights ~ N(0, 1/fan_in) over the
    taps a single frame uses, γ ≈ 1, small biases), so decoded pixels are mostly inside [-1, 1]
    rather than clamped and comparisons against other implementations stay meaningful.
    """
    layout = WanVAE(config, device="meta")
    gen = torch.Generator().manual_seed(seed)
    sd: StateDict = {}
    for name, p in layout.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if name.endswith(".gamma"):
            value = 1.0 + 0.1 * noise
        elif name.endswith(".bias"):
            value = 0.02 * noise
        else:  # conv weight [out, in, (kt,) kh, kw]; a single frame only meets the last kh·kw taps
            fan_in = p.shape[1] * p.shape[-1] * p.shape[-2]
            value = noise / math.sqrt(fan_in)
        sd[name] = value.to(dtype)
    return sd


def make_tiny_vae_state_dict(
    *, base_dim: int = 8, z_dim: int = 16, seed: int = 0, dtype: torch.dtype = torch.float32
) -> StateDict:
    """A narrow (`base_dim` channels instead of 96) VAE state dict with the real key layout, seeded."""
    return random_vae_state_dict(VAEConfig(base_dim=base_dim, z_dim=z_dim), seed=seed, dtype=dtype)


def make_tiny_vae(
    *,
    base_dim: int = 8,
    z_dim: int = 16,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> WanVAE:
    """`load_vae` of `make_tiny_vae_state_dict(...)`."""
    return load_vae(make_tiny_vae_state_dict(base_dim=base_dim, z_dim=z_dim, seed=seed, dtype=dtype), device=device)
