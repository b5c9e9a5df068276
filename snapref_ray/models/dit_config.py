"""The shapes of the Anima DiT and its LLM adapter, read from a checkpoint's tensor shapes without torch.

A config is all the driver needs of a model to plan a job (memory, batch sizes, adapter kinds); the modules
themselves (dit.py, llm_adapter.py) are built from one inside the workers. `from_state_dict` reads only
`.shape` of each value, so it takes loaded tensors and a header's shape entries alike.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from snapref_ray.geometry import PATCH
from snapref_ray.models.safetensors_header import CheckpointError

ADAPTER_PREFIX = "llm_adapter."
# The ten linears of a block that runtime LoRAs (and SnapRef's reference branch) can adapt.
BLOCK_LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.output_proj",
    "cross_attn.q_proj",
    "cross_attn.k_proj",
    "cross_attn.v_proj",
    "cross_attn.output_proj",
    "mlp.layer1",
    "mlp.layer2",
)


@dataclass(frozen=True)
class LLMAdapterConfig:
    """Shape of the adapter; Anima: 1024-d Qwen3 states in, 6 blocks of 16 x 64 heads, 1024-d out."""

    source_dim: int = 1024  # Qwen3-0.6B hidden size
    model_dim: int = 1024  # = output dim (Anima has no in_proj: target_dim == model_dim)
    num_blocks: int = 6
    num_heads: int = 16
    mlp_hidden: int = 4096
    vocab_size: int = 32128  # T5 v1.1 vocabulary (32100 pieces padded to 32128)

    @property
    def head_dim(self) -> int:
        return self.model_dim // self.num_heads

    @classmethod
    def from_state_dict(
        cls, sd: Mapping[str, Any], *, source: str = "state dict", prefix: str = ADAPTER_PREFIX
    ) -> LLMAdapterConfig:
        """Infer the config from tensor shapes (keys with `prefix`, default `llm_adapter.`)."""

        def shape(key: str) -> tuple[int, ...]:
            if prefix + key not in sd:
                raise _missing(source, prefix + key)
            return tuple(sd[prefix + key].shape)

        vocab_size, model_dim = shape("embed.weight")
        head_dim = shape("blocks.0.self_attn.q_norm.weight")[0]
        num_blocks = 1 + max(int(k[len(prefix) :].split(".")[1]) for k in sd if k.startswith(prefix + "blocks."))
        return cls(
            source_dim=shape("blocks.0.cross_attn.k_proj.weight")[1],
            model_dim=model_dim,
            num_blocks=num_blocks,
            num_heads=model_dim // head_dim,
            mlp_hidden=shape("blocks.0.mlp.0.weight")[0],
            vocab_size=vocab_size,
        )


def _missing(source: str, key: str) -> CheckpointError:
    return CheckpointError(
        f"{source}: missing tensor {key!r}, needed to infer the model's shape (is this an Anima DiT file?)"
    )


@dataclass(frozen=True)
class DiTConfig:
    """Shape of an Anima DiT, inferred from a checkpoint's tensor shapes (`from_state_dict`)."""

    model_channels: int  # D, the residual width (2048)
    num_blocks: int  # 28 for Anima base, 40 for the depth-expanded Anima-2.9B
    num_heads: int  # 16
    head_dim: int  # 128
    in_channels: int  # latent channels (16); the patch embed sees one more, the zero padding mask
    context_dim: int  # width of the cross-attention context = LLM adapter output (1024)
    adaln_lora_dim: int  # bottleneck of the per-block adaLN modulation (256)
    mlp_hidden: int  # 4 * D
    adapter: LLMAdapterConfig

    @classmethod
    def from_state_dict(cls, sd: Mapping[str, Any], *, source: str = "state dict") -> DiTConfig:
        """Infer the config from a state dict whose file prefix (`net.` etc.) is already stripped."""

        def shape(key: str) -> tuple[int, ...]:
            if key not in sd:
                raise CheckpointError(
                    f"{source}: missing tensor {key!r}, needed to infer the model's shape (is this an Anima DiT file?)"
                )
            return tuple(sd[key].shape)

        model_channels, patch_features = shape("x_embedder.proj.1.weight")
        head_dim = shape("blocks.0.self_attn.q_norm.weight")[0]
        # Count only top-level blocks: llm_adapter.blocks.N are the adapter's own.
        block_ids = [int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))]
        return cls(
            model_channels=model_channels,
            num_blocks=max(block_ids) + 1,
            num_heads=model_channels // head_dim,
            head_dim=head_dim,
            in_channels=patch_features // (PATCH * PATCH) - 1,
            context_dim=shape("blocks.0.cross_attn.k_proj.weight")[1],
            adaln_lora_dim=shape("blocks.0.adaln_modulation_self_attn.1.weight")[0],
            mlp_hidden=shape("blocks.0.mlp.layer1.weight")[0],
            adapter=LLMAdapterConfig.from_state_dict(sd, source=source),
        )


def real_dit_config(num_blocks: int = 28) -> DiTConfig:
    """Anima base (28 blocks) or Anima-2.9B (40 blocks) at real size."""
    return DiTConfig(
        model_channels=2048,
        num_blocks=num_blocks,
        num_heads=16,
        head_dim=128,
        in_channels=16,
        context_dim=1024,
        adaln_lora_dim=256,
        mlp_hidden=8192,
        adapter=LLMAdapterConfig(),
    )
