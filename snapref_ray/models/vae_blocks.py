"""The VAE's encoder and decoder as plain data: the block lists `WanVAE` builds, with their channels, no torch.

What the memory estimates (vae_estimates.py) need of the network is the order of its blocks, each block's kind and
its channels, all fixed by the `VAEConfig`. Describing them as values instead of walking modules built on `meta`
lets the driver, which imports no torch, estimate a worker's VAE decode. `encoder_blocks` / `decoder_blocks` follow
`Encoder.__init__` / `Decoder.__init__` in vae.py step for step; tests/models/test_vae_estimates.py holds the two to
the same blocks and the same estimates.
"""

from __future__ import annotations

from dataclasses import dataclass

from snapref_ray.models.vae_config import VAEConfig


@dataclass(frozen=True)
class Conv:
    """A causal convolution (`CausalConv3d`) run on one frame; its kernel size does not change its memory."""

    in_dim: int
    out_dim: int


@dataclass(frozen=True)
class Residual:
    """`ResidualBlock`: norm, conv, norm, conv, plus a 1x1 shortcut conv where the channels change."""

    in_dim: int
    out_dim: int

    @property
    def shortcut(self) -> bool:
        return self.in_dim != self.out_dim


@dataclass(frozen=True)
class Attention:
    """`AttentionBlock`: single-head self-attention over every position of the frame (middle blocks only)."""

    dim: int


@dataclass(frozen=True)
class Resample:
    """`Resample`: up (nearest x2, then a conv to half the channels) or down (a stride-2 conv, same channels)."""

    dim: int
    up: bool

    @property
    def out_dim(self) -> int:
        return self.dim // 2 if self.up else self.dim


@dataclass(frozen=True)
class Head:
    """The last norm and conv of an encoder or decoder (vae.py's `_head`)."""

    in_dim: int
    out_dim: int


Block = Conv | Residual | Attention | Resample | Head


@dataclass(frozen=True)
class EncoderBlocks:
    """`Encoder`: conv1 and the down stages (its local stage), then the middle and the head (its global stage)."""

    conv1: Conv
    downsamples: tuple[Block, ...]
    middle: tuple[Block, ...]
    head: Head


@dataclass(frozen=True)
class DecoderBlocks:
    """`Decoder`: conv1 and the middle (its global stage), then the up stages and the head (its local stage)."""

    conv1: Conv
    middle: tuple[Block, ...]
    upsamples: tuple[Block, ...]
    head: Head


def encoder_blocks(config: VAEConfig) -> EncoderBlocks:
    """The blocks of `Encoder(config)`, in the order its forward runs them."""
    dims = [config.base_dim * m for m in (1, *config.dim_mult)]
    blocks: list[Block] = []
    for stage, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
        for _ in range(config.num_res_blocks):
            blocks.append(Residual(in_dim, out_dim))
            in_dim = out_dim
        if stage < len(config.dim_mult) - 1:
            blocks.append(Resample(out_dim, up=False))
    return EncoderBlocks(Conv(3, dims[0]), tuple(blocks), _middle(dims[-1]), Head(dims[-1], 2 * config.z_dim))


def decoder_blocks(config: VAEConfig) -> DecoderBlocks:
    """The blocks of `Decoder(config)`, in the order its forward runs them."""
    top = config.base_dim * config.dim_mult[-1]
    dims = [top] + [config.base_dim * m for m in reversed(config.dim_mult)]
    blocks: list[Block] = []
    for stage, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
        if stage > 0:
            in_dim //= 2  # the previous stage's upsampling conv halved the channels
        for _ in range(config.num_res_blocks + 1):
            blocks.append(Residual(in_dim, out_dim))
            in_dim = out_dim
        if stage < len(config.dim_mult) - 1:
            blocks.append(Resample(out_dim, up=True))
    return DecoderBlocks(Conv(config.z_dim, top), _middle(top), tuple(blocks), Head(dims[-1], 3))


def _middle(dim: int) -> tuple[Block, ...]:
    return (Residual(dim, dim), Attention(dim), Residual(dim, dim))
