"""Qwen3 text encoder: real-size layout, parity with transformers' Qwen3Model, dtypes, masks, loading."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from snapref_ray.models.qwen3 import QWEN3_06B, Qwen3Config, Qwen3Encoder, load_text_encoder
from snapref_ray.models.safetensors_header import CheckpointError
from snapref_ray.models.tiny_text import make_tiny_qwen3_state_dict

REAL_WIDTH = dict(hidden=1024, heads=16, kv_heads=8, head_dim=128, intermediate=3072)
PARITY_VOCAB = 512


def read_key_listing(path) -> dict[str, list[int]]:
    out = {}
    for line in path.read_text().splitlines():
        key, shape = line.split("\t")
        out[key] = [int(s) for s in shape.strip("[]").split(",")]
    return out


def hf_qwen3(sd: dict[str, torch.Tensor], vocab: int, layers: int):
    """transformers' Qwen3Model (the oracle) with the given `model.*` weights, in fp32."""
    from transformers import Qwen3Config as HFQwen3Config
    from transformers import Qwen3Model

    cfg = HFQwen3Config(
        vocab_size=vocab,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=4096,
    )
    model = Qwen3Model(cfg)
    model.load_state_dict({k.removeprefix("model."): v.float() for k, v in sd.items()}, strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def real_width_sd() -> dict[str, torch.Tensor]:
    """Two Qwen3-0.6B layers at the real width (vocab cut to 512)."""
    return make_tiny_qwen3_state_dict(layers=2, vocab=PARITY_VOCAB, seed=1, **REAL_WIDTH)


@pytest.fixture(scope="module")
def hf_fp32(real_width_sd):
    return hf_qwen3(real_width_sd, PARITY_VOCAB, layers=2)


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, PARITY_VOCAB, (2, 37), generator=torch.Generator().manual_seed(0))


def test_real_size_config_builds_exactly_the_checkpoint_layout(ref_keys_dir):
    expected = read_key_listing(ref_keys_dir / "keys-qwen3-0.6b.txt")
    with torch.device("meta"):
        model = Qwen3Encoder(QWEN3_06B)
    found = {"model." + k: list(p.shape) for k, p in model.named_parameters()}
    assert found == expected
    assert len(found) == 310
    assert sum(p.numel() for p in model.parameters()) == 596_049_920
    assert list(model.buffers()) == []  # nothing persistent besides the weights: meta construction is complete
    meta_sd = {k: torch.empty(s, device="meta") for k, s in expected.items()}
    assert Qwen3Config.from_state_dict({k.removeprefix("model."): v for k, v in meta_sd.items()}) == QWEN3_06B


@pytest.mark.slow
def test_matches_transformers_in_fp32(real_width_sd, hf_fp32, ids):
    ours = load_text_encoder(real_width_sd)
    with torch.no_grad():
        ref = hf_fp32(input_ids=ids).last_hidden_state
        out = ours(ids)
    assert out.dtype == torch.float32 and out.shape == (2, 37, 1024)
    # Same operations in the same order: measured max abs diff 0.0 (output magnitude ~5).
    assert (out - ref).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_bf16_weights_compute_in_fp32(real_width_sd, hf_fp32, ids):
    bf16_sd = {k: v.to(torch.bfloat16) for k, v in real_width_sd.items()}
    ours = load_text_encoder(bf16_sd)
    assert ours.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16  # stored dtype kept
    assert ours.embed_tokens.weight.dtype == torch.bfloat16
    # Oracle: fp32 transformers model holding the bf16-rounded weights.
    ref_model = hf_qwen3(bf16_sd, PARITY_VOCAB, layers=2)
    with torch.no_grad():
        ref = ref_model(input_ids=ids).last_hidden_state
        out = ours(ids)
        unrounded = hf_fp32(input_ids=ids).last_hidden_state
    assert out.dtype == torch.float32
    assert (out - ref).abs().max().item() <= 1e-5
    # ... and the bf16 rounding of the weights is really there (a bf16 forward would differ far more).
    assert (out - unrounded).abs().max().item() > 1e-3


