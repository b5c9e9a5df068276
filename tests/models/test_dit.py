"""AnimaDiT: parity with diffusers' CosmosTransformer3DModel, the SnapRef seams (LoRA, RefRead,
reference_kv), dtypes, and load_dit on every supported file flavour."""

from __future__ import annotations

import logging
import math
import re

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from snapref_ray.models.attention import RefRead
from snapref_ray.models.dit import AnimaDiT, TimeEmbedding, load_dit, modulate, modulation, patchify, timestep_sinusoid
from snapref_ray.models.dit_config import BLOCK_LINEARS, DiTConfig, real_dit_config
from snapref_ray.models.ops import Linear, LoRAPair
from snapref_ray.models.rope import apply_rope, dit_rope, dit_rope_axis_dims
from snapref_ray.models.tiny_dit import make_tiny_dit_state_dict

# ComfyUI module path -> diffusers CosmosTransformer3DModel path, applied in order
# (docs/design.md#oracles-in-the-tests).
_TO_DIFFUSERS = [
    (r"^t_embedder\.1\.", "time_embed.t_embedder."),
    (r"^t_embedding_norm\.", "time_embed.norm."),
    (r"^x_embedder\.proj\.1\.", "patch_embed.proj."),
    (r"^final_layer\.adaln_modulation\.(\d)\.", r"norm_out.linear_\1."),
    (r"^final_layer\.linear\.", "proj_out."),
    (r"^blocks\.", "transformer_blocks."),
    (r"\.adaln_modulation_self_attn\.(\d)\.", r".norm1.linear_\1."),
    (r"\.adaln_modulation_cross_attn\.(\d)\.", r".norm2.linear_\1."),
    (r"\.adaln_modulation_mlp\.(\d)\.", r".norm3.linear_\1."),
    (r"\.self_attn\.", ".attn1."),
    (r"\.cross_attn\.", ".attn2."),
    (r"\.q_proj\.", ".to_q."),
    (r"\.k_proj\.", ".to_k."),
    (r"\.v_proj\.", ".to_v."),
    (r"\.output_proj\.", ".to_out.0."),
    (r"\.q_norm\.", ".norm_q."),
    (r"\.k_norm\.", ".norm_k."),
    (r"\.mlp\.layer1\.", ".ff.net.0.proj."),
    (r"\.mlp\.layer2\.", ".ff.net.2."),
]


def to_diffusers_key(key: str) -> str:
    for pattern, replacement in _TO_DIFFUSERS:
        key = re.sub(pattern, replacement, key)
    return key


def diffusers_dit(config: DiTConfig, sd: dict[str, torch.Tensor]):
    """diffusers' Cosmos DiT with Anima's config (docs/design.md#oracles-in-the-tests), loaded strictly from our keys.

    Only the parity tests need diffusers; they skip by name without it (a failure under SNAPREF_NO_SKIP).
    """
    CosmosTransformer3DModel = pytest.importorskip(
        "diffusers", reason="the DiT parity oracle needs diffusers"
    ).CosmosTransformer3DModel

    # No torchvision here, so diffusers' padding-mask resize is unavailable: instead its
    # `condition_mask` input carries the zero channel (concatenated in the same place, channel 16).
    model = CosmosTransformer3DModel(
        in_channels=config.in_channels + 1,
        out_channels=config.in_channels,
        num_attention_heads=config.num_heads,
        attention_head_dim=config.head_dim,
        num_layers=config.num_blocks,
        mlp_ratio=config.mlp_hidden / config.model_channels,
        text_embed_dim=config.context_dim,
        adaln_lora_dim=config.adaln_lora_dim,
        max_size=(128, 240, 240),
        patch_size=(1, 2, 2),
        rope_scale=(1.0, 4.0, 4.0),
        concat_padding_mask=False,
        extra_pos_embed_type=None,
    )
    converted = {to_diffusers_key(k): v for k, v in sd.items() if not k.startswith("llm_adapter.")}
    model.load_state_dict(converted, strict=True)
    for block in model.transformer_blocks:  # diffusers' Attention defaults to eps 1e-5; Cosmos uses 1e-6
        for attn in (block.attn1, block.attn2):
            attn.norm_q.eps = attn.norm_k.eps = 1e-6
    return model.eval()


