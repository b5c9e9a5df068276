"""The Anima DiT: Cosmos-Predict2-2B "MiniTrainDIT" plus Anima's LLM adapter (docs/design.md#dit).

One forward maps a normalised latent, a noise level sigma and a text context to the flow
velocity. The same blocks also run the SnapRef reference stream (`reference_kv`): sigma 0,
the reference LoRA branch on, the tokens at their own RoPE offset, and each block's
self-attention keys/values collected into a sink instead of reading anything. Nothing is
patched: runtime LoRAs are arguments of the block linears, and the reference read is an
argument of the one self-attention function (`snapref_ray.models.attention.attention`).

Module names mirror the checkpoint keys exactly (`blocks.N.self_attn.q_proj`, ...), so a file
loads with no renaming; the real-size layout is pinned by tests against a key dump.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from snapref_ray.geometry import PATCH
from snapref_ray.models.attention import RefRead, attention
from snapref_ray.models.checkpoint import load_into_module, load_state_dict
from snapref_ray.models.dit_config import BLOCK_LINEARS, DiTConfig
from snapref_ray.models.llm_adapter import LLMAdapter
from snapref_ray.models.ops import FLOAT8_DTYPES, BlockLoRA, Linear, RMSNorm
from snapref_ray.models.rope import apply_rope, dit_rope
from snapref_ray.models.safetensors_header import strip_prefix

EPS = 1e-6
_NO_LORA: BlockLoRA = {}
KVSink = list[tuple[torch.Tensor, torch.Tensor]]
Rope = tuple[torch.Tensor, torch.Tensor]
# How a forward runs one block: (block, x, t, context, rope, lora, ref, cross_attention) -> x. None = the
# block module itself; models/compiled.py passes its compiled graph (one for every block).
BlockRunner = Callable[..., torch.Tensor]


class TimeEmbedding(NamedTuple):
    """The two timestep terms every modulation uses, both [B, 1, ...] in the compute dtype."""

    emb: torch.Tensor  # t_embedding_norm(sinusoid), [B, 1, D]
    adaln_lora: torch.Tensor  # shared adaLN-LoRA term A added to every modulation, [B, 1, 3D]


# --- small functions the blocks are written in -----------------------------------------------


def timestep_sinusoid(sigma_B: torch.Tensor, dim: int) -> torch.Tensor:
    """[cos(t f_k), sin(t f_k)] with f_k = 10000^(-k / (dim/2)), cos first, fp32: [B, dim]."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=sigma_B.device) / half)
    angles_BK = sigma_B.float()[:, None] * freqs[None]
    return torch.cat([angles_BK.cos(), angles_BK.sin()], dim=-1)


def modulation(adaln: nn.Module, t: TimeEmbedding, chunks: int) -> tuple[torch.Tensor, ...]:
    """(shift, scale[, gate]) of one sub-layer: its own adaLN bottleneck plus the shared term A."""
    m = adaln(t.emb) + t.adaln_lora[..., : chunks * t.emb.shape[-1]]
    return m.chunk(chunks, dim=-1)


