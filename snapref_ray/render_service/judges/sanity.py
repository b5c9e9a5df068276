"""Image sanity, no weights: non-finite latents and flat, black or saturated images.

The latent's non-finite fraction is measured by the engine where the latent is, just before the VAE
decode (`RenderResult.latent_nonfinite`): after the decode a NaN is already a black uint8 pixel. The
image statistics are plain numpy over the decoded 8-bit RGB pixels, the batch's images stacked when
they share a size (they do: one forward renders one size).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from PIL import Image

from snapref_ray.render_service.judges.spec import SanityCheck

# Rec. 601 luma weights: the luminance a "near-black" frame is judged by. Luminance is linear in the channel
# values, so its mean is these weights on the channel means.
LUMA_WEIGHTS = np.array([0.299, 0.587, 0.114])


def score_sanity(images: Sequence[Image.Image], latent_nonfinite: Sequence[float | None]) -> list[dict[str, float]]:
    """Per image: `sanity_nonfinite`, `sanity_std`, `sanity_luminance`, `sanity_clipped` (scores.JudgeScores)."""
    levels_256 = np.arange(256, dtype=np.float64)
    out = []
    for image, nonfinite in zip(images, latent_nonfinite):
        # Every statistic is a function of the 8-bit channel histograms, which PIL counts in C in one pass
        # (a few ms at 832x1216, against ~30 ms for numpy's float moments): exact, not sampled.
        counts_3L = np.asarray(image.convert("RGB").histogram(), dtype=np.float64).reshape(3, 256)
        pixels = counts_3L[0].sum()
        mean_3 = counts_3L @ levels_256 / pixels
        var_3 = counts_3L @ levels_256**2 / pixels - mean_3**2
        clipped = (counts_3L[:, 0].sum() + counts_3L[:, 255].sum()) / (3 * pixels)
        out.append(
            {
                "sanity_nonfinite": float(nonfinite) if nonfinite is not None else 0.0,
                "sanity_std": float(np.sqrt(np.maximum(var_3, 0.0)).max()),
                "sanity_luminance": float(mean_3 @ LUMA_WEIGHTS),
                "sanity_clipped": float(clipped),
            }
        )
    return out


def sanity_passes(scores: dict[str, float], check: SanityCheck) -> bool:
    """Every sanity measure on the right side of its threshold."""
    return (
        scores["sanity_nonfinite"] <= check.max_nonfinite_fraction
        and scores["sanity_std"] >= check.min_channel_std
        and scores["sanity_luminance"] >= check.min_mean_luminance
        and scores["sanity_clipped"] <= check.max_clipped_fraction
    )