def run_diffusers(model, x_BCTHW: torch.Tensor, sigma_B: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
    B, _, T, H, W = x_BCTHW.shape
    with torch.no_grad():
        return model(
            x_BCTHW,
            timestep=sigma_B,
            encoder_hidden_states=context,
            condition_mask=torch.zeros(B, 1, T, H, W),
            return_dict=False,
        )[0]


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    diff = (ours.float() - ref.float()).abs().max().item()
    return diff, diff / ref.abs().max().item()


def small_sd(**kw) -> dict[str, torch.Tensor]:
    return make_tiny_dit_state_dict(**{"t5_vocab": 64, **kw})


@pytest.fixture(scope="module")
def tiny():
    """3 blocks, width 128: (model, state dict)."""
    sd = small_sd(model_channels=128, num_blocks=3, head_dim=32, seed=1)
    return load_dit(sd), sd


# --- parity with diffusers -------------------------------------------------------------------


@pytest.mark.slow
def test_full_width_block_matches_diffusers():
    sd = small_sd(
        model_channels=2048,
        num_blocks=1,
        head_dim=128,
        context_dim=1024,
        adaln_lora_dim=256,
        adapter_dim=1024,
        adapter_heads=16,
        seed=3,
    )
    ours = load_dit(sd)
    assert (ours.config.model_channels, ours.config.num_heads, ours.config.mlp_hidden) == (2048, 16, 8192)
    ref_model = diffusers_dit(ours.config, sd)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 1, 6, 10, generator=gen)  # non-square latent: 3 x 5 tokens
    sigma = torch.tensor([0.9, 0.25])
    context = torch.randn(2, 24, 1024, generator=gen)
    with torch.no_grad():
        out = ours(x, sigma, context)
    ref = run_diffusers(ref_model, x, sigma, context)
    diff, rel = rel_err(out, ref)
    print(f"\nfull width (2048, 1 block) 6x10: max abs diff {diff:.3g}, output max {ref.abs().max():.3g}")
    assert out.shape == x.shape
    assert rel < 1e-4


def test_several_blocks_match_diffusers(tiny):
    model, sd = tiny
    ref_model = diffusers_dit(model.config, sd)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 16, 1, 8, 6, generator=gen)
    sigma = torch.tensor([1.0, 0.5, 0.003])
    context = torch.randn(3, 16, 64, generator=gen)
    with torch.no_grad():
        out = model(x, sigma, context)
    ref = run_diffusers(ref_model, x, sigma, context)
    diff, rel = rel_err(out, ref)
    print(f"\n3 blocks width 128, 8x6: max abs diff {diff:.3g}, output max {ref.abs().max():.3g}")
    assert rel < 1e-4


def test_odd_latent_is_circularly_padded_and_cropped(tiny):
    model, sd = tiny
    ref_model = diffusers_dit(model.config, sd)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 16, 1, 5, 7, generator=gen)
    context = torch.randn(1, 8, 64, generator=gen)
    sigma = torch.tensor([0.7])
    padded = F.pad(x, (0, 1, 0, 1, 0, 0), mode="circular")  # ComfyUI pad_to_patch_size
    ref = run_diffusers(ref_model, padded, sigma, context)[..., :5, :7]
    with torch.no_grad():
        out = model(x, sigma, context)
    diff, rel = rel_err(out, ref)
    print(f"\nodd 5x7 latent: max abs diff {diff:.3g}")
    assert out.shape == (1, 16, 1, 5, 7)
    assert rel < 1e-4
    assert model.token_grid(5, 7) == (1, 3, 4)


def test_diffusers_key_mapping_covers_the_real_layout(ref_keys_dir):
    with torch.device("meta"):
        model = AnimaDiT(real_dit_config())
    ours = {to_diffusers_key(k): list(p.shape) for k, p in model.named_parameters() if not k.startswith("llm_adapter.")}
    lines = (ref_keys_dir / "keys-anima-dit-diffusers.txt").read_text().splitlines()
    theirs = {k: eval(shape) for k, shape in (line.split("\t") for line in lines)}
    assert ours == theirs


# --- RoPE numbers (docs/design.md#rope) ----------------------------------------------------------


