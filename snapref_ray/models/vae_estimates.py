"""Estimated peak activation bytes of a VAE decode or encode, whole or tiled, from the config alone (no torch).

A decode's memory grows with the pixels it produces: its last stage keeps four to six activations of 96 channels at
full resolution alive (one 832x1216 fp32 decode peaks 2.2 GB above the weights). The estimates count the activations
alive at once in each block, walking the block lists the forward runs (vae_blocks.py, the same lists `WanVAE` builds),
with a copy of each convolution's input and output (the kernels' layout reorders), x1.1 and a fixed part for allocator
slack and first-call setup; tests/models/test_vae_memory.py checks them against a measured peak. Weights are not
included: they are resident whatever the plan.

The worker decides how to decode with them (vae_memory.py); the driver, which imports no torch, sizes a worker's
memory request with them (render_service/memory_estimate.py). An element's size is given as a dtype (anything with
`.itemsize`, such as a torch or numpy dtype) or as a number of bytes.
"""

from __future__ import annotations

import math
from typing import Protocol

from snapref_ray.models.vae_blocks import (
    Attention,
    Block,
    Conv,
    DecoderBlocks,
    EncoderBlocks,
    Head,
    Resample,
    Residual,
    decoder_blocks,
    encoder_blocks,
)
from snapref_ray.models.vae_config import VAEConfig

# What the count of live activations leaves out: allocator rounding and fragmentation (x1.1), and
# a fixed part for what a first call at a new size sets up (kernel code, primitive caches, scratch
# space), which dominates small images: 240 MiB measured against 172 MiB counted for the real VAE
# at 256x256. With both the estimate bounds the measured peak from above and stays within 2x of it
# (1.1-1.7x measured, 256x256 to 1536x1536; tests/models/test_vae_memory.py).
SLACK_FACTOR = 1.1
FIXED_BYTES = 96 * 2**20
FLOAT32_BYTES = 4  # a tiled decode accumulates its output, and a tiled encode its features, in float32


class HasItemsize(Protocol):
    """A dtype: torch's, numpy's, anything that says how many bytes an element takes."""

    @property
    def itemsize(self) -> int: ...


ElementSize = int | HasItemsize  # a dtype, or the bytes of one element


def decode_peak_bytes(config: VAEConfig, latent_hw: tuple[int, int], dtype: ElementSize, batch: int = 1) -> int:
    """Estimated peak activation bytes of `WanVAE.decode` of `batch` latents of `latent_hw` cells in `dtype`."""
    cells = batch * latent_hw[0] * latent_hw[1]
    decoder = decoder_blocks(config)
    held = config.z_dim + 3 * config.spatial_factor**2  # the latent in, the pixels out
    live = max(_global_decode_live(config, decoder), _local_decode_live(decoder, 1.0))
    return FIXED_BYTES + _bytes((held + live) * cells, dtype)


