"""Seeded random Anima DiT state dicts in the real key layout, for tests and demos without real weights.

The keys come from the module tree itself (built on the meta device), which the real-size test
pins to the key dump of the released file, so a tiny file exercises exactly the loader paths a
real one does. Weights are scaled to keep activations O(1): a tiny model renders noise, but a
finite one over a whole sampling run.
"""

from __future__ import annotations

from typing import Any

import torch

from snapref_ray.models.dit import AnimaDiT
from snapref_ray.models.dit_config import DiTConfig, LLMAdapterConfig
from snapref_ray.models.ops import RMSNorm

# The real T5 vocabulary, so real tokenizer ids index the tiny embedding.
T5_VOCAB = LLMAdapterConfig.vocab_size


def tiny_dit_config(
    *,
    model_channels: int = 64,
    num_blocks: int = 2,
    head_dim: int = 32,
    context_dim: int = 64,
    adaln_lora_dim: int = 16,
    mlp_ratio: int = 4,
    adapter_dim: int = 64,
    adapter_heads: int = 2,
    adapter_blocks: int = 1,
    adapter_source_dim: int | None = None,
    t5_vocab: int = T5_VOCAB,
) -> DiTConfig:
    """The DiTConfig `make_tiny_dit_state_dict` builds with the same arguments."""
    if context_dim != adapter_dim:
        raise ValueError(
            f"context_dim ({context_dim}) must equal adapter_dim ({adapter_dim}):"
            " the adapter's output is the DiT's cross-attention context"
        )
    if model_channels % head_dim or adapter_dim % adapter_heads:
        raise ValueError(
            f"model_channels {model_channels} / head_dim {head_dim} and adapter_dim {adapter_dim}"
            f" / adapter_heads {adapter_heads} must divide evenly"
        )
    adapter = LLMAdapterConfig(
        source_dim=adapter_source_dim or adapter_dim,
        model_dim=adapter_dim,
        num_blocks=adapter_blocks,
        num_heads=adapter_heads,
        mlp_hidden=mlp_ratio * adapter_dim,
        vocab_size=t5_vocab,
    )
    return DiTConfig(
        model_channels=model_channels,
        num_blocks=num_blocks,
        num_heads=model_channels // head_dim,
        head_dim=head_dim,
        in_channels=16,
        context_dim=context_dim,
        adaln_lora_dim=adaln_lora_dim,
        mlp_hidden=mlp_ratio * model_channels,
        adapter=adapter,
    )


def make_tiny_dit_state_dict(
    *, seed: int = 0, dtype: torch.dtype = torch.float32, **shape: Any
) -> dict[str, torch.Tensor]:
    """Random, seeded weights for every parameter, keyed as in the real file minus its `net.` prefix.

    `shape`: the keyword arguments of `tiny_dit_config` (its defaults are the tiny model's); e.g.
    adapter_source_dim is the width of the text-encoder states the adapter reads (default adapter_dim).
    Linear weights ~ N(0, 1/fan_in), biases ~ N(0, 0.02^2), norm weights ~ 1 + N(0, 0.1^2), the T5
    embedding ~ N(0, 1).
    """
    config = tiny_dit_config(**shape)
    with torch.device("meta"):
        model = AnimaDiT(config)
    norm_weights = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, RMSNorm)}
    gen = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for key, param in model.named_parameters():
        shape = tuple(param.shape)
        noise = torch.randn(shape, generator=gen)
        if key in norm_weights:
            value = 1.0 + 0.1 * noise
        elif key.endswith(".bias"):
            value = 0.02 * noise
        elif key == "llm_adapter.embed.weight":
            value = noise
        else:  # [out, in] linear weight
            value = noise / shape[1] ** 0.5
        sd[key] = value.to(dtype)
    return sd
