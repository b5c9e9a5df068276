"""Qwen3 text encoder (Anima uses Qwen3-0.6B-Base), returning the final hidden state.

Anima's text side reads the last hidden state of Qwen3 after the final RMSNorm (what
transformers calls `Qwen3Model(...).last_hidden_state`); there is no LM head. ComfyUI keeps the
weights in the file's dtype (bf16) but runs the forward in fp32 ("manual cast" with fp32 input
embeddings), so this module does the same: every layer computes in the dtype of its input, and
the input is always fp32.

Architecture (docs/design.md#qwen3-text-encoder): GQA self-attention with per-head RMSNorm on q and
k before rotate-half RoPE (theta 1e6), SiLU-gated MLP, pre-norm residual blocks, causal mask
plus an additive padding mask of finfo.min / 4, as ComfyUI's llama.py builds it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from snapref_ray.models.checkpoint import StateDict, load_into_module, load_state_dict
from snapref_ray.models.ops import Linear, RMSNorm
from snapref_ray.models.safetensors_header import CheckpointError, strip_prefix

# The forward always runs in this dtype whatever the weights are stored as (ComfyUI manual_cast).
COMPUTE_DTYPE = torch.float32


@dataclass(frozen=True)
class Qwen3Config:
    """Shape of a Qwen3 decoder, inferred from a checkpoint by `from_state_dict`."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int  # query heads; q_proj is [num_heads * head_dim, hidden]
    num_kv_heads: int  # key/value heads (GQA): each serves num_heads // num_kv_heads query heads
    head_dim: int  # 128 for Qwen3-0.6B, so q_proj is wider (2048) than the residual (1024)
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6  # not stored in the weights; Qwen3's published value

    @classmethod
    def from_state_dict(cls, sd: StateDict, source: str = "<state dict>") -> Qwen3Config:
        """Infer the config from tensor shapes (keys without the `model.` prefix)."""

        def shape(key: str) -> tuple[int, ...]:
            if key not in sd:
                raise CheckpointError(f"{source}: not a Qwen3 text encoder: missing tensor 'model.{key}'")
            return tuple(sd[key].shape)

        vocab_size, hidden = shape("embed_tokens.weight")
        (head_dim,) = shape("layers.0.self_attn.q_norm.weight")
        q_out = shape("layers.0.self_attn.q_proj.weight")[0]
        kv_out = shape("layers.0.self_attn.k_proj.weight")[0]
        intermediate = shape("layers.0.mlp.gate_proj.weight")[0]
        layer_ids = sorted({int(m.group(1)) for k in sd if (m := re.match(r"layers\.(\d+)\.", k))})
        if layer_ids != list(range(len(layer_ids))):
            missing = sorted(set(range(max(layer_ids) + 1)) - set(layer_ids))
            raise CheckpointError(
                f"{source}: Qwen3 layers are not numbered 0..{max(layer_ids)}: no tensors for layer(s) {missing}"
            )
        if q_out % head_dim or kv_out % head_dim:
            raise CheckpointError(
                f"{source}: q_proj/k_proj widths {q_out}/{kv_out} are not multiples of "
                f"head_dim {head_dim} (from q_norm)"
            )
        num_heads, num_kv_heads = q_out // head_dim, kv_out // head_dim
        if num_heads % num_kv_heads:
            raise CheckpointError(f"{source}: {num_heads} query heads cannot share {num_kv_heads} kv heads")
        return cls(
            vocab_size=vocab_size,
            hidden_size=hidden,
            num_layers=len(layer_ids),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=intermediate,
        )


# The Qwen3-0.6B(-Base) text encoder Anima ships with: 596,049,920 parameters.
QWEN3_06B = Qwen3Config(
    vocab_size=151936,
    hidden_size=1024,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=3072,
)


class TokenEmbedding(nn.Module):
    """Token embedding table kept in its stored dtype; looks up rows and returns them as fp32."""

    def __init__(self, num: int, dim: int, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, dim, device=device, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight).to(COMPUTE_DTYPE)


def rope_cos_sin(length: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [L, head_dim] of rotate-half RoPE at positions 0..L-1 (fp32, computed per call)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim))
    angles = torch.arange(length, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)  # [L, head_dim]: both halves share a frequency
    return angles.cos(), angles.sin()


def apply_rope(x_BHLD: torch.Tensor, cos_LD: torch.Tensor, sin_LD: torch.Tensor) -> torch.Tensor:
    half = x_BHLD.shape[-1] // 2
    rotated = torch.cat([-x_BHLD[..., half:], x_BHLD[..., :half]], dim=-1)
    return x_BHLD * cos_LD + rotated * sin_LD