def modulate(x_BLD: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """LN(x) * (1 + scale) + shift (LayerNorm without affine), cast to the compute dtype."""
    normed = F.layer_norm(x_BLD, x_BLD.shape[-1:], eps=EPS)
    return (normed * (1 + scale) + shift).to(dtype)


def gated_residual(x_BLD: torch.Tensor, gate: torch.Tensor, update_BLD: torch.Tensor) -> torch.Tensor:
    """x + gate * update, in the residual stream's dtype."""
    return torch.addcmul(x_BLD, gate.to(x_BLD.dtype), update_BLD.to(x_BLD.dtype))


def adaln_bottleneck(dim: int, rank: int, out_dim: int) -> nn.Sequential:
    """SiLU -> D x rank -> rank x out (keys `.1.weight`, `.2.weight`)."""
    return nn.Sequential(nn.SiLU(), Linear(dim, rank), Linear(rank, out_dim))


def patchify(x_BCTHW: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Pad H, W circularly to multiples of the patch, add the zero padding-mask channel, and cut
    2x2 patches: returns ([B, T*Hp*Wp, (C+1)*4] with feature c*4 + row*2 + col, (T, Hp, Wp))."""
    B, C, T, H, W = x_BCTHW.shape
    pad_h, pad_w = -H % PATCH, -W % PATCH
    if pad_h or pad_w:
        x_BCTHW = F.pad(x_BCTHW, (0, pad_w, 0, pad_h, 0, 0), mode="circular")
    Hp, Wp = (H + pad_h) // PATCH, (W + pad_w) // PATCH
    # Anima never passes a padding mask: ComfyUI concatenates zeros as channel C.
    x = torch.cat([x_BCTHW, x_BCTHW.new_zeros(B, 1, T, H + pad_h, W + pad_w)], dim=1)
    x = x.reshape(B, C + 1, T, Hp, PATCH, Wp, PATCH).permute(0, 2, 3, 5, 1, 4, 6)  # [B,T,Hp,Wp,C+1,2,2]
    return x.reshape(B, T * Hp * Wp, (C + 1) * PATCH * PATCH), (T, Hp, Wp)


def unpatchify(y_BLF: torch.Tensor, grid: tuple[int, int, int], channels: int) -> torch.Tensor:
    """[B, T*Hp*Wp, 4C] with feature row*2C + col*C + c (channel-last inside the patch) -> [B, C, T, 2Hp, 2Wp]."""
    B = y_BLF.shape[0]
    T, Hp, Wp = grid
    y = y_BLF.reshape(B, T, Hp, Wp, PATCH, PATCH, channels).permute(0, 6, 1, 2, 4, 3, 5)  # [B,C,T,Hp,2,Wp,2]
    return y.reshape(B, channels, T, Hp * PATCH, Wp * PATCH)


# --- sub-layers -------------------------------------------------------------------------------


class SelfAttention(nn.Module):
    """Self-attention over the image tokens with per-head q/k RMSNorm and 3D RoPE."""

    def __init__(self, dim: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = Linear(dim, num_heads * head_dim)
        self.q_norm = RMSNorm(head_dim)
        self.k_proj = Linear(dim, num_heads * head_dim)
        self.k_norm = RMSNorm(head_dim)
        self.v_proj = Linear(dim, num_heads * head_dim)
        self.output_proj = Linear(num_heads * head_dim, dim)

    def forward(
        self, h_BLD: torch.Tensor, rope: Rope, lora: BlockLoRA, ref: RefRead | None, kv_sink: KVSink | None
    ) -> torch.Tensor:
        B, L, _ = h_BLD.shape
        q_BLHD = self.q_proj(h_BLD, lora.get("self_attn.q_proj")).view(B, L, self.num_heads, -1)
        k_BLHD = self.k_proj(h_BLD, lora.get("self_attn.k_proj")).view(B, L, self.num_heads, -1)
        v_BLHD = self.v_proj(h_BLD, lora.get("self_attn.v_proj")).view(B, L, self.num_heads, -1)
        q_BHLD = apply_rope(self.q_norm(q_BLHD).transpose(1, 2), *rope)
        k_BHLD = apply_rope(self.k_norm(k_BLHD).transpose(1, 2), *rope)
        v_BHLD = v_BLHD.transpose(1, 2)
        if kv_sink is not None:  # the reference stream: keep this block's K (normed, rotated) and V
            kv_sink.append((k_BHLD[0].contiguous(), v_BHLD[0].contiguous()))
        return self.output_proj(attention(q_BHLD, k_BHLD, v_BHLD, ref), lora.get("self_attn.output_proj"))


class CrossAttention(nn.Module):
    """Attention from the image tokens to the text context (no RoPE, no mask)."""

    def __init__(self, dim: int, context_dim: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = Linear(dim, num_heads * head_dim)
        self.q_norm = RMSNorm(head_dim)
        self.k_proj = Linear(context_dim, num_heads * head_dim)
        self.k_norm = RMSNorm(head_dim)
        self.v_proj = Linear(context_dim, num_heads * head_dim)
        self.output_proj = Linear(num_heads * head_dim, dim)

    def forward(self, h_BLD: torch.Tensor, context_BSC: torch.Tensor, lora: BlockLoRA) -> torch.Tensor:
        B, L, _ = h_BLD.shape
        S = context_BSC.shape[1]
        q_BHLD = self.q_norm(self.q_proj(h_BLD, lora.get("cross_attn.q_proj")).view(B, L, self.num_heads, -1))
        k_BHSD = self.k_norm(self.k_proj(context_BSC, lora.get("cross_attn.k_proj")).view(B, S, self.num_heads, -1))
        v_BHSD = self.v_proj(context_BSC, lora.get("cross_attn.v_proj")).view(B, S, self.num_heads, -1)
        out_BHLD = F.scaled_dot_product_attention(
            q_BHLD.transpose(1, 2), k_BHSD.transpose(1, 2), v_BHSD.transpose(1, 2)
        )
        return self.output_proj(out_BHLD.transpose(1, 2).reshape(B, L, -1), lora.get("cross_attn.output_proj"))


class MLP(nn.Module):
    """layer2(GELU(layer1(h))), exact (erf) GELU, no biases."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.layer1 = Linear(dim, hidden)
        self.layer2 = Linear(hidden, dim)

    def forward(self, h_BLD: torch.Tensor, lora: BlockLoRA) -> torch.Tensor:
        return self.layer2(F.gelu(self.layer1(h_BLD, lora.get("mlp.layer1"))), lora.get("mlp.layer2"))


class DiTBlock(nn.Module):
    """adaLN-modulated block: self-attention, cross-attention, MLP, each a gated residual update."""

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        D, r = config.model_channels, config.adaln_lora_dim
        self.self_attn = SelfAttention(D, config.num_heads, config.head_dim)
        self.cross_attn = CrossAttention(D, config.context_dim, config.num_heads, config.head_dim)
        self.mlp = MLP(D, config.mlp_hidden)
        self.adaln_modulation_self_attn = adaln_bottleneck(D, r, 3 * D)
        self.adaln_modulation_cross_attn = adaln_bottleneck(D, r, 3 * D)
        self.adaln_modulation_mlp = adaln_bottleneck(D, r, 3 * D)

    def forward(
        self,
        x_BLD: torch.Tensor,
        t: TimeEmbedding,
        context_BSC: torch.Tensor,
        rope: Rope,
        *,
        lora: BlockLoRA | None = None,
        ref: RefRead | None = None,
        kv_sink: KVSink | None = None,
        cross_attention: bool = True,
    ) -> torch.Tensor:
        """x is the residual stream [B, L, D] (fp32 when computing in fp16); sub-layers compute in t's dtype.

        cross_attention=False skips the text cross-attention (ArcAnima v2's reference stream).
        """
        lora = lora or _NO_LORA
        dtype = t.emb.dtype
        shift, scale, gate = modulation(self.adaln_modulation_self_attn, t, 3)
        x_BLD = gated_residual(
            x_BLD, gate, self.self_attn(modulate(x_BLD, shift, scale, dtype), rope, lora, ref, kv_sink)
        )
        if cross_attention:
            shift, scale, gate = modulation(self.adaln_modulation_cross_attn, t, 3)
            x_BLD = gated_residual(
                x_BLD, gate, self.cross_attn(modulate(x_BLD, shift, scale, dtype), context_BSC, lora)
            )
        shift, scale, gate = modulation(self.adaln_modulation_mlp, t, 3)
        return gated_residual(x_BLD, gate, self.mlp(modulate(x_BLD, shift, scale, dtype), lora))


class FinalLayer(nn.Module):
    """Modulated LayerNorm (shift, scale) then D -> patch*patch*C."""

    def __init__(self, dim: int, rank: int, out_features: int) -> None:
        super().__init__()
        self.linear = Linear(dim, out_features)
        self.adaln_modulation = adaln_bottleneck(dim, rank, 2 * dim)

    def forward(self, x_BLD: torch.Tensor, t: TimeEmbedding) -> torch.Tensor:
        shift, scale = modulation(self.adaln_modulation, t, 2)
        return self.linear(modulate(x_BLD, shift, scale, t.emb.dtype))


class SinusoidalTimesteps(nn.Module):
    """`t_embedder.0`: the fp32 sinusoid of sigma (no weights)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, sigma_B: torch.Tensor) -> torch.Tensor:
        return timestep_sinusoid(sigma_B, self.dim)


class TimestepEmbedding(nn.Module):
    """`t_embedder.1`: the shared adaLN-LoRA term A = linear_2(SiLU(linear_1(e))), D -> 3D."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear_1 = Linear(dim, dim)
        self.linear_2 = Linear(dim, 3 * dim)

    def forward(self, e_BD: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(e_BD)))


class PatchEmbed(nn.Module):
    """`x_embedder`: index 0 of `proj` is ComfyUI's patch rearrangement (see `patchify`); kept for the key names."""

    def __init__(self, in_features: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Sequential(nn.Identity(), Linear(in_features, dim))

    def forward(self, patches_BLF: torch.Tensor) -> torch.Tensor:
        return self.proj(patches_BLF)


# --- the model --------------------------------------------------------------------------------


class AnimaDiT(nn.Module):
    """Anima's DiT with its LLM adapter; weights come from `load_dit` (build on meta, then load)."""

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        self.config = config
        D = config.model_channels
        # Attribute order = the checkpoint's key order (pinned by the real-size key test).
        self.t_embedder = nn.Sequential(SinusoidalTimesteps(D), TimestepEmbedding(D))
        self.x_embedder = PatchEmbed((config.in_channels + 1) * PATCH * PATCH, D)
        self.blocks = nn.ModuleList(DiTBlock(config) for _ in range(config.num_blocks))
        self.final_layer = FinalLayer(D, config.adaln_lora_dim, PATCH * PATCH * config.in_channels)
        self.t_embedding_norm = RMSNorm(D)
        self.llm_adapter = LLMAdapter(config.adapter)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype activations run in: the weights' dtype, or the norms' dtype for float8 weights."""
        w = self.x_embedder.proj[1].weight
        return self.t_embedding_norm.weight.dtype if w.dtype in FLOAT8_DTYPES else w.dtype

    def token_grid(self, latent_h: int, latent_w: int) -> tuple[int, int, int]:
        """(T, Hp, Wp) of an image latent of this size, after padding to the patch size."""
        return 1, -(-latent_h // PATCH), -(-latent_w // PATCH)

    def forward(
        self,
        x: torch.Tensor,
        sigma: torch.Tensor | float,
        context: torch.Tensor,
        *,
        loras: Sequence[BlockLoRA | None] | None = None,
        refs: Sequence[RefRead | None] | None = None,
        run_block: BlockRunner | None = None,
    ) -> torch.Tensor:
        """Velocity for latent x ([B,16,1,H,W] or [B,16,H,W], normalised) at noise level sigma ([B] or scalar).

        context: [B, S, context_dim] adapter output (zero-padded to 512 rows by the caller).
        loras[i] / refs[i]: runtime LoRA branch and reference read of model block i (None = none).
        Computes in the weights' dtype (fp16: residual stream in fp32) and returns x's shape and dtype.
        run_block: how each block runs (None: the module; models/compiled.py: its compiled graph).
        """
        self._check_per_block_args(loras, refs)
        dtype = self.compute_dtype
        x_BCTHW = x if x.ndim == 5 else x.unsqueeze(2)
        B, C, T, H, W = x_BCTHW.shape
        sigma_B = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).reshape(-1).expand(B)
        patches, grid = patchify(x_BCTHW.to(dtype))
        t = self._time_embedding(sigma_B, dtype)
        rope = dit_rope(grid, self.config.head_dim, device=x.device)  # once per forward, shared by all blocks
        h_BLD = self._run_blocks(
            self.x_embedder(patches), t, context.to(dtype), rope, loras, refs, None, run_block=run_block
        )
        y_BLF = self.final_layer(h_BLD.to(dtype), t)
        out = unpatchify(y_BLF, grid, self.config.in_channels)[..., :T, :H, :W]
        return out.to(x.dtype).reshape(x.shape)

    def reference_kv(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None,
        *,
        loras: Sequence[BlockLoRA | None] | None = None,
        rope_offset: tuple[int, int, int] = (0, 0, 0),
        cross_attention: bool = True,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The SnapRef reference stream: per block, self-attention (K, V) of latent x, each [heads, tokens, head_dim].

        x ([1,16,1,H,W] or [1,16,H,W]) runs through every block at sigma 0 with `loras`, its tokens at RoPE
        positions shifted by `rope_offset` (dt, dh, dw), attending only to themselves. K is after k_norm
        and RoPE, V as projected. Computes in x's dtype (pass fp32 for an fp32 stream on a bf16/fp8 model).
        cross_attention=False: the tokens skip the text cross-attention (ArcAnima v2); context may be None.
        """
        self._check_per_block_args(loras, None)
        x_BCTHW = x if x.ndim == 5 else x.unsqueeze(2)
        if x_BCTHW.shape[0] != 1:
            raise ValueError(f"reference_kv: expected one reference latent (batch 1), got batch {x_BCTHW.shape[0]}")
        dtype = x.dtype
        patches, grid = patchify(x_BCTHW)
        t = self._time_embedding(torch.zeros(1, device=x.device), dtype)
        rope = dit_rope(grid, self.config.head_dim, offset=rope_offset, device=x.device)
        sink: KVSink = []
        # The last block's cross-attention and MLP do not affect any K/V, but running them keeps one code path.
        if cross_attention and context is None:
            raise ValueError("reference_kv: a context is needed unless cross_attention=False")
        self._run_blocks(
            self.x_embedder(patches),
            t,
            context.to(dtype) if context is not None else None,
            rope,
            loras,
            None,
            sink,
            cross_attention=cross_attention,
        )
        return sink

    def _time_embedding(self, sigma_B: torch.Tensor, dtype: torch.dtype) -> TimeEmbedding:
        e_B1D = self.t_embedder[0](sigma_B).to(dtype)[:, None]
        return TimeEmbedding(emb=self.t_embedding_norm(e_B1D), adaln_lora=self.t_embedder[1](e_B1D))

    def _run_blocks(
        self,
        x_BLD: torch.Tensor,
        t: TimeEmbedding,
        context_BSC: torch.Tensor,
        rope: Rope,
        loras: Sequence[BlockLoRA | None] | None,
        refs: Sequence[RefRead | None] | None,
        kv_sink: KVSink | None,
        cross_attention: bool = True,
        run_block: BlockRunner | None = None,
    ) -> torch.Tensor:
        # fp16 overflows in the residual stream: ComfyUI keeps it in fp32 (sub-layers still run in fp16).
        if x_BLD.dtype == torch.float16:
            x_BLD = x_BLD.float()
        for i, block in enumerate(self.blocks):
            if run_block is not None and kv_sink is None:
                lora, ref = loras[i] if loras else None, refs[i] if refs else None
                x_BLD = run_block(block, x_BLD, t, context_BSC, rope, lora, ref, cross_attention)
                continue
            x_BLD = block(
                x_BLD,
                t,
                context_BSC,
                rope,
                lora=loras[i] if loras else None,
                ref=refs[i] if refs else None,
                kv_sink=kv_sink,
                cross_attention=cross_attention,
            )
        return x_BLD

    def _check_per_block_args(
        self, loras: Sequence[BlockLoRA | None] | None, refs: Sequence[RefRead | None] | None
    ) -> None:
        # A misnamed LoRA path or a list built for another block count would otherwise be ignored silently.
        for name, values in (("loras", loras), ("refs", refs)):
            if values is not None and len(values) != self.config.num_blocks:
                raise ValueError(
                    f"{name}: expected one entry per model block ({self.config.num_blocks}), got {len(values)}"
                )
        for i, lora in enumerate(loras or ()):
            unknown = sorted(set(lora or ()) - set(BLOCK_LINEARS))
            if unknown:
                raise ValueError(
                    f"loras[{i}]: unknown module path(s) {unknown}; expected some of {list(BLOCK_LINEARS)}"
                )


def load_dit(
    path_or_state_dict: str | os.PathLike | Mapping[str, torch.Tensor],
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> AnimaDiT:
    """Load an Anima DiT (+ LLM adapter) from a safetensors file or a state dict.

    Accepts the prefixes `net.`, `model.diffusion_model.`, `diffusion_model.` or none; ignores extra
    tensors (e.g. `pos_embedder.seq`); keeps float8 linear weights (with `.weight_scale` /
    `.scale_weight`) and dequantises them per call. `dtype` None keeps the file's float dtypes;
    otherwise every non-float8 tensor is cast to it, which also sets the compute dtype of a
    float8 model (e.g. bf16 on GPU).
    Missing or mis-shaped tensors raise `CheckpointError` naming the file, key, expected and found.
    """
    if isinstance(path_or_state_dict, Mapping):
        source, sd = "state dict", dict(path_or_state_dict)
    else:
        source, sd = str(path_or_state_dict), load_state_dict(path_or_state_dict)
    sd = strip_prefix(sd)
    config = DiTConfig.from_state_dict(sd, source=source)
    with torch.device("meta"):
        model = AnimaDiT(config)
    load_into_module(model, sd, source=source, dtype=dtype, device=device)
    return model.eval().requires_grad_(False)


__all__ = ["AnimaDiT", "BlockRunner", "DiTBlock", "load_dit"]