def test_dit_rope_split_and_ntk_bases():
    assert dit_rope_axis_dims(128) == (44, 42, 42)
    cos, sin = dit_rope((1, 3, 2), 128, offset=(0, 0, 0))
    assert cos.shape == sin.shape == (6, 64)
    angles = torch.atan2(sin, cos).double()
    # token 2 is (t=0, h=1, w=0): only the 21 h pairs (columns 22..42) rotate, by theta_h^(-2k/42)
    theta_h = 10000 * 4 ** (42 / 40)
    assert abs(theta_h - 42870.9385) < 1e-3
    expected_h = theta_h ** (-torch.arange(21, dtype=torch.float64) * 2 / 42)
    torch.testing.assert_close(angles[2, 22:43], expected_h, rtol=1e-6, atol=1e-7)
    assert angles[2, :22].abs().max() == 0 and angles[2, 43:].abs().max() == 0
    # token 1 is (0, 0, 1): the w pairs, same base as h; a temporal offset of 1 uses theta_t = 10000
    torch.testing.assert_close(angles[1, 43:], expected_h, rtol=1e-6, atol=1e-7)
    cos_t, sin_t = dit_rope((1, 1, 1), 128, offset=(1, 0, 0))
    expected_t = 10000.0 ** (-torch.arange(22, dtype=torch.float64) * 2 / 44)
    torch.testing.assert_close(torch.atan2(sin_t, cos_t).double()[0, :22], expected_t, rtol=1e-6, atol=1e-7)


def test_apply_rope_pairs_j_with_j_plus_half():
    x = torch.zeros(1, 1, 1, 8)
    x[..., 1] = 1.0  # unit vector on pair 1's first component
    angle = torch.zeros(1, 4)
    angle[0, 1] = 0.5
    out = apply_rope(x, angle.cos(), angle.sin())
    expected = torch.zeros(8)
    expected[1], expected[5] = math.cos(0.5), math.sin(0.5)
    torch.testing.assert_close(out.flatten(), expected)


# --- forward behaviour -----------------------------------------------------------------------


def test_4d_input_and_scalar_sigma(tiny):
    model, _ = tiny
    x = torch.randn(2, 16, 1, 4, 6)
    context = torch.randn(2, 8, 64)
    with torch.no_grad():
        out5 = model(x, torch.tensor([0.4, 0.4]), context)
        out4 = model(x[:, :, 0], 0.4, context)
    assert out4.shape == (2, 16, 4, 6)
    assert torch.equal(out4, out5[:, :, 0])


def test_cfg_rows_in_one_batch_equal_separate_calls(tiny):
    model, _ = tiny
    x = torch.randn(2, 16, 1, 4, 4)
    sigma = torch.tensor([0.8, 0.3])
    context = torch.randn(2, 8, 64)
    with torch.no_grad():
        both = model(x, sigma, context)
        rows = [model(x[i : i + 1], sigma[i : i + 1], context[i : i + 1]) for i in range(2)]
    torch.testing.assert_close(both, torch.cat(rows), rtol=0, atol=1e-5)


def _random_loras(config: DiTConfig, seed: int, rank: int = 4) -> list[dict[str, LoRAPair]]:
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {
            name: tuple(m.weight.shape)
            for name, m in AnimaDiT(config).blocks[0].named_modules()
            if isinstance(m, Linear) and name in BLOCK_LINEARS
        }
    assert sorted(shapes) == sorted(BLOCK_LINEARS)
    return [
        {
            name: LoRAPair(torch.randn(rank, i, generator=gen) * 0.3, torch.randn(o, rank, generator=gen) * 0.3, 0.5)
            for name, (o, i) in shapes.items()
        }
        for _ in range(config.num_blocks)
    ]


def test_runtime_loras_equal_merged_weights(tiny):
    model, sd = tiny
    loras = _random_loras(model.config, seed=5)
    merged = dict(sd)
    for i, block in enumerate(loras):
        for name, pair in block.items():
            merged[f"blocks.{i}.{name}.weight"] = sd[f"blocks.{i}.{name}.weight"] + pair.scale * pair.up @ pair.down
    x, context = torch.randn(2, 16, 1, 4, 6), torch.randn(2, 8, 64)
    sigma = torch.tensor([0.6, 0.6])
    with torch.no_grad():
        with_loras = model(x, sigma, context, loras=loras)
        base = model(x, sigma, context)
        merged_out = load_dit(merged)(x, sigma, context)
    assert (with_loras - base).abs().max() > 0.1
    torch.testing.assert_close(with_loras, merged_out, rtol=0, atol=1e-4 * merged_out.abs().max().item())


