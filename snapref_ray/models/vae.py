"""The Anima VAE (Qwen-Image VAE = Wan 2.1 VAE architecture), run on single images in 2-D.

The released file is a video VAE: every convolution is a causal 3-D convolution and two of the
down/up-sampling stages also resample time. An image is one frame, and for one frame (no cache,
two zero frames padded in front) a causal 3×3×3 convolution equals a 3×3 Conv2d with the last
temporal tap `weight[:, :, -1]`; the temporal resamplers (`time_conv`) are skipped for the first
frame. So this module keeps the file's 5-D weights (state dicts round-trip unchanged) and runs
2-D convolutions on [B, C, H, W] activations only; there is never a time axis to allocate.

Structure and key names follow ComfyUI's `comfy/ldm/wan/vae.py` (docs/design.md#vae); numbers
match diffusers' `AutoencoderKLQwenImage` (tests/models/test_vae.py).
"""

from __future__ import annotations

import math
import os
from functools import lru_cache
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from snapref_ray.models.checkpoint import StateDict, load_into_module, load_state_dict
from snapref_ray.models.ops import FLOAT8_DTYPES
from snapref_ray.models.safetensors_header import strip_prefix
from snapref_ray.models.vae_config import VAE_PREFIXES, VAEConfig, infer_vae_config, vae_compute_dtype_name

if TYPE_CHECKING:
    from snapref_ray.models.vae_memory import VAEMemoryPolicy

# The released VAE's shape (a frozen value, shared as the default).
REAL_VAE_CONFIG = VAEConfig()