def encode_peak_bytes(config: VAEConfig, pixel_hw: tuple[int, int], dtype: ElementSize, batch: int = 1) -> int:
    """Estimated peak activation bytes of `WanVAE.encode` of `batch` images of `pixel_hw` pixels in `dtype`."""
    f = config.spatial_factor
    cells = batch * (pixel_hw[0] // f) * (pixel_hw[1] // f)
    encoder = encoder_blocks(config)
    held = 3 * f**2 + config.z_dim  # the pixels in, μ out
    live = max(_local_encode_live(encoder, float(f**2)), _global_encode_live(config, encoder))
    return FIXED_BYTES + _bytes((held + live) * cells, dtype)


def tiled_decode_peak_bytes(
    config: VAEConfig, latent_hw: tuple[int, int], tile: int, dtype: ElementSize, batch: int = 1
) -> int:
    """Estimated peak of `vae_tiles.decode_tiled` with square tiles of `tile` latent cells.

    Two phases: the global stage on the whole latent, then tile after tile of the local stage
    while the global stage's features and the fp32 output of the batch are held.
    """
    h, w = latent_hw
    cells = h * w
    decoder = decoder_blocks(config)
    f2 = config.spatial_factor**2
    out_fp32 = _bytes(3 * f2 * cells * batch, FLOAT32_BYTES)
    whole = _bytes((config.z_dim + _global_decode_live(config, decoder)) * cells, dtype)
    tile_cells = min(tile, h) * min(tile, w)
    held = _bytes((config.z_dim + _top_channels(config)) * cells, dtype)
    per_tile = _bytes((_local_decode_live(decoder, 1.0) + 3 * f2) * tile_cells, dtype)  # + its weighted copy
    return FIXED_BYTES + out_fp32 + max(whole, held + per_tile)


def tiled_encode_peak_bytes(config: VAEConfig, pixel_hw: tuple[int, int], tile: int, dtype: ElementSize) -> int:
    """Estimated peak of `vae_tiles.encode_tiled` of one image with square tiles of `tile` latent cells."""
    f = config.spatial_factor
    h, w = pixel_hw[0] // f, pixel_hw[1] // f
    cells = h * w
    encoder = encoder_blocks(config)
    top = _top_channels(config)
    held = _bytes(3 * f**2 * cells, dtype) + _bytes(top * cells, FLOAT32_BYTES)  # pixels + fp32 feature sum
    tile_cells = min(tile, h) * min(tile, w)
    per_tile = _bytes((_local_encode_live(encoder, float(f**2)) + top) * tile_cells, dtype)
    whole = _bytes((top + _global_encode_live(config, encoder)) * cells, dtype)
    return FIXED_BYTES + held + max(per_tile, whole)


def _bytes(elements: float, dtype: ElementSize) -> int:
    itemsize = dtype if isinstance(dtype, int) else dtype.itemsize
    return math.ceil(elements * itemsize * SLACK_FACTOR)


def _top_channels(config: VAEConfig) -> int:
    return config.base_dim * config.dim_mult[-1]


def _conv_live(c_in: int, c_out: int, n_in: float, n_out: float) -> float:
    """A convolution's input and output, plus the copies of both its kernels may make.

    oneDNN runs in a blocked layout (channels padded to 16) and reorders into and out of it;
    cuDNN transposes into its workspace. Counting one copy of each covers both.
    """
    return (c_in + _padded(c_in)) * n_in + (c_out + _padded(c_out)) * n_out


def _padded(channels: int) -> int:
    return -(-channels // 16) * 16


def block_live(block: Block, channels: int, cells: float) -> tuple[float, int, float]:
    """(elements alive at once while `block` runs on `channels` x `cells`, its out channels, out cells).

    `cells` counts positions in latent cells' worth (an activation at twice the latent resolution
    has 4 positions per latent cell), so every figure is per latent cell. Each case lists, per
    step of the block's forward, what is alive while it runs.
    """
    c, n = channels, cells
    if isinstance(block, Residual):
        out = block.out_dim
        steps = [
            c * n + _conv_live(c, out, n, n),  # x held; conv(norm(x)) → h1
            (c + out) * n + _conv_live(out, out, n, n),  # x, h1 held; conv(norm(h1)) → h2
        ]
        if block.shortcut:
            steps.append(out * n + _conv_live(c, out, n, n))  # h2 held; shortcut(x)
        return max(steps), out, n
    if isinstance(block, Attention):
        steps = [
            c * n + _conv_live(c, 3 * c, n, n),  # x held; to_qkv(norm(x))
            7 * c * n,  # x, qkv and its contiguous q, k, v copies (fused kernels keep O(L) state after)
            5 * c * n,  # x, q, k, v, the attention output
            c * n + _conv_live(c, c, n, n),  # x held; proj of the output's contiguous copy
        ]
        return max(steps), c, n
    if isinstance(block, Resample):
        out = block.out_dim
        if block.up:  # x held; the conv reads x upsampled 2x
            return c * n + _conv_live(c, out, 4 * n, 4 * n), out, 4 * n
        return c * n + _conv_live(c, out, n, n / 4), out, n / 4  # x held; the stride-2 conv reads x padded
    if isinstance(block, Conv):
        return _conv_live(c, block.out_dim, n, n), block.out_dim, n
    if isinstance(block, Head):  # x held; conv(norm(x))
        return c * n + _conv_live(c, block.out_dim, n, n), block.out_dim, n
    raise TypeError(f"no memory model for VAE block {type(block).__name__}")


def _walk(blocks: list[Block], channels: int, cells: float) -> tuple[float, int, float]:
    peak = 0.0
    for block in blocks:
        live, channels, cells = block_live(block, channels, cells)
        peak = max(peak, live)
    return peak, channels, cells


def _global_decode_live(config: VAEConfig, decoder: DecoderBlocks) -> float:
    # conv2 (z_dim → z_dim), then the decoder's conv1 and middle, all at latent resolution.
    peak, _, _ = _walk([decoder.conv1, *decoder.middle], config.z_dim, 1.0)
    return config.z_dim + peak  # conv2's output is held by the stage while it runs


def _local_decode_live(decoder: DecoderBlocks, cells: float) -> float:
    peak, _, _ = _walk([*decoder.upsamples, decoder.head], decoder.conv1.out_dim, cells)
    return peak


def _local_encode_live(encoder: EncoderBlocks, cells: float) -> float:
    peak, _, _ = _walk([encoder.conv1, *encoder.downsamples], 3, cells)
    return peak


def _global_encode_live(config: VAEConfig, encoder: EncoderBlocks) -> float:
    peak, channels, _ = _walk([*encoder.middle, encoder.head], _top_channels(config), 1.0)
    return max(peak, 2 * channels)  # the top-level conv1 (2·z_dim → 2·z_dim)
