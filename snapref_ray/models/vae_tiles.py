"""Tiled VAE decode and encode: the convolution stages tile by tile, the attention stage whole.

The Wan VAE has one non-local operation, the middle block's attention over all positions, and it
runs at latent resolution (64 times fewer positions than pixels; the fused attention kernels keep
O(positions) state), where it is cheap. What costs memory is convolutions at 2-8x the latent
resolution. So a tiled decode runs the global stage (conv2, conv1, middle) on the whole latent and
only the local stage (up stages, head) in tiles; a tiled encode runs the local stage (conv1, down
stages) in tiles and the global stage (middle, head, conv1) on the whole feature map. Tiling the
whole network instead (ComfyUI's tiled decode) gives each tile an attention over its own patch
only, which on the tiny random-weight VAE costs up to 60/255 (benchmarks/vae_memory.py, case
`tiling`); here no attention is cut.

What remains is the zero padding a tile's convolutions see at its inner borders: it changes the
pixels within `decode_reach` latent cells of the border (one position per 3x3 convolution,
doubled by each upsampling) and nothing beyond. Neighbouring tiles therefore overlap by
2 x reach + a few cells: each tile's weight is 0 within `reach` of its inner border and
cross-fades linearly over the middle of the overlap, so every output pixel is a blend of tile
pixels that are exactly the untiled ones (up to float rounding), and a smaller, forced overlap
still blends without a hard seam.

Tiles are laid out per axis in latent cells (`tile_spans`): equal sizes, evenly spaced, so an
encoder tile starts on the 8-pixel grid its stride-2 convolutions sample. Per-axis weights
(`tile_weights`) sum to 1 at every position; a 2-D tile's weight is their outer product.
"""

from __future__ import annotations

import math

import torch

from snapref_ray.models.vae import CausalConv3d, Resample, ResidualBlock, WanVAE, vae_layout
from snapref_ray.models.vae_config import VAEConfig

# Latent cells over which neighbouring tiles cross-fade, beyond the context each one needs.
FEATHER_CELLS = 2


def decode_reach(config: VAEConfig) -> int:
    """Latent cells from a decode tile's inner border within which its pixels differ from untiled ones."""
    decoder = vae_layout(config).decoder
    reach = 0  # in positions of the current resolution
    for block in [*decoder.upsamples, decoder.head]:
        if isinstance(block, ResidualBlock):
            reach += 2  # two 3x3 convolutions (a shortcut is 1x1)
        elif isinstance(block, Resample):
            reach = 2 * reach + 1  # nearest x2, then a 3x3 convolution
        else:  # the head's 3x3 convolution
            reach += 1
    return math.ceil(reach / config.spatial_factor)


def encode_reach(config: VAEConfig) -> int:
    """Latent cells from an encode tile's inner border within which its features differ from untiled ones."""
    encoder = vae_layout(config).encoder
    reach = 0
    for block in [encoder.conv1, *encoder.downsamples]:
        if isinstance(block, ResidualBlock):
            reach += 2
        elif isinstance(block, Resample):
            # Stride 2 over (x, x+1, x+2) with one zero column padded right: half, plus that column.
            reach = math.ceil(reach / 2) + 1
        elif isinstance(block, CausalConv3d):
            reach += 1
    return reach


def exact_overlap(reach: int) -> int:
    """The overlap (latent cells) that gives each tile `reach` cells of context on both sides, plus the feather."""
    return 2 * reach + FEATHER_CELLS


def tile_spans(length: int, tile: int, overlap: int) -> list[tuple[int, int]]:
    """[start, stop) spans of `tile` cells covering `length`, evenly spaced, neighbours sharing ≥ `overlap`."""
    if tile >= length:
        return [(0, length)]
    if not 0 <= overlap < tile:
        raise ValueError(f"tile overlap must be in [0, tile={tile}) latent cells, got {overlap}")
    count = math.ceil((length - overlap) / (tile - overlap))
    # Steps of (length - tile) / (count - 1) <= tile - overlap; rounded, each is still <= tile - overlap.
    starts = [round(i * (length - tile) / (count - 1)) for i in range(count)]
    return [(start, start + tile) for start in starts]


