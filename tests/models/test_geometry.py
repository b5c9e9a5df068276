"""models/geometry.py: the pixel -> latent -> token sizes agree with what the VAE and the DiT produce."""

from __future__ import annotations

import torch

from snapref_ray.models.dit import patchify
from snapref_ray.models.geometry import PIXELS_PER_TOKEN, latent_size, token_count, token_grid
from snapref_ray.models.tiny_vae import make_tiny_vae


def test_a_real_vae_and_patchify_give_the_sizes_geometry_states():
    height, width = 48, 80  # not square, so a swapped height and width shows
    latent = make_tiny_vae(base_dim=4).encode(torch.zeros(1, 3, height, width))
    assert tuple(latent.shape[-2:]) == latent_size(height=height, width=width) == (6, 10)
    _tokens, (_t, rows, cols) = patchify(latent.reshape(1, 16, 1, *latent.shape[-2:]))
    assert (rows, cols) == token_grid(height=height, width=width) == (3, 5)


def test_the_published_comparison_size_has_3952_tokens():
    assert PIXELS_PER_TOKEN == 16
    assert token_count(height=1216, width=832) == 3952  # 76 x 52, the figure the performance docs use
