"""Matmul FLOPs of one Anima DiT forward, counted from its config and token counts.

The one FLOP model of the project: the benchmarks' achieved GFLOP/s and the timing table's "FLOP
model x no ref" column both rest on it. It counts matrix-multiply FLOPs only (2 per multiply-add):
every linear (the block linears, adaLN bottlenecks, embedders, final layer, runtime LoRA branches)
and the two matmuls of every attention (QK^T and AV). Norms, RoPE, softmax and elementwise work are
not counted, so it is a floor: memory traffic weighs more on small GPUs and on CPUs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from snapref_ray.geometry import PATCH
from snapref_ray.models.dit_config import BLOCK_LINEARS, DiTConfig


def _linear_flops(tokens: int, fan_in: int, fan_out: int) -> float:
    return 2.0 * tokens * fan_in * fan_out


def _lora_flops(tokens: int, fan_in: int, fan_out: int, rank: int) -> float:
    # down (in -> r) then up (r -> out), unmerged, as ops.LoRAPair.delta computes it.
    return 2.0 * tokens * rank * (fan_in + fan_out)


def block_linear_dims(config: DiTConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of the ten adaptable linears of a block (`BLOCK_LINEARS` order: module path -> dims)."""
    D, C, M = config.model_channels, config.context_dim, config.mlp_hidden
    inner = config.num_heads * config.head_dim
    dims = {
        "self_attn.q_proj": (D, inner),
        "self_attn.k_proj": (D, inner),
        "self_attn.v_proj": (D, inner),
        "self_attn.output_proj": (inner, D),
        "cross_attn.q_proj": (D, inner),
        "cross_attn.k_proj": (C, inner),
        "cross_attn.v_proj": (C, inner),
        "cross_attn.output_proj": (inner, D),
        "mlp.layer1": (D, M),
        "mlp.layer2": (M, D),
    }
    return {path: dims[path] for path in BLOCK_LINEARS}


def dit_forward_flop_breakdown(
    config: DiTConfig,
    *,
    rows: int,
    tokens: int,
    context_rows: int,
    reading_rows: int = 0,
    ref_tokens: int = 0,
    lora_ranks: Mapping[str, int] | None = None,
    final_layer: bool = True,
) -> dict[str, float]:
    """Matmul FLOPs of one DiT forward over `rows` batch rows, as {"linear": ..., "attention": ...}.

    tokens: target tokens per row; context_rows: cross-attention context rows per row;
    reading_rows of the rows also attend to `ref_tokens` cached reference keys in every block;
    lora_ranks: runtime LoRA rank per block linear (module path -> rank), on every row and block;
    final_layer: False for the reference stream, which stops after the last block.
    "linear" covers every linear layer and LoRA branch, "attention" the QK^T and AV matmuls.
    """
    D, H, hd = config.model_channels, config.num_heads, config.head_dim
    r_ad, C_in = config.adaln_lora_dim, config.in_channels
    inner = H * hd
    L, S, R = tokens, context_rows, rows
    linear = 0.0
    for path, (fan_in, fan_out) in block_linear_dims(config).items():
        n = S if path in ("cross_attn.k_proj", "cross_attn.v_proj") else L
        linear += R * _linear_flops(n, fan_in, fan_out)
        rank = (lora_ranks or {}).get(path, 0)
        if rank:
            linear += R * _lora_flops(n, fan_in, fan_out, rank)
    # Three adaLN bottlenecks (D -> r -> 3D), once per row (the modulation broadcasts over tokens).
    linear += 3 * R * (_linear_flops(1, D, r_ad) + _linear_flops(1, r_ad, 3 * D))
    # Attention: QK^T and AV, 2 * queries * keys * inner each; reading rows have ref_tokens more keys.
    self_keys = R * L + reading_rows * ref_tokens  # summed over rows
    attention = 2 * 2.0 * L * self_keys * inner + 2 * 2.0 * L * S * inner * R
    linear *= config.num_blocks
    attention *= config.num_blocks
    linear += R * _linear_flops(L, (C_in + 1) * PATCH * PATCH, D)  # patch embed
    linear += R * (_linear_flops(1, D, D) + _linear_flops(1, D, 3 * D))  # t_embedder
    if final_layer:
        linear += R * (_linear_flops(1, D, r_ad) + _linear_flops(1, r_ad, 2 * D))
        linear += R * _linear_flops(L, D, PATCH * PATCH * C_in)
    return {"linear": linear, "attention": attention}


def dit_forward_flops(config: DiTConfig, **shape: Any) -> float:
    """Total matmul FLOPs of one DiT forward; arguments as `dit_forward_flop_breakdown`."""
    return sum(dit_forward_flop_breakdown(config, **shape).values())
