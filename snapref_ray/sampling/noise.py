"""Initial noise and the flow model's noise scaling.

Two seed forms, as the samplers take them:
- one int seed: exactly ComfyUI's `prepare_noise` for the whole batch — `torch.manual_seed(seed)`,
  then ONE CPU float32 `torch.randn` of the batch's latent shape [B, ...], so row b > 0 depends on
  the batch size and position (that is what a ComfyUI batch of B images does);
- one seed per row: row b comes from its own CPU generator seeded with seeds[b], so an image
  depends only on its own seed, never on what it was batched with (the batch jobs rely on this).
For a single row both forms give the same draw.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def initial_noise(
    seeds: int | Sequence[int], shape_CHW_or_CTHW: Sequence[int], device: torch.device | str = "cpu", *, batch: int = 1
) -> torch.Tensor:
    """Standard normal noise [B, *shape] drawn on the CPU, then moved to `device`.

    seeds: one int (ComfyUI's batch noise, B = `batch`) or one seed per row (B = len(seeds)).
    """
    shape = tuple(shape_CHW_or_CTHW)
    if isinstance(seeds, int):
        generator = torch.Generator().manual_seed(seeds)
        return torch.randn((batch, *shape), dtype=torch.float32, generator=generator).to(device)
    if len(seeds) == 0:
        raise ValueError("initial_noise needs at least one seed")
    rows = []
    for seed in seeds:
        generator = torch.Generator().manual_seed(int(seed))
        rows.append(torch.randn(shape, dtype=torch.float32, generator=generator))
    return torch.stack(rows).to(device)


def noise_scaling(sigma: torch.Tensor | float, noise: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
    """The starting point x = σ·noise + (1−σ)·latent (ComfyUI `CONST.noise_scaling`); σ = 1 gives the noise."""
    if isinstance(sigma, torch.Tensor) and sigma.ndim == 1:
        sigma = sigma.reshape(-1, *[1] * (noise.ndim - 1))  # per-row σ [B] -> [B, 1, ...]
    return sigma * noise + (1.0 - sigma) * latent
