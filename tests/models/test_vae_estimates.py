"""The VAE estimates from plain data (vae_blocks.py, vae_estimates.py) equal, to the byte, the walk they replace.

Oracle: the walk over the decoder's and encoder's nn.Modules built on `meta` (`WanVAE(config, device="meta")`), as
models/vae_memory.py made it before the estimates moved off torch. It is kept here, and only here, copied as it was:
if the modules and the data lists ever describe different networks, these tests say which estimate moved.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from snapref_ray.models.vae import AttentionBlock, CausalConv3d, Decoder, Encoder, Resample, ResidualBlock, WanVAE
from snapref_ray.models.vae_blocks import Attention, Conv, Head, Residual, decoder_blocks, encoder_blocks
from snapref_ray.models.vae_blocks import Resample as ResampleBlock
from snapref_ray.models.vae_config import VAEConfig
from snapref_ray.models.vae_estimates import (
    FIXED_BYTES,
    SLACK_FACTOR,
    block_live,
    decode_peak_bytes,
    encode_peak_bytes,
    tiled_decode_peak_bytes,
    tiled_encode_peak_bytes,
)
from snapref_ray.tiny import TinyConfig

CONFIGS = {
    "tiny_set": VAEConfig(base_dim=TinyConfig().vae_base_dim),  # the tiny model set's VAE (4 channels)
    "tiny_vae": VAEConfig(base_dim=8),  # models/tiny_vae.py's default
    "real": VAEConfig(),
    "three_stages": VAEConfig(base_dim=32, z_dim=4, dim_mult=(1, 2, 3), temporal_downsample=(True, False)),
    "one_res_block": VAEConfig(base_dim=24, num_res_blocks=1),
    "three_res_blocks": VAEConfig(base_dim=40, z_dim=8, dim_mult=(1, 1, 2, 4, 4), num_res_blocks=3,
                                  temporal_downsample=(False, False, True, True)),
}  # fmt: skip
LATENTS = [(16, 16), (33, 47), (104, 152), (128, 128)]  # latent cells: small, odd, 832x1216, 1024x1024
TILES = [8, 40, 200]  # latent cells per tile side: smaller than, inside and past the latents
BATCHES = [1, 3]
DTYPES = [torch.float32, torch.bfloat16, 4, 2]  # a dtype, or the bytes of one element


# --- the oracle: vae_memory.py's estimates as they walked the meta modules ------------------------


def _bytes(elements: float, dtype: torch.dtype | int) -> int:
    return math.ceil(elements * (dtype if isinstance(dtype, int) else dtype.itemsize) * SLACK_FACTOR)


def _conv_live(c_in: int, c_out: int, n_in: float, n_out: float) -> float:
    return (c_in + _padded(c_in)) * n_in + (c_out + _padded(c_out)) * n_out


def _padded(channels: int) -> int:
    return -(-channels // 16) * 16


def _block_live(block: nn.Module, channels: int, cells: float) -> tuple[float, int, float]:
    c, n = channels, cells
    if isinstance(block, ResidualBlock):
        out = block.residual["6"].weight.shape[0]
        steps = [c * n + _conv_live(c, out, n, n), (c + out) * n + _conv_live(out, out, n, n)]
        if block.shortcut is not None:
            steps.append(out * n + _conv_live(c, out, n, n))
        return max(steps), out, n
    if isinstance(block, AttentionBlock):
        steps = [c * n + _conv_live(c, 3 * c, n, n), 7 * c * n, 5 * c * n, c * n + _conv_live(c, c, n, n)]
        return max(steps), c, n
    if isinstance(block, Resample):
        out = block.resample["1"].weight.shape[0]
        if block.up:
            return c * n + _conv_live(c, out, 4 * n, 4 * n), out, 4 * n
        return c * n + _conv_live(c, out, n, n / 4), out, n / 4
    if isinstance(block, CausalConv3d):
        out = block.weight.shape[0]
        return _conv_live(c, out, n, n), out, n
    if isinstance(block, nn.ModuleDict) and "2" in block:
        out = block["2"].weight.shape[0]
        return c * n + _conv_live(c, out, n, n), out, n
    raise TypeError(f"no memory model for VAE block {type(block).__name__}")


def _walk(blocks: list[nn.Module], channels: int, cells: float) -> tuple[float, int, float]:
    peak = 0.0
    for block in blocks:
        live, channels, cells = _block_live(block, channels, cells)
        peak = max(peak, live)
    return peak, channels, cells


def _top(config: VAEConfig) -> int:
    return config.base_dim * config.dim_mult[-1]


def _global_decode_live(config: VAEConfig, decoder: Decoder) -> float:
    return config.z_dim + _walk([decoder.conv1, *decoder.middle], config.z_dim, 1.0)[0]


def _local_decode_live(decoder: Decoder) -> float:
    return _walk([*decoder.upsamples, decoder.head], decoder.conv1.weight.shape[0], 1.0)[0]


def _local_encode_live(encoder: Encoder, cells: float) -> float:
    return _walk([encoder.conv1, *encoder.downsamples], 3, cells)[0]


def _global_encode_live(config: VAEConfig, encoder: Encoder) -> float:
    peak, channels, _ = _walk([*encoder.middle, encoder.head], _top(config), 1.0)
    return max(peak, 2 * channels)


def oracle_decode(vae: WanVAE, latent_hw: tuple[int, int], dtype, batch: int) -> int:
    config = vae.config
    cells = batch * latent_hw[0] * latent_hw[1]
    held = config.z_dim + 3 * config.spatial_factor**2
    live = max(_global_decode_live(config, vae.decoder), _local_decode_live(vae.decoder))
    return FIXED_BYTES + _bytes((held + live) * cells, dtype)


def oracle_encode(vae: WanVAE, pixel_hw: tuple[int, int], dtype, batch: int) -> int:
    config, f = vae.config, vae.config.spatial_factor
    cells = batch * (pixel_hw[0] // f) * (pixel_hw[1] // f)
    held = 3 * f**2 + config.z_dim
    live = max(_local_encode_live(vae.encoder, float(f**2)), _global_encode_live(config, vae.encoder))
    return FIXED_BYTES + _bytes((held + live) * cells, dtype)


def oracle_tiled_decode(vae: WanVAE, latent_hw: tuple[int, int], tile: int, dtype, batch: int) -> int:
    config, (h, w) = vae.config, latent_hw
    cells, f2 = h * w, config.spatial_factor**2
    out_fp32 = _bytes(3 * f2 * cells * batch, torch.float32)
    whole = _bytes((config.z_dim + _global_decode_live(config, vae.decoder)) * cells, dtype)
    tile_cells = min(tile, h) * min(tile, w)
    held = _bytes((config.z_dim + _top(config)) * cells, dtype)
    per_tile = _bytes((_local_decode_live(vae.decoder) + 3 * f2) * tile_cells, dtype)
    return FIXED_BYTES + out_fp32 + max(whole, held + per_tile)


def oracle_tiled_encode(vae: WanVAE, pixel_hw: tuple[int, int], tile: int, dtype) -> int:
    config, f = vae.config, vae.config.spatial_factor
    h, w = pixel_hw[0] // f, pixel_hw[1] // f
    cells, top = h * w, _top(config)
    held = _bytes(3 * f**2 * cells, dtype) + _bytes(top * cells, torch.float32)
    tile_cells = min(tile, h) * min(tile, w)
    per_tile = _bytes((_local_encode_live(vae.encoder, float(f**2)) + top) * tile_cells, dtype)
    whole = _bytes((top + _global_encode_live(config, vae.encoder)) * cells, dtype)
    return FIXED_BYTES + held + max(per_tile, whole)


# --- the tests ----------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def meta_vae(request) -> WanVAE:
    return WanVAE(CONFIGS[request.param], device="meta")


def test_the_four_estimates_equal_the_walk_over_the_meta_modules(meta_vae: WanVAE) -> None:
    """Whole and tiled, decode and encode, every size, tile, batch and element size: the same bytes."""
    config = meta_vae.config
    cases = 0
    for latent_hw in LATENTS:
        pixel_hw = (latent_hw[0] * config.spatial_factor, latent_hw[1] * config.spatial_factor)
        for dtype in DTYPES:
            for batch in BATCHES:
                case = (latent_hw, dtype, batch)
                assert decode_peak_bytes(config, latent_hw, dtype, batch) == oracle_decode(
                    meta_vae, latent_hw, dtype, batch
                ), case
                assert encode_peak_bytes(config, pixel_hw, dtype, batch) == oracle_encode(
                    meta_vae, pixel_hw, dtype, batch
                ), case
                for tile in TILES:
                    assert tiled_decode_peak_bytes(config, latent_hw, tile, dtype, batch) == oracle_tiled_decode(
                        meta_vae, latent_hw, tile, dtype, batch
                    ), (*case, tile)
                    cases += 1
            for tile in TILES:
                assert tiled_encode_peak_bytes(config, pixel_hw, tile, dtype) == oracle_tiled_encode(
                    meta_vae, pixel_hw, tile, dtype
                ), (latent_hw, dtype, tile)
    assert cases == len(LATENTS) * len(DTYPES) * len(BATCHES) * len(TILES)


def test_the_block_lists_are_the_modules_blocks(meta_vae: WanVAE) -> None:
    """Block for block, the data lists name the kind and channels of the module `WanVAE` built, in forward order
    (also where a block is never the peak, so it changes no estimate above)."""
    encoder, decoder = encoder_blocks(meta_vae.config), decoder_blocks(meta_vae.config)
    assert describe(encoder.conv1) == describe(meta_vae.encoder.conv1)
    assert [describe(b) for b in encoder.downsamples] == [describe(b) for b in meta_vae.encoder.downsamples]
    assert [describe(b) for b in encoder.middle] == [describe(b) for b in meta_vae.encoder.middle]
    assert describe(encoder.head) == describe(meta_vae.encoder.head)
    assert describe(decoder.conv1) == describe(meta_vae.decoder.conv1)
    assert [describe(b) for b in decoder.middle] == [describe(b) for b in meta_vae.decoder.middle]
    assert [describe(b) for b in decoder.upsamples] == [describe(b) for b in meta_vae.decoder.upsamples]
    assert describe(decoder.head) == describe(meta_vae.decoder.head)


def test_each_block_holds_what_its_module_holds(meta_vae: WanVAE) -> None:
    """Block for block along the forward, the elements alive, out channels and out cells equal the oracle's: this
    also holds blocks that are never a stage's peak (a down-sampling conv), which the estimates alone cannot."""
    encoder, decoder = encoder_blocks(meta_vae.config), decoder_blocks(meta_vae.config)
    z = meta_vae.config.z_dim
    walks = [
        ([encoder.conv1, *encoder.downsamples, *encoder.middle, encoder.head], 3),
        ([decoder.conv1, *decoder.middle, *decoder.upsamples, decoder.head], z),
    ]
    modules = [
        [meta_vae.encoder.conv1, *meta_vae.encoder.downsamples, *meta_vae.encoder.middle, meta_vae.encoder.head],
        [meta_vae.decoder.conv1, *meta_vae.decoder.middle, *meta_vae.decoder.upsamples, meta_vae.decoder.head],
    ]
    for (blocks, channels), oracle_blocks in zip(walks, modules):
        assert len(blocks) == len(oracle_blocks)
        data = oracle = (0.0, channels, 64.0)
        for block, module in zip(blocks, oracle_blocks):
            data = block_live(block, data[1], data[2])
            oracle = _block_live(module, oracle[1], oracle[2])
            assert data == oracle, (block, module)