def test_lora_arguments_are_checked(tiny):
    model, _ = tiny
    x, context = torch.randn(1, 16, 1, 4, 4), torch.randn(1, 8, 64)
    pair = LoRAPair(torch.zeros(2, 128), torch.zeros(128, 2), 1.0)
    with pytest.raises(ValueError, match=r"loras: expected one entry per model block \(3\), got 2"):
        model(x, 0.5, context, loras=[None, None])
    with pytest.raises(ValueError, match=r"loras\[1\]: unknown module path\(s\) \['self_attn.qproj'\]"):
        model(x, 0.5, context, loras=[None, {"self_attn.qproj": pair}, None])


def test_ref_read_reaches_only_reading_rows_and_weight_zero_is_no_ref(tiny):
    model, _ = tiny
    gen = torch.Generator().manual_seed(7)
    ref_latent, target = torch.randn(1, 16, 1, 4, 4, generator=gen), torch.randn(2, 16, 1, 4, 6, generator=gen)
    context = torch.randn(2, 8, 64, generator=gen)
    sigma = torch.tensor([0.5, 0.5])
    with torch.no_grad():
        kv = model.reference_kv(ref_latent, context[:1], rope_offset=(0, 0, 3))

        def refs(rows, weight=1.0):
            return [RefRead(k, v, torch.tensor(rows), weight) for k, v in kv]

        plain = model(target, sigma, context)
        assert torch.equal(model(target, sigma, context, refs=refs([False, False])), plain)
        assert torch.equal(model(target, sigma, context, refs=refs([True, True], weight=0.0)), plain)
        assert torch.equal(model(target, sigma, context, refs=[None] * 3), plain)
        mixed = model(target, sigma, context, refs=refs([True, False]))
    assert (mixed[0] - plain[0]).abs().max() > 1e-2
    torch.testing.assert_close(mixed[1], plain[1], rtol=0, atol=1e-5)


# --- reference_kv ----------------------------------------------------------------------------


def test_reference_kv_shapes_and_dtype(tiny):
    model, _ = tiny
    with torch.no_grad():
        kv = model.reference_kv(torch.randn(1, 16, 6, 10), torch.randn(1, 8, 64))
    assert len(kv) == 3
    for k, v in kv:
        assert k.shape == v.shape == (4, 15, 32)  # heads, 3 x 5 tokens, head_dim
        assert k.dtype == v.dtype == torch.float32
    with pytest.raises(ValueError, match="batch 2"):
        model.reference_kv(torch.randn(2, 16, 4, 4), torch.randn(1, 8, 64))


def test_reference_kv_rope_offset_only_rotates_keys(tiny):
    model, _ = tiny
    gen = torch.Generator().manual_seed(8)
    x, context = torch.randn(1, 16, 1, 6, 4, generator=gen), torch.randn(1, 8, 64, generator=gen)
    offset = (2, 3, 5)
    with torch.no_grad():
        kv0 = model.reference_kv(x, context)
        kv1 = model.reference_kv(x, context, rope_offset=offset)
    cos, sin = dit_rope((1, 1, 1), 32, offset=offset)  # the offset's own angles, [1, 16]
    for (k0, v0), (k1, v1) in zip(kv0, kv1):
        assert (k1 - k0).abs().max() > 0.1
        torch.testing.assert_close(k1, apply_rope(k0, cos, sin), rtol=0, atol=1e-5)
        torch.testing.assert_close(v1, v0, rtol=0, atol=1e-5)


def test_reference_kv_keys_are_normed_and_rotated_block_inputs(tiny):
    """Block 0's K/V recomputed by hand from the patch embedding at sigma 0."""
    model, _ = tiny
    gen = torch.Generator().manual_seed(9)
    x, context = torch.randn(1, 16, 1, 4, 4, generator=gen), torch.randn(1, 8, 64, generator=gen)
    with torch.no_grad():
        k, v = model.reference_kv(x, context, rope_offset=(0, 1, 0))[0]
        h = model.x_embedder(patchify(x)[0])
        e = timestep_sinusoid(torch.zeros(1), 128)[:, None]  # sigma 0: [1, 1, D]
        t = TimeEmbedding(emb=model.t_embedding_norm(e), adaln_lora=model.t_embedder[1](e))
        shift, scale, _ = modulation(model.blocks[0].adaln_modulation_self_attn, t, 3)
        attn = model.blocks[0].self_attn
        hm = modulate(h, shift, scale, torch.float32)
        k_ref = attn.k_norm(attn.k_proj(hm).view(1, 4, 4, 32)).transpose(1, 2)[0]
        v_ref = attn.v_proj(hm).view(1, 4, 4, 32).transpose(1, 2)[0]
    cos, sin = dit_rope((1, 2, 2), 32, offset=(0, 1, 0))
    torch.testing.assert_close(k, apply_rope(k_ref, cos, sin), rtol=0, atol=1e-6)
    torch.testing.assert_close(v, v_ref, rtol=0, atol=1e-6)