def tile_weights(spans: list[tuple[int, int]], length: int, overlap: int, reach: int, scale: int) -> list[torch.Tensor]:
    """Per span, fp32 weights over its `scale`-times-finer positions; at every position they sum to 1.

    At an inner border (not an image edge) the weight is 0 over the context (`reach` cells, or
    less where the overlap is too small to hold it and still cross-fade), then rises linearly over
    the rest of the overlap. Without overlap the spans abut and each weighs 1.
    """
    context = min(reach, max(0, (overlap - 1) // 2))
    dead, ramp = scale * context, scale * (overlap - 2 * context)
    raw = []
    for start, stop in spans:
        centre = torch.arange(scale * (stop - start), dtype=torch.float64) + 0.5  # position centres from the start
        w = torch.ones_like(centre)
        if ramp > 0 and start > 0:
            w = torch.minimum(w, ((centre - dead) / ramp).clamp(0, 1))
        if ramp > 0 and stop < length:
            w = torch.minimum(w, ((scale * (stop - start) - centre - dead) / ramp).clamp(0, 1))
        raw.append(w)
    total = torch.zeros(scale * length, dtype=torch.float64)
    for (start, _), w in zip(spans, raw):
        total[scale * start : scale * start + w.numel()] += w
    if not bool((total > 0).all()):  # cannot happen for spans from tile_spans with this overlap
        raise ValueError(f"tiles {spans} with overlap {overlap} leave positions with no weight")
    return [(w / total[scale * start : scale * start + w.numel()]).float() for (start, _), w in zip(spans, raw)]


def decode_tiled(vae: WanVAE, latent: torch.Tensor, tile: int, overlap: int) -> torch.Tensor:
    """`vae.decode(latent)` with the local stage in `tile`-cell tiles: pixels [B,3,8h,8w] in [-1, 1], fp32.

    Images run one at a time; the batch's output accumulates in fp32.
    """
    z_BCHW = vae.prepare_latent(latent)
    batch, _, h, w = z_BCHW.shape
    f, reach = vae.config.spatial_factor, decode_reach(vae.config)
    rows, cols = tile_spans(h, tile, overlap), tile_spans(w, tile, overlap)
    row_w = [wt.to(vae.device) for wt in tile_weights(rows, h, overlap, reach, f)]
    col_w = [wt.to(vae.device) for wt in tile_weights(cols, w, overlap, reach, f)]
    out_B3HW = torch.zeros(batch, 3, h * f, w * f, dtype=torch.float32, device=vae.device)
    for i in range(batch):
        features_1CHW = vae.decode_global(z_BCHW[i : i + 1])
        for (top, bottom), wy in zip(rows, row_w):
            for (left, right), wx in zip(cols, col_w):
                part_1CHW = features_1CHW[:, :, top:bottom, left:right].contiguous()
                pixels_3HW = vae.decode_local(part_1CHW)[0].float()
                out_B3HW[i, :, top * f : bottom * f, left * f : right * f] += pixels_3HW * (wy[:, None] * wx[None, :])
                del part_1CHW, pixels_3HW  # free before the next tile allocates
        del features_1CHW
    return out_B3HW.clamp_(-1.0, 1.0)


def encode_tiled(vae: WanVAE, pixels: torch.Tensor, tile: int, overlap: int) -> torch.Tensor:
    """`vae.encode(pixels)` with the local stage in `tile`-cell (8·tile-pixel) tiles: μ [B,16,H/8,W/8] fp32."""
    x_BCHW = vae.prepare_pixels(pixels)
    batch, _, height, width = x_BCHW.shape
    f, reach = vae.config.spatial_factor, encode_reach(vae.config)
    h, w = height // f, width // f
    rows, cols = tile_spans(h, tile, overlap), tile_spans(w, tile, overlap)
    row_w = [wt.to(vae.device) for wt in tile_weights(rows, h, overlap, reach, 1)]
    col_w = [wt.to(vae.device) for wt in tile_weights(cols, w, overlap, reach, 1)]
    top_channels = vae.config.base_dim * vae.config.dim_mult[-1]
    mus = []
    for i in range(batch):
        features_1CHW = torch.zeros(1, top_channels, h, w, dtype=torch.float32, device=vae.device)
        for (top, bottom), wy in zip(rows, row_w):
            for (left, right), wx in zip(cols, col_w):
                part_13HW = x_BCHW[i : i + 1, :, top * f : bottom * f, left * f : right * f].contiguous()
                local_1CHW = vae.encode_local(part_13HW).float()
                features_1CHW[:, :, top:bottom, left:right] += local_1CHW * (wy[:, None] * wx[None, :])
                del part_13HW, local_1CHW
        mus.append(vae.encode_global(features_1CHW.to(vae.dtype)).float())
        del features_1CHW
    return torch.cat(mus)
