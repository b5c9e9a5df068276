"""The identity-gap evaluation: denoising loss of a target with the right and a wrong reference.

Pure PyTorch on a `Renderer` (no Ray): `snapref_ray/jobs/identity_eval.py` runs it on the batch workers.

The loss (one number per σ and noise seed):

    x0    = process_in(VAE.encode(target))          the target latent, model space, [1, 16, 1, h, w]
    ε     = initial_noise([seed])                     the same CPU-seeded N(0, 1) draw a render with
                                                      that seed starts from; one ε per seed, shared by
                                                      every σ and by both references
    x_σ   = (1 − σ)·x0 + σ·ε                          flow matching (ComfyUI CONST noise scaling)
    v     = ε − x0                                    the velocity target
    v̂     = (x_σ − D)/σ  where D = Renderer.denoise_rows(...)[COND]
                                                      i.e. the DiT's velocity output for one COND row
    loss  = mean over latent elements of (v̂ − v)²

The single COND row is the scene prompt (the target's own prompt, through the normal text path),
reads the reference (when one is given) with the mode's block weights × `ref_weight`, and has the
adapter's target-side LoRA on: exactly the positive CFG branch of a SnapRef render. There is no
uncond row and no CFG, so the number is the model's own prediction error, not a guided one. With
`refkv=None` the row is the plain model (no reference, no target LoRA), as a reference-free render
runs it.

Statistics (`summarise`): per case the mean over the σ × seed grid; gap = wrong − right (positive:
the right reference predicts the target better); a percentile bootstrap CI of the mean gap that
resamples characters (cases of one character are not independent); the fraction of cases where
the right reference wins. Wrong references come from `derangement`, a seeded permutation in which
no case gets a reference of its own character.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence

import numpy as np
import torch
from PIL import Image

from snapref_ray.adapter.images import fit_megapixels, image_to_pixels, open_reference
from snapref_ray.geometry import PIXELS_PER_TOKEN
from snapref_ray.models.latent_format import process_in
from snapref_ray.models.vae_memory import encode_in_budget
from snapref_ray.requests import RenderSettings
from snapref_ray.sampling.noise import initial_noise, noise_scaling
from snapref_ray.sampling.ref_guidance import Row, StepRows

LOSS_DEFINITION = (
    "mean((v_pred - v)^2) over latent elements; x_s = (1-s)*x0 + s*eps, v = eps - x0, "
    "eps from the CPU generator of each noise seed (shared by all sigmas and both references); "
    "one COND row: the target's scene prompt, target LoRA on, reference read with the mode's "
    "block weights x ref_weight; no uncond row, no CFG"
)


# ---------------------------------------------------------------------------------------------
# Losses


def prepare_target(data: bytes, megapixels: float = 1.0, source: str = "<target>") -> Image.Image:
    """Target image bytes -> RGB image fitted to `megapixels`, sides multiples of 16 (as references are)."""
    return fit_megapixels(open_reference(data, source), megapixels)


@torch.inference_mode()
def encode_target(renderer, target_image: Image.Image) -> torch.Tensor:
    """The target's clean latent x0 in model space, [1, 16, 1, h, w] fp32."""
    if target_image.width % PIXELS_PER_TOKEN or target_image.height % PIXELS_PER_TOKEN:
        raise ValueError(
            f"target image is {target_image.width}x{target_image.height}: both sides must be multiples"
            " of 16 (fit it with prepare_target)"
        )
    pixels = image_to_pixels(target_image.convert("RGB")).to(renderer.device, renderer.vae.dtype)
    return process_in(encode_in_budget(renderer.vae, pixels).float()).unsqueeze(2)