def test_reference_kv_loras(tiny):
    model, _ = tiny
    gen = torch.Generator().manual_seed(10)
    x, context = torch.randn(1, 16, 1, 4, 4, generator=gen), torch.randn(1, 8, 64, generator=gen)
    down, up = torch.randn(4, 128, generator=gen), torch.randn(512, 4, generator=gen)
    with torch.no_grad():
        base = model.reference_kv(x, context)
        zero_up = model.reference_kv(x, context, loras=[{"mlp.layer1": LoRAPair(down, torch.zeros(512, 4), 1.0)}] * 3)
        mlp0 = model.reference_kv(x, context, loras=[{"mlp.layer1": LoRAPair(down, up, 0.5)}, None, None])
        kproj0 = model.reference_kv(x, context, loras=[{"self_attn.k_proj": LoRAPair(down, up[:128], 0.5)}, None, None])
    for (k, v), (kz, vz) in zip(base, zero_up):
        assert torch.equal(k, kz) and torch.equal(v, vz)
    # An MLP LoRA in block 0 acts after block 0's self-attention: only later blocks see it.
    assert torch.equal(mlp0[0][0], base[0][0]) and torch.equal(mlp0[0][1], base[0][1])
    assert (mlp0[1][0] - base[1][0]).abs().max() > 1e-2
    # A k_proj LoRA changes block 0's keys but not its values.
    assert (kproj0[0][0] - base[0][0]).abs().max() > 1e-2
    assert torch.equal(kproj0[0][1], base[0][1])


# --- dtypes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_model(tiny, dtype):
    _, sd = tiny
    half = load_dit({k: v.to(dtype) for k, v in sd.items()})
    rounded = load_dit({k: v.to(dtype).float() for k, v in sd.items()})
    assert half.compute_dtype == dtype
    seen = []
    half.blocks[0].register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    gen = torch.Generator().manual_seed(11)
    x, context = torch.randn(2, 16, 1, 4, 6, generator=gen), torch.randn(2, 8, 64, generator=gen)
    with torch.no_grad():
        out = half(x, torch.tensor([0.9, 0.2]), context)
        ref = rounded(x, torch.tensor([0.9, 0.2]), context)
        kv_half = half.reference_kv(x[:1], context[:1])
        kv_ref = rounded.reference_kv(x[:1], context[:1])
    # fp16 keeps the residual stream in fp32; bf16 keeps it in bf16 (as ComfyUI); the fp32 reference stream is fp32
    assert seen == [torch.float32 if dtype == torch.float16 else torch.bfloat16, torch.float32]
    assert out.dtype == torch.float32
    assert rel_err(out, ref)[1] < 3e-2
    # The reference stream computes in x's dtype (fp32) on the half model: same as the fp32 model.
    for (k, v), (kr, vr) in zip(kv_half, kv_ref):
        assert k.dtype == torch.float32
        torch.testing.assert_close(k, kr, rtol=0, atol=1e-5)
        torch.testing.assert_close(v, vr, rtol=0, atol=1e-5)


def test_tiny_model_stays_finite_over_30_euler_steps():
    model = load_dit(make_tiny_dit_state_dict())
    x = torch.randn(2, 16, 1, 16, 12, generator=torch.Generator().manual_seed(12))
    context = torch.randn(2, 512, 64)
    sigmas = torch.linspace(1.0, 0.0, 31)
    with torch.no_grad():
        for i in range(30):
            v = model(x, sigmas[i].expand(2), context)
            x = x + v * (sigmas[i + 1] - sigmas[i])
    assert torch.isfinite(x).all()
    assert x.abs().max() < 100


