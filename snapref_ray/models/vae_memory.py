"""Run the VAE within the free memory: the whole batch in one call, image by image, or in tiles.

A decode's memory grows with the pixels it produces: its last stage keeps four to six activations
of 96 channels at full resolution alive (one 832x1216 fp32 decode peaks 2.2 GB above the weights),
so a batch of four decoded in one call needs four times that, for no gain in speed (at these sizes
the convolutions already fill the device). `decode_in_budget` / `encode_in_budget` therefore
estimate the peak (`decode_peak_bytes`, `encode_peak_bytes`), compare it with a budget (a share of
`device_memory.available_memory_bytes`) and choose, explicitly and logged at debug level:

- "whole": one call for the batch, while the batch's estimate stays under `max_batch_bytes`;
- "per_image": one call per image, when one image fits the budget (peak ~ one image's);
- "tiled": one image at a time in overlapping, feathered tiles (models/vae_tiles.py), with the
  largest tile that fits, when one image does not.

ComfyUI makes the same choice (its VAE class's `memory_used_decode`, then a tiled decode when a
decode runs out of memory, which is kept here as the fallback); it keeps batching while the free
memory allows, here a batch is only joined while that is cheap, so the peak of a batch is about
one image's.

The estimates (models/vae_estimates.py) count the activations alive at once in each block, from the
config alone; tests/models/test_vae_memory.py checks them against a measured peak. Weights are not
included: they are resident whatever the plan.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch

from snapref_ray.models.device_memory import available_memory_bytes
from snapref_ray.models.vae import WanVAE
from snapref_ray.models.vae_config import VAEConfig
from snapref_ray.models.vae_estimates import (
    FIXED_BYTES,
    decode_peak_bytes,
    encode_peak_bytes,
    tiled_decode_peak_bytes,
    tiled_encode_peak_bytes,
)
from snapref_ray.models.vae_tiles import decode_reach, decode_tiled, encode_reach, encode_tiled, exact_overlap

log = logging.getLogger(__name__)

Mode = Literal["whole", "per_image", "tiled"]


@dataclass(frozen=True)
class VAEMemoryPolicy:
    """How `decode_in_budget` / `encode_in_budget` split work; the defaults decide from the free memory."""

    # "auto" chooses (see the module docstring); the others force a mode (tests, or a known machine).
    mode: Literal["auto", "whole", "per_image", "tiled"] = "auto"
    # Tile side in latent cells (8 pixels each). Given, it forces tiling at this size; None lets
    # tiling use the largest tile whose estimate fits the budget.
    tile: int | None = None
    # Latent cells neighbouring tiles share. None: enough that each tile has the context its
    # convolutions reach plus 2 cells to cross-fade (28 to decode, 22 to encode; vae_tiles.py),
    # which makes tiled equal untiled up to float rounding. Smaller overlaps trade exactness for
    # fewer tiles and still blend without a hard seam.
    overlap: int | None = None
    # Bytes the VAE may plan to use; None: `usable_fraction` of the device's free memory at the call.
    budget_bytes: int | None = None
    # The rest of the free memory covers estimate error and what else the process does meanwhile
    # (PNG encoding and uploads of earlier images, other threads).
    usable_fraction: float = 0.8
    # A batch is decoded in one call only while its estimate stays under this: past ~0.1 MP per
    # image the convolutions fill the device, so joining images buys no speed, only peak memory.
    max_batch_bytes: int = 256 * 2**20

    def __post_init__(self) -> None:
        if self.tile is not None and self.tile < 1:
            raise ValueError(f"VAEMemoryPolicy.tile must be a positive number of latent cells, got {self.tile}")
        if self.tile is not None and self.mode not in ("auto", "tiled"):
            raise ValueError(f"VAEMemoryPolicy.tile={self.tile} asks for tiles, but mode is {self.mode!r}")
        if self.overlap is not None and self.overlap < 0:
            raise ValueError(f"VAEMemoryPolicy.overlap must be >= 0 latent cells, got {self.overlap}")
        if not 0 < self.usable_fraction <= 1:
            raise ValueError(f"VAEMemoryPolicy.usable_fraction must be in (0, 1], got {self.usable_fraction}")


@dataclass(frozen=True)
class VAEChoice:
    """What a call will do and why: the mode, its estimated peak and the budget it was held to."""

    mode: Mode
    peak_bytes: int  # estimated activation peak of this plan
    budget_bytes: int | None  # None when the mode was forced without asking the device
    tile: int | None = None  # latent cells per tile side ("tiled" only)
    overlap: int | None = None

    def describe(self) -> str:
        tiles = f" tile {self.tile} overlap {self.overlap} latent cells," if self.mode == "tiled" else ""
        budget = f"budget {self.budget_bytes / 2**20:.0f} MiB" if self.budget_bytes is not None else "forced"
        return f"{self.mode},{tiles} estimated peak {self.peak_bytes / 2**20:.0f} MiB ({budget})"


# --- plans ------------------------------------------------------------------------------------


def choose_decode(
    config: VAEConfig,
    latent_shape: tuple[int, int, int],
    dtype: torch.dtype,
    budget_bytes: int | None,
    policy: VAEMemoryPolicy | None = None,
) -> VAEChoice:
    """The plan for decoding latents of `latent_shape` (batch, h, w) within `budget_bytes`.

    `budget_bytes` may be None only where the policy fixes the mode and tile size.
    """
    policy = policy or VAEMemoryPolicy()
    batch, h, w = latent_shape
    overlap = policy.overlap if policy.overlap is not None else exact_overlap(decode_reach(config))

    def tiled(tile: int) -> int:
        return tiled_decode_peak_bytes(config, (h, w), tile, dtype, batch)

    one, whole = decode_peak_bytes(config, (h, w), dtype), decode_peak_bytes(config, (h, w), dtype, batch)
    return _choose(batch, one, whole, max(h, w), overlap, tiled, budget_bytes, policy)


def choose_encode(
    config: VAEConfig,
    pixel_shape: tuple[int, int, int],
    dtype: torch.dtype,
    budget_bytes: int | None,
    policy: VAEMemoryPolicy | None = None,
) -> VAEChoice:
    """The plan for encoding images of `pixel_shape` (batch, H, W) within `budget_bytes`."""
    policy = policy or VAEMemoryPolicy()
    batch, height, width = pixel_shape
    overlap = policy.overlap if policy.overlap is not None else exact_overlap(encode_reach(config))

    def tiled(tile: int) -> int:
        return tiled_encode_peak_bytes(config, (height, width), tile, dtype)

    one, whole = (
        encode_peak_bytes(config, (height, width), dtype),
        encode_peak_bytes(config, (height, width), dtype, batch),
    )
    longest_side = max(height, width) // config.spatial_factor
    return _choose(batch, one, whole, longest_side, overlap, tiled, budget_bytes, policy)


def _choose(
    batch: int,
    one: int,
    whole: int,
    longest_side: int,
    overlap: int,
    tiled_peak: Callable[[int], int],
    budget: int | None,
    policy: VAEMemoryPolicy,
) -> VAEChoice:
    if policy.tile is not None:
        if policy.tile <= overlap and policy.tile < longest_side:
            raise ValueError(
                f"VAEMemoryPolicy.tile={policy.tile} latent cells must exceed the overlap ({overlap} cells);"
                f" pass a larger tile or a smaller overlap"
            )
        return VAEChoice("tiled", tiled_peak(policy.tile), budget, policy.tile, overlap)
    if policy.mode == "whole":
        return VAEChoice("whole", whole, budget)
    if policy.mode == "per_image":
        return VAEChoice("per_image", one, budget)
    if budget is None:
        raise ValueError(f"VAE plan: mode {policy.mode!r} without a tile size needs budget_bytes")
    if policy.mode == "auto" and one <= budget:
        if batch == 1 or whole <= min(budget, policy.max_batch_bytes):
            return VAEChoice("whole", whole, budget)
        return VAEChoice("per_image", one, budget)
    tile = _largest_tile(longest_side, overlap, tiled_peak, budget)
    return VAEChoice("tiled", tiled_peak(tile), budget, tile, overlap)


def _largest_tile(longest_side: int, overlap: int, tiled_peak: Callable[[int], int], budget: int) -> int:
    """The largest tile side whose estimate fits `budget` (the estimate grows with the tile: bisect)."""
    smallest = min(overlap + 1, longest_side)  # a tile must reach past its neighbour's overlap
    if tiled_peak(longest_side) <= budget:
        return longest_side
    if tiled_peak(smallest) > budget:
        log.warning(
            "VAE: even %d-cell tiles are estimated at %.0f MiB, over the %.0f MiB budget; trying them anyway",
            smallest,
            tiled_peak(smallest) / 2**20,
            budget / 2**20,
        )
        return smallest
    lo, hi = smallest, longest_side  # tiled_peak(lo) fits, tiled_peak(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if tiled_peak(mid) <= budget else (lo, mid)
    return lo


# --- running ----------------------------------------------------------------------------------


def decode_in_budget(vae: WanVAE, latent: torch.Tensor, policy: VAEMemoryPolicy | None = None) -> torch.Tensor:
    """`vae.decode(latent)` within the free memory: whole batch, per image or tiled (see `choose_decode`).

    `policy` defaults to `vae.memory_policy`, else `VAEMemoryPolicy()`. The result has the shape
    and dtype of `vae.decode(latent)`; per image it has its values bit for bit wherever each
    convolution runs the same kernel for one image as for the batch (on CPU: latents of more
    than 1280 cells, see tests/models/test_vae_memory.py), tiled within float rounding. Where an
    untiled plan still runs out of memory (the estimate is not the device), it is retried tiled
    in half the memory the plan was estimated at, as ComfyUI falls back to its tiled decode.
    """
    policy = policy or vae.memory_policy or VAEMemoryPolicy()
    z_BCHW = vae.prepare_latent(latent)
    batch, _, h, w = z_BCHW.shape
    plan = choose_decode(vae.config, (batch, h, w), vae.dtype, _budget(vae, policy), policy)
    log.debug("VAE decode of %d x %dx%d latent: %s", batch, h, w, plan.describe())
    out_dtype = latent.dtype if latent.is_floating_point() else vae.dtype
    if plan.mode != "tiled":
        try:
            return _decode_untiled(vae, z_BCHW, plan.mode, out_dtype)
        except torch.OutOfMemoryError:
            pass  # retried below, once the failed call's tensors are released with the exception
        plan = _after_out_of_memory(
            plan, policy, "decode", partial(choose_decode, vae.config, (batch, h, w), vae.dtype)
        )
    return decode_tiled(vae, z_BCHW, plan.tile, plan.overlap).to(out_dtype)


def encode_in_budget(vae: WanVAE, pixels: torch.Tensor, policy: VAEMemoryPolicy | None = None) -> torch.Tensor:
    """`vae.encode(pixels)` within the free memory: whole batch, per image or tiled (see `decode_in_budget`)."""
    policy = policy or vae.memory_policy or VAEMemoryPolicy()
    x_BCHW = vae.prepare_pixels(pixels)
    batch, _, height, width = x_BCHW.shape
    plan = choose_encode(vae.config, (batch, height, width), vae.dtype, _budget(vae, policy), policy)
    log.debug("VAE encode of %d x %dx%d pixels: %s", batch, height, width, plan.describe())
    out_dtype = pixels.dtype if pixels.is_floating_point() else vae.dtype
    if plan.mode != "tiled":
        try:
            if plan.mode == "whole":
                return vae.encode(x_BCHW).to(out_dtype)
            return torch.cat([vae.encode(x_BCHW[i : i + 1]) for i in range(batch)]).to(out_dtype)
        except torch.OutOfMemoryError:
            pass
        replan = partial(choose_encode, vae.config, (batch, height, width), vae.dtype)
        plan = _after_out_of_memory(plan, policy, "encode", replan)
    mus = [encode_tiled(vae, x_BCHW[i : i + 1], plan.tile, plan.overlap) for i in range(batch)]
    return torch.cat(mus).to(out_dtype)


def _decode_untiled(vae: WanVAE, z_BCHW: torch.Tensor, mode: Mode, out_dtype: torch.dtype) -> torch.Tensor:
    if mode == "whole":
        return vae.decode(z_BCHW).to(out_dtype)
    batch, _, h, w = z_BCHW.shape
    f = vae.config.spatial_factor
    out = torch.empty(batch, 3, h * f, w * f, dtype=out_dtype, device=vae.device)
    for i in range(batch):
        out[i] = vae.decode(z_BCHW[i : i + 1])[0]
    return out


def _after_out_of_memory(
    failed: VAEChoice, policy: VAEMemoryPolicy, what: str, replan: Callable[[int | None, VAEMemoryPolicy], VAEChoice]
) -> VAEChoice:
    """The tiled plan to retry with: tiles sized for half the activations of one image, which did not fit."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # what the failed call cached is of the wrong sizes for tiles
    one_image = replan(None, VAEMemoryPolicy(mode="per_image")).peak_bytes
    budget = FIXED_BYTES + (one_image - FIXED_BYTES) // 2
    plan = replan(budget, VAEMemoryPolicy(mode="tiled", overlap=policy.overlap))
    log.warning(
        "VAE %s ran out of memory %s (estimated %.0f MiB); retrying %s",
        what,
        failed.mode.replace("_", " "),
        failed.peak_bytes / 2**20,
        plan.describe(),
    )
    return plan


def _budget(vae: WanVAE, policy: VAEMemoryPolicy) -> int | None:
    if policy.budget_bytes is not None:
        return policy.budget_bytes
    if policy.tile is not None or policy.mode in ("whole", "per_image"):
        return None  # nothing left to size: the device is not asked
    return int(available_memory_bytes(vae.device) * policy.usable_fraction)