@torch.inference_mode()
def denoising_losses(
    renderer,
    target_image: Image.Image,
    prompt: str,
    refkv,
    sigmas: Sequence[float],
    noise_seeds: Sequence[int],
    *,
    mode: str = "cs",
    ref_weight: float = 1.0,
    batch_size: int | None = None,
) -> torch.Tensor:
    """Flow-matching loss of `target_image` under `prompt` (and `refkv`), [len(sigmas), len(noise_seeds)] fp32.

    See the module docstring for the exact definition. `refkv` must be encoded for the target's
    size (`renderer.encode_reference(..., width=target.width, height=target.height)`); the noise
    seeds of one σ run as one batched forward, `batch_size` rows at a time (default: all).
    """
    if not sigmas or not noise_seeds:
        raise ValueError(f"need at least one sigma and one noise seed, got {len(sigmas)} and {len(noise_seeds)}")
    bad = [s for s in sigmas if not 0.0 < float(s) <= 1.0]
    if bad:
        raise ValueError(f"sigmas must lie in (0, 1], found {bad}")
    x0 = encode_target(renderer, target_image)  # [1, 16, 1, h, w]
    reader = None  # no reference: the plain model, no adapter branch
    if refkv is not None:
        bound = renderer.adapter
        if bound is None:
            raise ValueError("a reference was given but the renderer has no SnapRef adapter loaded")
        grid = renderer.target_grid(target_image.width, target_image.height)
        if refkv.adapter_id != bound.identity:
            raise ValueError("refkv was encoded with a different adapter than the renderer's")
        if refkv.target_grid != grid:
            raise ValueError(
                f"refkv was encoded for a {refkv.target_grid} token grid; the {target_image.width}x"
                f"{target_image.height} target needs {grid}"
            )
        refkv = refkv.to(renderer.device, renderer.dtype)
        # The cond row of a render with these settings: the mode's block weights x ref_weight, target LoRA on.
        reader = bound.reader(renderer.resolve(RenderSettings(mode=mode, ref_weight=ref_weight)))
    plan = StepRows(rows=(Row.COND,), reads=(refkv is not None,), ref_guidance_active=False)
    context = renderer.prompts.encode(prompt, device=renderer.device).to(renderer.dtype)  # [1, L, C]
    eps = initial_noise(list(noise_seeds), tuple(x0.shape[1:]), renderer.device)  # [N, 16, 1, h, w]
    v_target = eps - x0
    chunk = batch_size or len(noise_seeds)
    losses = torch.empty(len(sigmas), len(noise_seeds), dtype=torch.float32)
    for i, s in enumerate(sigmas):
        sigma = torch.tensor(float(s), dtype=torch.float32, device=renderer.device)
        for start in range(0, len(noise_seeds), chunk):
            rows = slice(start, start + chunk)
            x_sigma = noise_scaling(sigma, eps[rows], x0.expand_as(eps[rows]))
            n = x_sigma.shape[0]
            denoised = renderer.denoise_rows(x_sigma, sigma, plan, {Row.COND: [context] * n}, refkv, reader)[Row.COND]
            v_pred = (x_sigma - denoised) / sigma  # the DiT's velocity (denoise_rows returns D = x − σ·v)
            losses[i, rows] = (v_pred - v_target[rows]).square().flatten(1).mean(dim=1).cpu()
    return losses


# ---------------------------------------------------------------------------------------------
# Statistics


def derangement(n: int, seed: int, groups: Sequence[Hashable] | None = None) -> list[int]:
    """A seeded permutation p of range(n) with no fixed points: p[i] != i for every i.

    With `groups` (e.g. a character id per case), also groups[p[i]] != groups[i]: nobody gets a
    reference of their own character, even when a character has several cases. That is possible
    only when no group holds more than half of the cases; otherwise a ValueError names the group.
    The same (n, seed, groups) always gives the same permutation.
    """
    if n < 2:
        raise ValueError(f"a derangement needs at least 2 cases, got {n}")
    labels = list(range(n)) if groups is None else list(groups)
    if len(labels) != n:
        raise ValueError(f"{len(labels)} group labels for {n} cases")
    counts: dict[Hashable, int] = {}
    for label in labels:
        counts[label] = counts.get(label, 0) + 1
    largest, size = max(counts.items(), key=lambda kv: kv[1])
    if 2 * size > n:
        raise ValueError(
            f"character {largest!r} has {size} of {n} cases: every case needs a reference of another "
            "character, which is impossible when one character has more than half of the cases"
        )
    rng = np.random.default_rng(seed)
    # Uniform rejection sampling is cheap when the constraint is loose (1/e of plain permutations
    # are derangements); the constructive fallback below always succeeds.
    for _ in range(200):
        p = rng.permutation(n)
        if all(labels[p[i]] != labels[i] for i in range(n)):
            return [int(j) for j in p]
    # Lay the cases out group after group (groups and members in seeded order) and send each to the
    # case `size` positions further on: a group spans at most `size` <= n/2 consecutive positions,
    # so that position, modulo n, always belongs to another group.
    order_of_groups = {label: rank for rank, label in enumerate(rng.permutation(len(counts)))}
    group_ids = {label: k for k, label in enumerate(counts)}
    tiebreak = rng.permutation(n)
    order = sorted(range(n), key=lambda i: (order_of_groups[group_ids[labels[i]]], tiebreak[i]))
    p = [0] * n
    for k, i in enumerate(order):
        p[i] = order[(k + size) % n]
    return p


