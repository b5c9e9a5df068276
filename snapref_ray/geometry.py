"""How image pixels map to VAE latent cells and DiT tokens: the one home of the 8, the 2 and the 16.

Torch-free, so request validation and clients can use it without importing the models.
"""

from __future__ import annotations

VAE_SCALE = 8  # the Wan VAE's latent cell is 8x8 pixels (three 2x downsamplings)
PATCH = 2  # the DiT's spatial patch: a token is 2x2 latent cells (the temporal patch is 1)
# A token covers 16x16 pixels; image sides are multiples of it so every token is a whole patch.
PIXELS_PER_TOKEN = VAE_SCALE * PATCH


def latent_size(*, height: int, width: int) -> tuple[int, int]:
    """(latent height, latent width) of an image of `height` x `width` pixels."""
    return height // VAE_SCALE, width // VAE_SCALE


def token_grid(*, height: int, width: int) -> tuple[int, int]:
    """(token rows, token columns) of an image whose sides are multiples of PIXELS_PER_TOKEN."""
    return height // PIXELS_PER_TOKEN, width // PIXELS_PER_TOKEN


def token_count(*, height: int, width: int) -> int:
    """Tokens of one image: token rows x token columns."""
    rows, cols = token_grid(height=height, width=width)
    return rows * cols


def square_side(megapixels: float) -> int:
    """The side of the largest square of at most `megapixels` whose side is a multiple of PIXELS_PER_TOKEN (at least
    one token): the image size a memory estimate takes for an area budget."""
    return max(PIXELS_PER_TOKEN, int((megapixels * 1e6) ** 0.5) // PIXELS_PER_TOKEN * PIXELS_PER_TOKEN)