@pytest.mark.slow
def test_padding_mask_matches_transformers(real_width_sd, hf_fp32, ids):
    ours = load_text_encoder(real_width_sd)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding: real tokens attend past padded keys, which must be masked
    with torch.no_grad():
        ref = hf_fp32(input_ids=ids, attention_mask=mask).last_hidden_state
        out = ours(ids, mask)
    assert (out[0] - ref[0]).abs().max().item() <= 1e-5
    assert (out[1, 5:] - ref[1, 5:]).abs().max().item() <= 1e-5
    # The mask matters: without it the real tokens of row 1 read the padding.
    with torch.no_grad():
        unmasked = ours(ids)
    assert (unmasked[1, 5:] - ref[1, 5:]).abs().max().item() > 1e-2


def tiny_sd(**kw) -> dict[str, torch.Tensor]:
    return make_tiny_qwen3_state_dict(vocab=100, seed=3, **kw)


def test_right_padding_leaves_real_tokens_unchanged():
    model = load_text_encoder(tiny_sd())
    ids = torch.randint(0, 100, (1, 9), generator=torch.Generator().manual_seed(1))
    padded = torch.cat([ids, torch.zeros(1, 4, dtype=torch.long)], dim=1)
    mask = torch.cat([torch.ones(1, 9), torch.zeros(1, 4)], dim=1)
    with torch.no_grad():
        alone = model(ids)
        batched = model(torch.cat([padded, padded]), torch.cat([mask, torch.ones(1, 13)]))
    # Not bitwise: SDPA sums over 13 keys instead of 9 (measured 1.0e-6).
    assert torch.allclose(batched[0, :9], alone[0], atol=1e-5, rtol=0)


def test_single_masked_token_equals_unmasked():
    """ComfyUI masks the lone <|endoftext|> of an empty prompt; with one key the mask is a no-op."""
    model = load_text_encoder(tiny_sd())
    ids = torch.tensor([[7]])
    with torch.no_grad():
        assert torch.equal(model(ids, torch.tensor([[0]])), model(ids))


def test_config_is_inferred_from_shapes():
    sd = make_tiny_qwen3_state_dict(hidden=48, layers=3, heads=4, kv_heads=2, head_dim=16, intermediate=96, vocab=77)
    model = load_text_encoder(sd)
    assert model.config == Qwen3Config(
        vocab_size=77, hidden_size=48, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96
    )


def test_keys_without_prefix_and_lm_head_load_the_same(tmp_path):
    sd = tiny_sd()
    ids = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(2))
    bare = {k.removeprefix("model."): v for k, v in sd.items()}
    bare["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    path = tmp_path / "qwen.safetensors"
    save_file(sd, str(path))
    with torch.no_grad():
        a = load_text_encoder(sd)(ids)
        b = load_text_encoder(bare)(ids)
        c = load_text_encoder(path)(ids)
    assert torch.equal(a, b) and torch.equal(a, c)


def test_float8_weights_with_scale_stay_float8_and_match_dequantised():
    sd = tiny_sd()
    fp8_sd, deq_sd = {}, {}
    for k, v in sd.items():
        if k.endswith("_proj.weight"):
            scale = v.abs().amax(dim=1) / 448.0  # per-row scale into e4m3's range
            q = (v / scale[:, None]).to(torch.float8_e4m3fn)
            fp8_sd[k], fp8_sd[k.removesuffix("weight") + "weight_scale"] = q, scale
            deq_sd[k] = q.float() * scale[:, None]
        else:
            fp8_sd[k] = deq_sd[k] = v
    fp8 = load_text_encoder(fp8_sd)
    assert fp8.layers[1].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.allclose(fp8(ids), load_text_encoder(deq_sd)(ids), atol=1e-5, rtol=0)


def test_dtype_argument_casts_the_stored_weights():
    model = load_text_encoder(tiny_sd(), dtype=torch.float16)
    assert model.layers[0].mlp.up_proj.weight.dtype == torch.float16
    assert model(torch.tensor([[1, 2, 3]])).dtype == torch.float32


def test_missing_tensors_are_named():
    sd = tiny_sd()
    del sd["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(
        CheckpointError,
        match=r"^<state dict>: missing tensor 'layers\.1\.mlp\.up_proj\.weight' "
        r"\(expected shape \[128, 64\]\)$",
    ):
        load_text_encoder(sd)
    sd = tiny_sd()
    del sd["model.layers.0.self_attn.q_norm.weight"]
    with pytest.raises(
        CheckpointError,
        match=r"^<state dict>: not a Qwen3 text encoder: missing tensor "
        r"'model\.layers\.0\.self_attn\.q_norm\.weight'$",
    ):
        load_text_encoder(sd)