def bootstrap_ci(
    values: Sequence[float],
    seed: int,
    n_boot: int = 2000,
    level: float = 0.95,
    groups: Sequence[Hashable] | None = None,
) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean of `values`; resamples whole `groups` when given.

    The bounds are order statistics at symmetric ranks (no interpolation), so negating every
    value negates and swaps the bounds exactly, and the same seed always gives the same interval.
    """
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 1 or v.size == 0:
        raise ValueError(f"bootstrap_ci needs a non-empty 1-D sequence of values, got shape {v.shape}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    if n_boot < 1:
        raise ValueError(f"n_boot must be at least 1, got {n_boot}")
    labels = list(range(v.size)) if groups is None else list(groups)
    if len(labels) != v.size:
        raise ValueError(f"{len(labels)} group labels for {v.size} values")
    index: dict[Hashable, int] = {}
    member = np.array([index.setdefault(label, len(index)) for label in labels])
    n_groups = len(index)
    sums_G = np.bincount(member, weights=v, minlength=n_groups)  # per group: sum of its values
    sizes_G = np.bincount(member, minlength=n_groups).astype(np.float64)
    rng = np.random.default_rng(seed)
    stats = np.empty(n_boot)
    for start in range(0, n_boot, 256):  # bounded memory: 256 replicates x groups counts at a time
        reps = min(256, n_boot - start)
        draws = rng.integers(0, n_groups, size=(reps, n_groups))
        counts_RG = np.stack([np.bincount(row, minlength=n_groups) for row in draws]).astype(np.float64)
        stats[start : start + reps] = (counts_RG @ sums_G) / (counts_RG @ sizes_G)
    stats.sort()
    k = math.floor(round((1.0 - level) / 2.0 * n_boot, 9))
    return float(stats[k]), float(stats[n_boot - 1 - k])


def _grid(value, what: str) -> np.ndarray:
    grid = np.asarray(value.numpy() if isinstance(value, torch.Tensor) else value, dtype=np.float64)
    if grid.ndim != 2:
        raise ValueError(f"{what}: expected a [sigmas, seeds] grid, got shape {grid.shape}")
    return grid


def summarise(
    per_case: Sequence[Mapping],
    *,
    sigmas: Sequence[float] | None = None,
    seed: int = 0,
    n_boot: int = 2000,
    level: float = 0.95,
) -> dict:
    """Per-case and overall statistics of identity-gap results.

    Each case is a mapping with `case_id`, `loss_right` and `loss_wrong` ([sigmas, seeds] grids
    from `denoising_losses`, same shape for every case) and optionally `character` (default: the
    case is its own character) plus any other fields, which are passed through. Returns the
    overall fields of heldout_loss.json and its `cases` and `per_sigma` lists (docs/evaluate.md).
    """
    if not per_case:
        raise ValueError("summarise needs at least one case")
    cases, gaps, characters = [], [], []
    right_S, wrong_S = [], []
    shape = None
    for case in per_case:
        right = _grid(case["loss_right"], f"case {case['case_id']}: loss_right")
        wrong = _grid(case["loss_wrong"], f"case {case['case_id']}: loss_wrong")
        if right.shape != wrong.shape or (shape is not None and right.shape != shape):
            raise ValueError(
                f"case {case['case_id']}: loss grids of shape {right.shape} and {wrong.shape}, "
                f"expected {shape or right.shape} for both"
            )
        shape = right.shape
        mean_right, mean_wrong = float(right.mean()), float(wrong.mean())
        gap = mean_wrong - mean_right
        character = case.get("character", f"case:{case['case_id']}")
        extra = {k: v for k, v in case.items() if k not in ("loss_right", "loss_wrong")}
        cases.append(
            {
                **extra,
                "character": character,
                "mean_loss_right": mean_right,
                "mean_loss_wrong": mean_wrong,
                "gap": gap,
                "right_wins": bool(mean_right < mean_wrong),
            }
        )
        gaps.append(gap)
        characters.append(character)
        right_S.append(right.mean(axis=1))
        wrong_S.append(wrong.mean(axis=1))
    n = len(cases)
    mean_right = float(np.mean([c["mean_loss_right"] for c in cases]))
    mean_wrong = float(np.mean([c["mean_loss_wrong"] for c in cases]))
    lo, hi = bootstrap_ci(gaps, seed, n_boot, level, groups=characters)
    right_by_sigma, wrong_by_sigma = np.mean(right_S, axis=0), np.mean(wrong_S, axis=0)
    sigma_values = list(sigmas) if sigmas is not None else [None] * shape[0]
    if len(sigma_values) != shape[0]:
        raise ValueError(f"{len(sigma_values)} sigmas for loss grids with {shape[0]} rows")
    return {
        "n_cases": n,
        "n_characters": len(set(characters)),
        "mean_loss_right": mean_right,
        "mean_loss_wrong": mean_wrong,
        "gap": float(np.mean(gaps)),
        "gap_ci": [lo, hi],
        "ci_level": level,
        "bootstrap": {"n_boot": n_boot, "seed": seed, "unit": "character", "method": "percentile"},
        "right_wins_fraction": sum(c["right_wins"] for c in cases) / n,
        "per_sigma": [
            {"sigma": s, "mean_loss_right": float(r), "mean_loss_wrong": float(w), "gap": float(w - r)}
            for s, r, w in zip(sigma_values, right_by_sigma, wrong_by_sigma)
        ],
        "cases": cases,
    }