def describe(block) -> tuple:
    """(kind, in channels, out channels[, shortcut or up]) of a data block or of the module it stands for."""
    match block:
        case Conv(in_dim, out_dim) | Head(in_dim, out_dim):
            return (type(block).__name__, in_dim, out_dim)
        case Residual():
            return ("Residual", block.in_dim, block.out_dim, block.shortcut)
        case Attention(dim):
            return ("Attention", dim, dim)
        case ResampleBlock():
            return ("Resample", block.dim, block.out_dim, block.up)
        case CausalConv3d():
            return ("Conv", block.weight.shape[1], block.weight.shape[0])
        case ResidualBlock():
            weight = block.residual["2"].weight
            return ("Residual", weight.shape[1], block.residual["6"].weight.shape[0], block.shortcut is not None)
        case AttentionBlock():
            return ("Attention", block.to_qkv.weight.shape[1], block.proj.weight.shape[0])
        case Resample():
            weight = block.resample["1"].weight
            return ("Resample", weight.shape[1], weight.shape[0], block.up)
        case nn.ModuleDict():
            return ("Head", block["2"].weight.shape[1], block["2"].weight.shape[0])
    raise TypeError(f"not a VAE block: {type(block).__name__}")


def test_a_dtype_and_its_element_size_give_the_same_estimate() -> None:
    """The driver passes bytes per element (it has no torch); a worker passes its dtype."""
    config = CONFIGS["real"]
    assert decode_peak_bytes(config, (128, 128), 4) == decode_peak_bytes(config, (128, 128), torch.float32)
    assert encode_peak_bytes(config, (832, 1216), 2) == encode_peak_bytes(config, (832, 1216), torch.bfloat16)