# --- load_dit --------------------------------------------------------------------------------


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal up to float reordering (memory-mapped and in-memory weights may take different BLAS paths)."""
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6 * b.abs().max().item())


def _output(model: AnimaDiT) -> torch.Tensor:
    gen = torch.Generator().manual_seed(13)
    x, context = torch.randn(1, 16, 1, 4, 6, generator=gen), torch.randn(1, 8, 64, generator=gen)
    with torch.no_grad():
        return model(x, torch.tensor([0.5]), context)


@pytest.fixture(scope="module")
def small():
    sd = make_tiny_dit_state_dict(t5_vocab=64, seed=4)
    return sd, _output(load_dit(sd))


@pytest.mark.parametrize("prefix", ["net.", "model.diffusion_model.", "diffusion_model.", ""])
def test_load_dit_prefixes(tmp_path, small, prefix):
    sd, expected = small
    path = tmp_path / "dit.safetensors"
    save_file({prefix + k: v for k, v in sd.items()}, str(path))
    model = load_dit(path)
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert_same(_output(model), expected)


def test_load_dit_ignores_extra_keys_with_one_log_line(tmp_path, small, caplog):
    sd, expected = small
    path = tmp_path / "dit.safetensors"
    extra = {"pos_embedder.seq": torch.arange(256.0), "accum_video_sample_counter": torch.zeros(1)}
    save_file({"net." + k: v for k, v in {**sd, **extra}.items()}, str(path))
    with caplog.at_level(logging.INFO, logger="snapref_ray.models.checkpoint"):
        model = load_dit(path)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1
    assert messages[0].startswith(f"{path}: ignoring 2 tensor(s) the model does not use")
    assert_same(_output(model), expected)


def test_load_dit_counts_blocks_from_the_file(tmp_path):
    path = tmp_path / "five.safetensors"
    save_file(
        {"net." + k: v for k, v in make_tiny_dit_state_dict(num_blocks=5, adapter_blocks=2, t5_vocab=64).items()},
        str(path),
    )
    model = load_dit(path)
    assert model.config.num_blocks == len(model.blocks) == 5
    assert model.config.adapter.num_blocks == len(model.llm_adapter.blocks) == 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_load_dit_half_files(tmp_path, small, dtype):
    sd, _ = small
    path = tmp_path / "half.safetensors"
    save_file({"net." + k: v.to(dtype) for k, v in sd.items()}, str(path))
    kept = load_dit(path)
    assert {p.dtype for p in kept.parameters()} == {dtype}
    as_fp32 = load_dit(path, dtype=torch.float32)
    assert {p.dtype for p in as_fp32.parameters()} == {torch.float32}
    exact = _output(load_dit({k: v.to(dtype).float() for k, v in sd.items()}))
    assert_same(_output(as_fp32), exact)
    assert rel_err(_output(kept), exact)[1] < 3e-2


FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def _quantise(sd: dict[str, torch.Tensor], fp8: torch.dtype, scales: str, suffix: str):
    """(file dict with float8 2-D weights and scales, the dequantised fp32 state dict)."""
    file_sd, dequant = {}, {}
    for key, w in sd.items():
        if w.ndim != 2:  # norms and biases stay fp32, as in scaled-fp8 releases
            file_sd[key] = dequant[key] = w
            continue
        if scales == "none":
            q = w.to(fp8)
            file_sd[key], dequant[key] = q, q.float()
            continue
        amax = w.abs().amax() if scales == "tensor" else w.abs().amax(dim=1)
        scale = (amax / FP8_MAX[fp8]).float()
        q = (w / (scale if scale.ndim == 0 else scale[:, None])).to(fp8)
        file_sd[key] = q
        file_sd[key[: -len("weight")] + suffix] = scale
        dequant[key] = q.float() * (scale if scale.ndim == 0 else scale[:, None])
    return file_sd, dequant


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize(
    "scales,suffix", [("tensor", "weight_scale"), ("row", "weight_scale"), ("row", "scale_weight"), ("none", "")]
)
def test_load_dit_fp8(tmp_path, small, fp8, scales, suffix):
    sd, _ = small
    file_sd, dequant = _quantise(sd, fp8, scales, suffix)
    path = tmp_path / "fp8.safetensors"
    save_file({"net." + k: v for k, v in file_sd.items()}, str(path))
    model = load_dit(path)
    q_proj = model.blocks[0].self_attn.q_proj
    assert q_proj.weight.dtype == fp8
    assert (q_proj.weight_scale is None) == (scales == "none")
    assert model.llm_adapter.embed.weight.dtype == torch.float32  # not a Linear: dequantised on load
    assert model.compute_dtype == torch.float32
    out, ref = _output(model), _output(load_dit(dequant))
    assert torch.isfinite(out).all()
    assert rel_err(out, ref)[1] < 1e-5