def attention_bias(attention_mask: torch.Tensor | None, length: int, device: torch.device) -> torch.Tensor | None:
    """Additive [B|1, 1, L, L] bias: causal + padded keys, each finfo.min / 4 as ComfyUI adds them.

    Returns None when there is nothing but causality to mask (SDPA's is_causal is then used; a
    -finfo.min/4 logit and a masked-out key both contribute exactly 0 after softmax in fp32).
    """
    if attention_mask is None:
        return None
    neg = torch.finfo(COMPUTE_DTYPE).min / 4
    pad_B11L = (attention_mask.to(device) == 0)[:, None, None, :]
    bias = torch.where(pad_B11L, neg, 0.0).to(COMPUTE_DTYPE).expand(-1, 1, length, length)
    causal_LL = torch.full((length, length), neg, device=device, dtype=COMPUTE_DTYPE).triu(1)
    return bias + causal_LL


class Qwen3Attention(nn.Module):
    """GQA self-attention with q/k RMSNorm before RoPE; no biases."""

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size)
        self.q_norm = RMSNorm(cfg.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, eps=cfg.rms_norm_eps)

    def forward(
        self, x_BLC: torch.Tensor, cos_LD: torch.Tensor, sin_LD: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        B, L, _ = x_BLC.shape
        q_BHLD = self.q_norm(self.q_proj(x_BLC).view(B, L, self.num_heads, self.head_dim)).transpose(1, 2)
        k_BKLD = self.k_norm(self.k_proj(x_BLC).view(B, L, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v_BKLD = self.v_proj(x_BLC).view(B, L, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q_BHLD, k_BKLD = apply_rope(q_BHLD, cos_LD, sin_LD), apply_rope(k_BKLD, cos_LD, sin_LD)
        # Query head h reads kv head h // group (transformers' repeat_kv order).
        group = self.num_heads // self.num_kv_heads
        k_BHLD = k_BKLD.repeat_interleave(group, dim=1)
        v_BHLD = v_BKLD.repeat_interleave(group, dim=1)
        out_BHLD = F.scaled_dot_product_attention(
            q_BHLD, k_BHLD, v_BHLD, attn_mask=bias, is_causal=bias is None and L > 1
        )
        return self.o_proj(out_BHLD.transpose(1, 2).reshape(B, L, self.num_heads * self.head_dim))


class Qwen3MLP(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3Layer(nn.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = Qwen3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = Qwen3MLP(cfg)

    def forward(
        self, x: torch.Tensor, cos_LD: torch.Tensor, sin_LD: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_LD, sin_LD, bias)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Encoder(nn.Module):
    """Qwen3 decoder without LM head; `forward` returns the final-norm hidden state in fp32.

    Parameter names are the checkpoint's keys without the `model.` prefix
    (`embed_tokens.weight`, `layers.N.self_attn.q_proj.weight`, ..., `norm.weight`).
    """

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = TokenEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3Layer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, L] -> hidden states [B, L, hidden] (fp32).

        attention_mask [B, L]: 1 for tokens, 0 for padding (keys at 0 are masked for every query;
        positions stay 0..L-1 whatever the padding, as in ComfyUI and transformers).
        """
        device = self.device
        input_ids = input_ids.to(device)
        x_BLC = self.embed_tokens(input_ids)
        length = input_ids.shape[1]
        cos_LD, sin_LD = rope_cos_sin(length, self.config.head_dim, self.config.rope_theta, device)
        bias = attention_bias(attention_mask, length, device)
        for layer in self.layers:
            x_BLC = layer(x_BLC, cos_LD, sin_LD, bias)
        return self.norm(x_BLC)


def load_text_encoder(
    path_or_state_dict: str | os.PathLike | StateDict,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> Qwen3Encoder:
    """Build a Qwen3Encoder from a safetensors file or a state dict.

    Keys are `model.*` (as in qwen_3_06b_base.safetensors) or the same without the prefix;
    `lm_head.weight` and other unknown keys are ignored. Weights stay in their stored dtype unless
    `dtype` is given (float8 Linear weights stay float8 with their scale either way); the forward
    is computed in fp32 regardless.
    """
    if isinstance(path_or_state_dict, dict):
        source, sd = "<state dict>", path_or_state_dict
    else:
        source, sd = str(path_or_state_dict), load_state_dict(path_or_state_dict)
    sd = strip_prefix(sd, ("model.",))
    config = Qwen3Config.from_state_dict(sd, source)
    with torch.device("meta"):
        model = Qwen3Encoder(config)
    load_into_module(model, sd, source=source, dtype=dtype, device=device)
    return model.eval()
