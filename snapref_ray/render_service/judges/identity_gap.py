"""The identity gap of one render, by the model itself: no weights beyond the renderer's.

The rendered image is the target of snapref_ray/evaluation.py's loss (`denoising_losses`, the SnapRef
model card's held-out identity gap): its denoising loss with its own reference's RefKV and with a
different reference's, at `IdentityGapCheck.sigmas` x `noise_seeds`, the same noise for both. The score
is mean(loss with the other) - mean(loss with its own): positive when its own reference predicts the
image better, i.e. the render looks like its character to the model that drew it.

Cost: 2 references x len(sigmas) x len(noise_seeds) DiT row-forwards (each one COND row reading a
reference, the seeds of a sigma batched) and 2 VAE encodes of the image, against a render's
steps x rows-per-image row-forwards (2 rows with CFG). Per image: the images of a batch each have
their own target, so they are judged one after another.
"""

from __future__ import annotations

from PIL import Image

from snapref_ray.evaluation import denoising_losses
from snapref_ray.render_service.judges.spec import IdentityGapCheck
from snapref_ray.requests import RenderSettings


def identity_gap_forwards(check: IdentityGapCheck) -> int:
    """DiT row-forwards the check costs per image."""
    return 2 * len(check.sigmas) * len(check.noise_seeds)


def render_forwards(settings: RenderSettings) -> int:
    """DiT row-forwards a render costs per image: steps x (cond, uncond with CFG, reference guidance)."""
    rows = 1 + (settings.cfg != 1.0) + (settings.ref_guidance not in (None, 1.0))
    return settings.steps * rows


def identity_gap(
    renderer,
    image: Image.Image,
    prompt: str,
    settings: RenderSettings,
    own_refkv,
    contrast_refkv,
    check: IdentityGapCheck,
) -> float:
    """mean loss with `contrast_refkv` - mean loss with `own_refkv` (both encoded for the image's size)."""
    kwargs = {"mode": settings.mode, "ref_weight": settings.ref_weight}
    own = denoising_losses(renderer, image, prompt, own_refkv, check.sigmas, check.noise_seeds, **kwargs)
    other = denoising_losses(renderer, image, prompt, contrast_refkv, check.sigmas, check.noise_seeds, **kwargs)
    return float(other.mean() - own.mean())


def identity_gap_passes(scores: dict, check: IdentityGapCheck) -> bool:
    return scores["identity_gap"] > check.min_gap
