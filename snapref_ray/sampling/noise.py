"""Initial noise and the flow model's noise scaling.

Every batch row gets its own CPU generator seeded with that row's seed, so an image depends only
on its own seed, never on what it was batched with (the batch jobs rely on this). For a single
row this is exactly ComfyUI's `prepare_noise` (`torch.manual_seed(seed)` then one CPU float32
`torch.randn` of the latent's shape); for B > 1 ComfyUI instead draws one tensor for the whole
batch from the first seed, so batched ComfyUI images are not reproduced row by row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def initial_noise(seeds: Sequence[int], shape_CHW_or_CTHW: Sequence[int],
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """Standard normal noise [len(seeds), *shape], row b drawn on the CPU from seeds[b]; then moved to `device`."""
    if len(seeds) == 0:
        raise ValueError("initial_noise needs at least one seed")
    rows = []
    for seed in seeds:
        generator = torch.Generator().manual_seed(int(seed))
        rows.append(torch.randn(tuple(shape_CHW_or_CTHW), dtype=torch.float32, generator=generator))
    return torch.stack(rows).to(device)


def noise_scaling(sigma: torch.Tensor | float, noise: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
    """The starting point x = σ·noise + (1−σ)·latent (ComfyUI `CONST.noise_scaling`); σ = 1 gives the noise."""
    if isinstance(sigma, torch.Tensor) and sigma.ndim == 1:
        sigma = sigma.reshape(-1, *[1] * (noise.ndim - 1))  # per-row σ [B] -> [B, 1, ...]
    return sigma * noise + (1.0 - sigma) * latent
