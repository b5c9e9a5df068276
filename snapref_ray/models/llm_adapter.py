"""Anima's LLM adapter: Qwen3 hidden states -> the T5-like context the Cosmos DiT was trained on.

Its queries are learned embeddings of the prompt's T5 token ids; they self-attend, then
cross-attend to the Qwen3 states (docs/design.md#llm-adapter). ComfyUI runs it without attention masks,
and so does this module; zero-padding the result to 512 rows is the caller's job (it also
applies the per-token prompt weights first).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from snapref_ray.models.dit_config import LLMAdapterConfig
from snapref_ray.models.ops import Linear, RMSNorm
from snapref_ray.models.rope import apply_rope, sequence_rope


class AdapterAttention(nn.Module):
    """Multi-head attention with per-head q/k RMSNorm and RoPE on both sides (positions of each side)."""

    def __init__(self, model_dim: int, context_dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        head_dim = model_dim // num_heads
        self.q_proj = Linear(model_dim, model_dim)
        self.q_norm = RMSNorm(head_dim)
        self.k_proj = Linear(context_dim, model_dim)
        self.k_norm = RMSNorm(head_dim)
        self.v_proj = Linear(context_dim, model_dim)
        self.o_proj = Linear(model_dim, model_dim)

    def forward(
        self,
        x_BLD: torch.Tensor,
        ctx_BSC: torch.Tensor,
        rope_q: tuple[torch.Tensor, torch.Tensor],
        rope_k: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        B, L, _ = x_BLD.shape
        S = ctx_BSC.shape[1]
        q_BHLD = self.q_norm(self.q_proj(x_BLD).view(B, L, self.num_heads, -1)).transpose(1, 2)
        k_BHSD = self.k_norm(self.k_proj(ctx_BSC).view(B, S, self.num_heads, -1)).transpose(1, 2)
        v_BHSD = self.v_proj(ctx_BSC).view(B, S, self.num_heads, -1).transpose(1, 2)
        q_BHLD = apply_rope(q_BHLD, *rope_q)
        k_BHSD = apply_rope(k_BHSD, *rope_k)
        out_BHLD = F.scaled_dot_product_attention(q_BHLD, k_BHSD, v_BHSD)
        return self.o_proj(out_BHLD.transpose(1, 2).reshape(B, L, -1))


class AdapterBlock(nn.Module):
    """Pre-norm block: self-attention over the T5 queries, cross-attention to Qwen3, GELU MLP."""

    def __init__(self, config: LLMAdapterConfig) -> None:
        super().__init__()
        D = config.model_dim
        self.norm_self_attn = RMSNorm(D)
        self.self_attn = AdapterAttention(D, D, config.num_heads)
        self.norm_cross_attn = RMSNorm(D)
        self.cross_attn = AdapterAttention(D, config.source_dim, config.num_heads)
        self.norm_mlp = RMSNorm(D)
        self.mlp = nn.Sequential(
            Linear(D, config.mlp_hidden, bias=True), nn.GELU(), Linear(config.mlp_hidden, D, bias=True)
        )

    def forward(self, x_BLD: torch.Tensor, source_BSC: torch.Tensor, rope_target, rope_source) -> torch.Tensor:
        h = self.norm_self_attn(x_BLD)
        x_BLD = x_BLD + self.self_attn(h, h, rope_target, rope_target)
        x_BLD = x_BLD + self.cross_attn(self.norm_cross_attn(x_BLD), source_BSC, rope_target, rope_source)
        return x_BLD + self.mlp(self.norm_mlp(x_BLD))


class LLMAdapter(nn.Module):
    """The `llm_adapter.*` part of an Anima DiT file (docs/design.md#llm-adapter)."""

    def __init__(self, config: LLMAdapterConfig) -> None:
        super().__init__()
        self.config = config
        rows, width = config.vocab_size, config.model_dim
        if torch.get_default_device().type == "meta":
            # How the loaders build it: no initialisation to run. nn.Embedding's normal_ on the meta
            # device goes through torch's Python reference, which imports torch._dynamo (~1 CPU-s).
            self.embed = nn.Embedding(rows, width, _weight=torch.empty(rows, width))
        else:
            self.embed = nn.Embedding(rows, width)
        self.blocks = nn.ModuleList(AdapterBlock(config) for _ in range(config.num_blocks))
        self.out_proj = Linear(config.model_dim, config.model_dim, bias=True)
        self.norm = RMSNorm(config.model_dim)

    def forward(self, source_hidden: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
        """Qwen3 states [B, Lq, source_dim] and T5 ids [B, Lt] -> context rows [B, Lt, model_dim].

        Computes in `source_hidden`'s dtype (ComfyUI casts the Qwen states to the DiT's dtype first).
        """
        dtype, device = source_hidden.dtype, source_hidden.device
        x_BLD = self.embed(target_ids.to(device)).to(dtype)
        # RoPE angles in fp32, applied in the activation dtype (as ComfyUI/HF do for this adapter).
        rope_target = tuple(t.to(dtype) for t in sequence_rope(x_BLD.shape[1], self.config.head_dim, device=device))
        rope_source = tuple(
            t.to(dtype) for t in sequence_rope(source_hidden.shape[1], self.config.head_dim, device=device)
        )
        for block in self.blocks:
            x_BLD = block(x_BLD, source_hidden, rope_target, rope_source)
        return self.norm(self.out_proj(x_BLD))