class CausalConv3d(nn.Module):
    """A causal 3-D convolution stored with its real 5-D weight [out, in, kt, kh, kw], applied to one frame.

    With kt-1 zero frames padded in front, only the last temporal tap meets the frame, so the
    single-frame output is a Conv2d with `weight[:, :, -1]` and spatial padding kh//2.
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        kernel: tuple[int, int, int] = (3, 3, 3),
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_dim, in_dim, *kernel, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_dim, device=device, dtype=dtype))
        self.padding = kernel[1] // 2
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Conv3d's default initialisation, so a model built off `meta` is usable before loading.
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        bound = 1 / math.sqrt(self.weight[0].numel())
        nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x_BCHW, self.weight[:, :, -1], self.bias, padding=self.padding)

    def extra_repr(self) -> str:
        return f"weight={list(self.weight.shape)} (run as 2-D on one frame)"


class RMSNorm(nn.Module):
    """Wan's RMS_norm: F.normalize over channels · √C · γ (no bias); γ is [C,1,1,1] (or [C,1,1] in attention)."""

    def __init__(
        self, dim: int, gamma_rank: int = 4, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.scale = dim**0.5
        self.gamma = nn.Parameter(torch.ones(dim, *[1] * (gamma_rank - 1), device=device, dtype=dtype))

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        if x_BCHW.dtype == torch.float32 and x_BCHW.device.type == "cpu":
            # The same sum of squares as one contraction: torch's CPU vector_norm over the strided
            # channel axis is 1.4x (96 channels) to 10x (8) slower, and this allocates no [B,C,H,W]
            # temporary either (benchmarks/vae_memory.py measures the decode's peak).
            norm_B1HW = torch.einsum("bchw,bchw->bhw", x_BCHW, x_BCHW).sqrt_().unsqueeze_(1).clamp_min_(1e-12)
        else:
            # The norm accumulates in fp32 so bf16/fp16 activations are normalised as precisely as fp32 ones.
            norm_B1HW = torch.linalg.vector_norm(x_BCHW, dim=1, keepdim=True, dtype=torch.float32).clamp_min_(1e-12)
        gain_1C11 = (self.gamma.reshape(1, -1, 1, 1) * self.scale).to(x_BCHW.dtype)
        return (x_BCHW / norm_B1HW.to(x_BCHW.dtype)).mul_(gain_1C11)


class ResidualBlock(nn.Module):
    """y = conv(SiLU(norm(conv(SiLU(norm(x)))))) + shortcut(x); shortcut is a 1×1 conv when channels change."""

    def __init__(
        self, in_dim: int, out_dim: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        # Keys keep the indices of the original nn.Sequential (1, 4: SiLU; 5: Dropout) so files load as they are.
        self.residual = nn.ModuleDict(
            {
                "0": RMSNorm(in_dim, **kw),
                "2": CausalConv3d(in_dim, out_dim, **kw),
                "3": RMSNorm(out_dim, **kw),
                "6": CausalConv3d(out_dim, out_dim, **kw),
            }
        )
        self.shortcut = CausalConv3d(in_dim, out_dim, (1, 1, 1), **kw) if in_dim != out_dim else None

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        r = self.residual
        h = r["2"](F.silu(r["0"](x_BCHW), inplace=True))
        h = r["6"](F.silu(r["3"](h), inplace=True))
        return h.add_(self.shortcut(x_BCHW) if self.shortcut is not None else x_BCHW)


class AttentionBlock(nn.Module):
    """Single-head self-attention over the H·W positions of a frame (middle blocks only), residual."""

    def __init__(self, dim: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.norm = RMSNorm(dim, gamma_rank=3, **kw)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1, **kw)
        self.proj = nn.Conv2d(dim, dim, 1, **kw)

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x_BCHW.shape
        qkv_B3CL = self.to_qkv(self.norm(x_BCHW)).reshape(B, 3, C, H * W)
        # Contiguous [B, 1, L, C] copies: SDPA's fused kernels need the last dim contiguous. Given the
        # transposed views it falls back to the math path, which materialises the [L, L] scores
        # (1 GiB per fp32 image at 1024x1024, twice over with the softmax) and whose batched matmul
        # rounds differently for a batch than for its images one by one. The `del`s free each
        # intermediate once used, which halves this block's peak (it bounds a tiled decode's peak).
        q_B1LC, k_B1LC, v_B1LC = (qkv_B3CL[:, i].transpose(1, 2).unsqueeze(1).contiguous() for i in range(3))
        del qkv_B3CL
        out_B1LC = F.scaled_dot_product_attention(q_B1LC, k_B1LC, v_B1LC)  # scale 1/√C: one head of width C
        del q_B1LC, k_B1LC, v_B1LC
        # Back to contiguous NCHW: the transposed view would be channels-last for a batch but not for
        # one image (a batch stride of C), and the convolutions after it pick kernels by memory format.
        out_BCHW = out_B1LC.squeeze(1).transpose(1, 2).contiguous().reshape(B, C, H, W)
        del out_B1LC
        return self.proj(out_BCHW).add_(x_BCHW)


class Resample(nn.Module):
    """Halve H, W (ZeroPad2d right/bottom + stride-2 3×3 conv) or double them (nearest-exact ×2 + 3×3 conv to C/2).

    A temporal stage also holds `time_conv`, which is loaded but never run: Wan skips it for the
    first frame of a clip, and an image is only a first frame.
    """

    def __init__(
        self,
        dim: int,
        up: bool,
        temporal: bool,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.up = up
        # Key "resample.1": index 0 of the original nn.Sequential is the parameter-free pad / upsample.
        conv = nn.Conv2d(dim, dim // 2, 3, padding=1, **kw) if up else nn.Conv2d(dim, dim, 3, stride=2, **kw)
        self.resample = nn.ModuleDict({"1": conv})
        if temporal:
            self.time_conv = CausalConv3d(dim, dim * 2 if up else dim, (3, 1, 1), **kw)
        else:
            self.time_conv = None

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        if self.up:
            x_BCHW = F.interpolate(x_BCHW, scale_factor=2.0, mode="nearest-exact")
        else:
            x_BCHW = F.pad(x_BCHW, (0, 1, 0, 1))
        return self.resample["1"](x_BCHW)


def _head(in_dim: int, out_dim: int, **kw) -> nn.ModuleDict:
    # RMS_norm, SiLU (index 1), causal 3×3×3 conv: original nn.Sequential indices.
    return nn.ModuleDict({"0": RMSNorm(in_dim, **kw), "2": CausalConv3d(in_dim, out_dim, **kw)})


def _run_head(head: nn.ModuleDict, x_BCHW: torch.Tensor) -> torch.Tensor:
    return head["2"](F.silu(head["0"](x_BCHW), inplace=True))


def _middle(dim: int, **kw) -> nn.ModuleList:
    return nn.ModuleList([ResidualBlock(dim, dim, **kw), AttentionBlock(dim, **kw), ResidualBlock(dim, dim, **kw)])


class Encoder(nn.Module):
    """Pixels [B,3,H,W] → [B, 2·z_dim, H/f, W/f] (mean and log-variance, before the top-level `conv1`)."""

    def __init__(self, cfg: VAEConfig, **kw) -> None:
        super().__init__()
        dims = [cfg.base_dim * m for m in (1, *cfg.dim_mult)]
        self.conv1 = CausalConv3d(3, dims[0], **kw)
        blocks: list[nn.Module] = []
        for stage, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            for _ in range(cfg.num_res_blocks):
                blocks.append(ResidualBlock(in_dim, out_dim, **kw))
                in_dim = out_dim
            if stage < len(cfg.dim_mult) - 1:
                blocks.append(Resample(out_dim, up=False, temporal=cfg.temporal_downsample[stage], **kw))
        self.downsamples = nn.ModuleList(blocks)
        self.middle = _middle(dims[-1], **kw)
        self.head = _head(dims[-1], 2 * cfg.z_dim, **kw)

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        return self.global_stage(self.local_stage(x_BCHW))

    def local_stage(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        """conv1 and the down stages: pixels [B,3,H,W] → features [B, C_top, H/f, W/f].

        Convolutions only, so each feature depends on a bounded patch of pixels: a tiled encode
        computes this stage tile by tile.
        """
        x_BCHW = self.conv1(x_BCHW)
        for block in self.downsamples:
            x_BCHW = block(x_BCHW)
        return x_BCHW

    def global_stage(self, h_BCHW: torch.Tensor) -> torch.Tensor:
        """The middle (its attention reads every position) and the head, at latent resolution."""
        for block in self.middle:
            h_BCHW = block(h_BCHW)
        return _run_head(self.head, h_BCHW)


class Decoder(nn.Module):
    """Latent [B, z_dim, h, w] (after the top-level `conv2`) → pixels [B,3,f·h,f·w], unclamped."""

    def __init__(self, cfg: VAEConfig, **kw) -> None:
        super().__init__()
        top = cfg.base_dim * cfg.dim_mult[-1]
        dims = [top] + [cfg.base_dim * m for m in reversed(cfg.dim_mult)]
        self.conv1 = CausalConv3d(cfg.z_dim, top, **kw)
        self.middle = _middle(top, **kw)
        temporal_upsample = cfg.temporal_downsample[::-1]
        blocks: list[nn.Module] = []
        for stage, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            if stage > 0:
                in_dim //= 2  # the previous stage's upsampling conv halved the channels
            for _ in range(cfg.num_res_blocks + 1):
                blocks.append(ResidualBlock(in_dim, out_dim, **kw))
                in_dim = out_dim
            if stage < len(cfg.dim_mult) - 1:
                blocks.append(Resample(out_dim, up=True, temporal=temporal_upsample[stage], **kw))
        self.upsamples = nn.ModuleList(blocks)
        self.head = _head(dims[-1], 3, **kw)

    def forward(self, z_BCHW: torch.Tensor) -> torch.Tensor:
        return self.local_stage(self.global_stage(z_BCHW))

    def global_stage(self, z_BCHW: torch.Tensor) -> torch.Tensor:
        """conv1 and the middle (its attention reads every position): [B, z_dim, h, w] → [B, C_top, h, w]."""
        h_BCHW = self.conv1(z_BCHW)
        for block in self.middle:
            h_BCHW = block(h_BCHW)
        return h_BCHW

    def local_stage(self, h_BCHW: torch.Tensor) -> torch.Tensor:
        """The up stages and the head: features [B, C_top, h, w] → pixels [B, 3, f·h, f·w], unclamped.

        Convolutions and nearest upsampling only, so each pixel depends on a bounded patch of
        features: a tiled decode computes this stage (nearly all of the decode's memory) tile by tile.
        """
        for block in self.upsamples:
            h_BCHW = block(h_BCHW)
        return _run_head(self.head, h_BCHW)


class WanVAE(nn.Module):
    """The Wan 2.1 / Qwen-Image VAE for single images: `encode` pixels to μ, `decode` latents to pixels.

    Latents are in VAE space (not normalised; see `latent_format.process_in/process_out`).
    Computation runs in the dtype and on the device of the weights; results come back in the
    input's dtype.
    """

    def __init__(
        self,
        config: VAEConfig = REAL_VAE_CONFIG,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.config = config
        # Registration order = the file's key order: encoder, conv1, conv2, decoder.
        self.encoder = Encoder(config, **kw)
        self.conv1 = CausalConv3d(2 * config.z_dim, 2 * config.z_dim, (1, 1, 1), **kw)  # after the encoder
        self.conv2 = CausalConv3d(config.z_dim, config.z_dim, (1, 1, 1), **kw)  # before the decoder
        self.decoder = Decoder(config, **kw)
        # How `vae_memory.decode_in_budget` / `encode_in_budget` split work to fit the free memory;
        # None: decide from the device's free memory (the policy's defaults).
        self.memory_policy: VAEMemoryPolicy | None = None

    @property
    def device(self) -> torch.device:
        """Where the weights are (inputs are moved here)."""
        return self.conv2.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype, which is also the compute dtype."""
        return self.conv2.weight.dtype

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels in [-1, 1], [B,3,H,W] (or [B,3,1,H,W]), H and W multiples of 8 → latent μ [B,16,H/8,W/8].

        Like ComfyUI, the posterior mean is returned (no sampling); it is not normalised.
        """
        x_BCHW = self.prepare_pixels(pixels)
        mu_BCHW = self.encode_global(self.encode_local(x_BCHW))
        return mu_BCHW.to(_out_dtype(pixels, self.dtype))

    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        """Latent [B,16,h,w] (or [B,16,1,h,w]) in VAE space → pixels [B,3,8h,8w] clamped to [-1, 1]."""
        x_BCHW = self.decode_local(self.decode_global(self.prepare_latent(latent)))
        return x_BCHW.clamp_(-1.0, 1.0).to(_out_dtype(latent, self.dtype))

    # The stages a tiled encode / decode (models/vae_tiles.py) runs separately.
    def prepare_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """Checked pixels [B,3,H,W] (H, W multiples of the spatial factor) on the VAE's device and dtype."""
        x_BCHW = _single_frame(pixels, 3, "pixels")
        f = self.config.spatial_factor
        if x_BCHW.shape[-2] % f or x_BCHW.shape[-1] % f:
            raise ValueError(
                f"pixels: height and width must be multiples of {f}, got {list(x_BCHW.shape[-2:])}"
                " (crop or resize the image first)"
            )
        return x_BCHW.to(device=self.device, dtype=self.dtype)

    def prepare_latent(self, latent: torch.Tensor) -> torch.Tensor:
        """A checked latent [B, z_dim, h, w] on the VAE's device and dtype."""
        return _single_frame(latent, self.config.z_dim, "latent").to(device=self.device, dtype=self.dtype)

    def encode_local(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        """Prepared pixels → encoder features [B, C_top, H/f, W/f]; each reads a bounded patch of pixels."""
        return self.encoder.local_stage(x_BCHW)

    def encode_global(self, h_BCHW: torch.Tensor) -> torch.Tensor:
        """Encoder features [B, C_top, h, w] → μ [B, z_dim, h, w] (the attention reads every position)."""
        # Channels z_dim.. of conv1 are the log-variance, which nothing uses.
        return self.conv1(self.encoder.global_stage(h_BCHW))[:, : self.config.z_dim]

    def decode_global(self, z_BCHW: torch.Tensor) -> torch.Tensor:
        """Prepared latent → decoder features [B, C_top, h, w] (the attention reads every position)."""
        return self.decoder.global_stage(self.conv2(z_BCHW))

    def decode_local(self, h_BCHW: torch.Tensor) -> torch.Tensor:
        """Decoder features → pixels [B, 3, f·h, f·w], unclamped; each pixel reads a bounded patch of features."""
        return self.decoder.local_stage(h_BCHW)


@lru_cache(maxsize=8)
def vae_layout(config: VAEConfig) -> WanVAE:
    """A `WanVAE` of `config` on `meta`: its block lists without memory, for memory estimates and tiling."""
    return WanVAE(config, device="meta")


def _single_frame(x: torch.Tensor, channels: int, what: str) -> torch.Tensor:
    if x.ndim == 5:
        if x.shape[2] != 1:
            raise ValueError(
                f"{what}: this VAE handles single images only, got {x.shape[2]} frames (shape {list(x.shape)})"
            )
        x = x[:, :, 0]
    if x.ndim != 4 or x.shape[1] != channels:
        raise ValueError(
            f"{what}: expected shape [B, {channels}, H, W] or [B, {channels}, 1, H, W], got {list(x.shape)}"
        )
    return x


def _out_dtype(x: torch.Tensor, fallback: torch.dtype) -> torch.dtype:
    return x.dtype if x.is_floating_point() else fallback


def vae_compute_dtype(device: torch.device | str, dtype: torch.dtype) -> torch.dtype:
    """The dtype the VAE runs in beside a model computing in `dtype` on `device` (`vae_compute_dtype_name`'s rule)."""
    return getattr(torch, vae_compute_dtype_name(torch.device(device).type, str(dtype).removeprefix("torch.")))


def load_vae(
    path_or_state_dict: str | os.PathLike | StateDict,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> WanVAE:
    """Build a `WanVAE` from a safetensors file or state dict in original Wan key names (194 tensors at real size).

    The config is inferred from shapes, the module is built on `meta` and every tensor is checked
    by name and shape (`CheckpointError` names the key). `dtype` defaults to the file's dtype.
    """
    if isinstance(path_or_state_dict, (str, os.PathLike)):
        source = str(path_or_state_dict)
        sd = load_state_dict(path_or_state_dict)
    else:
        source, sd = "VAE state dict", path_or_state_dict
    sd = strip_prefix(sd, VAE_PREFIXES)
    config = infer_vae_config(sd, source)
    if dtype is None:
        file_dtype = sd["encoder.conv1.weight"].dtype
        dtype = torch.float32 if file_dtype in FLOAT8_DTYPES or not file_dtype.is_floating_point else file_dtype
    vae = WanVAE(config, device="meta")
    load_into_module(vae, sd, source=source, dtype=dtype, device=device, keep_fp8=False)
    return vae.eval()
