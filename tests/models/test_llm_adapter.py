"""LLMAdapter: parity with diffusers' AnimaTextConditioner (same key names), config inference, dtype."""

from __future__ import annotations

import pytest
import torch

from snapref_ray.models.checkpoint import load_into_module
from snapref_ray.models.dit_config import LLMAdapterConfig
from snapref_ray.models.llm_adapter import LLMAdapter
from snapref_ray.models.ops import RMSNorm
from snapref_ray.models.safetensors_header import CheckpointError


def random_adapter(config: LLMAdapterConfig, seed: int) -> tuple[LLMAdapter, dict[str, torch.Tensor]]:
    """An adapter with seeded random weights, and its state dict (keys without `llm_adapter.`)."""
    with torch.device("meta"):
        adapter = LLMAdapter(config)
    norms = {f"{n}.weight" for n, m in adapter.named_modules() if isinstance(m, RMSNorm)}
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for key, p in adapter.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if key in norms:
            sd[key] = 1 + 0.1 * noise
        elif key.endswith(".bias"):
            sd[key] = 0.02 * noise
        elif key == "embed.weight":
            sd[key] = noise
        else:
            sd[key] = noise / p.shape[1] ** 0.5
    load_into_module(adapter, sd, source="test", dtype=None)
    return adapter.eval(), sd


def diffusers_adapter(config: LLMAdapterConfig, sd: dict[str, torch.Tensor]):
    """The oracle; only the parity test needs diffusers (skips by name without it)."""
    AnimaTextConditioner = pytest.importorskip(
        "diffusers", reason="the LLM adapter parity oracle needs diffusers"
    ).AnimaTextConditioner

    model = AnimaTextConditioner(
        source_dim=config.source_dim,
        target_dim=config.model_dim,
        model_dim=config.model_dim,
        num_layers=config.num_blocks,
        num_attention_heads=config.num_heads,
        mlp_ratio=config.mlp_hidden / config.model_dim,
        target_vocab_size=config.vocab_size,
        min_sequence_length=0,
    )
    model.load_state_dict(sd, strict=True)
    return model.eval()


@pytest.mark.parametrize(
    "config",
    [
        # real widths (1024-d, 16 x 64 heads), 2 of the 6 blocks, a small vocabulary to keep memory modest
        LLMAdapterConfig(source_dim=1024, model_dim=1024, num_blocks=2, num_heads=16, mlp_hidden=4096, vocab_size=500),
        # source width != model width: the cross-attention k/v projections read the source width
        LLMAdapterConfig(source_dim=48, model_dim=64, num_blocks=3, num_heads=4, mlp_hidden=256, vocab_size=100),
    ],
    ids=["real-width", "tiny"],
)
def test_matches_diffusers_anima_text_conditioner(config):
    ours, sd = random_adapter(config, seed=0)
    ref_model = diffusers_adapter(config, sd)
    gen = torch.Generator().manual_seed(1)
    source = torch.randn(2, 13, config.source_dim, generator=gen)  # Qwen3 states, Lq = 13
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=gen)  # T5 ids, Lt = 9
    with torch.no_grad():
        out = ours(source, ids)
        ref = ref_model(source, ids)
    diff = (out - ref).abs().max().item()
    print(
        f"\nLLM adapter {config.model_dim}-d x {config.num_blocks} blocks: max abs diff {diff:.3g},"
        f" output max {ref.abs().max():.3g}"
    )
    assert out.shape == (2, 9, config.model_dim)
    assert diff < 1e-4 * ref.abs().max().item()


def test_config_from_state_dict():
    config = LLMAdapterConfig(source_dim=48, model_dim=64, num_blocks=3, num_heads=4, mlp_hidden=256, vocab_size=100)
    _, sd = random_adapter(config, seed=2)
    prefixed = {"llm_adapter." + k: v for k, v in sd.items()}
    prefixed["blocks.7.mlp.layer1.weight"] = torch.zeros(1)  # a DiT block must not count as an adapter block
    assert LLMAdapterConfig.from_state_dict(prefixed, source="x.safetensors") == config
    assert LLMAdapterConfig().head_dim == 64
    del prefixed["llm_adapter.embed.weight"]
    with pytest.raises(CheckpointError, match=r"^x\.safetensors: missing tensor 'llm_adapter\.embed\.weight'"):
        LLMAdapterConfig.from_state_dict(prefixed, source="x.safetensors")


def test_computes_in_source_dtype_with_any_weight_dtype():
    config = LLMAdapterConfig(source_dim=64, model_dim=64, num_blocks=1, num_heads=2, mlp_hidden=128, vocab_size=50)
    fp32, sd = random_adapter(config, seed=3)
    with torch.device("meta"):
        bf16 = LLMAdapter(config)
    load_into_module(bf16, sd, source="test", dtype=torch.bfloat16)
    source = torch.randn(1, 5, 64)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    with torch.no_grad():
        # ComfyUI casts the Qwen states to the DiT dtype: bf16 in, bf16 out
        assert bf16(source.bfloat16(), ids).dtype == torch.bfloat16
        # fp32 states on bf16 weights compute in fp32, i.e. like fp32 weights rounded to bf16
        rounded, _ = random_adapter(config, seed=3)
        load_into_module(rounded, {k: v.bfloat16().float() for k, v in sd.items()}, source="test", dtype=None)
        torch.testing.assert_close(bf16(source, ids), rounded(source, ids), rtol=0, atol=1e-5)
        assert (fp32(source, ids) - rounded(source, ids)).abs().max() > 0
