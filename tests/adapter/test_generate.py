"""Synthetic adapters: the real size counted on `meta`, seeded random weights, exact no-op zero adapters."""

from __future__ import annotations

import pytest
import torch

from snapref_ray.adapter import (
    REF_LINEARS,
    AdapterError,
    char_mode_weights,
    estimate_file_size,
    make_adapter,
)

SMALL = dict(num_blocks=4, model_channels=64, context_dim=32, mlp_hidden=128, ref_rank=16, target_rank=8)


def test_real_size_on_meta_counts_exactly():
    adapter = make_adapter(device="meta")
    assert adapter.num_parameters() == 190_840_832
    block = adapter.ref_loras[0]
    assert sum(p.down.numel() + p.up.numel() for p in block.values()) == 51_200 * 128
    target = adapter.target_loras[27]["self_attn.q_proj"]
    assert (list(target.down.shape), list(target.up.shape)) == ([64, 2048], [2048, 64])
    assert list(block["cross_attn.k_proj"].down.shape) == [128, 1024]
    assert list(block["mlp.layer1"].up.shape) == [8192, 128] and list(block["mlp.layer2"].down.shape) == [128, 8192]
    assert all(p.down.is_meta and p.up.is_meta for b in adapter.ref_loras for p in b.values())
    assert (adapter.context_dim, adapter.mlp_hidden) == (1024, 8192)


def test_real_size_file_estimates():
    adapter = make_adapter(device="meta")
    params = 190_840_832
    modes_bytes = 2 * 28 * 4
    # Header: 618 (bf16) / 1178 (fp8) entries of about 100 bytes each.
    bf16 = estimate_file_size(adapter, "bf16")
    assert 2 * params + modes_bytes < bf16 < 2 * params + modes_bytes + 100_000
    assert round(bf16 / 1e6) == 382  # the seeds: 382 MB
    # fp8: one byte per parameter plus a float32 scale per row; rows per block: ref down 10·128,
    # ref up 8·2048 + 8192 + 2048, target down 64, up 2048.
    rows = 28 * (10 * 128 + 8 * 2048 + 8192 + 2048 + 64 + 2048)
    assert rows == 840_448
    fp8 = estimate_file_size(adapter, "fp8_e4m3fn_rowwise")
    assert params + 4 * rows + modes_bytes < fp8 < params + 4 * rows + modes_bytes + 200_000
    assert abs(fp8 / 1e6 - 195) < 1.0  # the seeds: 195 MB
    assert estimate_file_size(adapter, "fp32") > 4 * params


def test_random_adapter_is_seeded():
    a = make_adapter(**SMALL, seed=3)
    b = make_adapter(**SMALL, seed=3)
    c = make_adapter(**SMALL, seed=4)
    for linear in REF_LINEARS:
        assert torch.equal(a.ref_loras[2][linear].up, b.ref_loras[2][linear].up)
        assert not torch.equal(a.ref_loras[2][linear].up, c.ref_loras[2][linear].up)
    assert a.identity == b.identity != c.identity
    assert a.identity.startswith("generated:")


def test_random_delta_is_about_scale_times_input():
    adapter = make_adapter(**SMALL, seed=0, scale=0.1)
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    ratios = []
    for block in adapter.ref_loras:
        for linear in ("self_attn.q_proj", "mlp.layer1", "cross_attn.output_proj"):
            delta = block[linear].delta(x)
            assert bool(torch.isfinite(delta).all())
            ratios.append(float(delta.pow(2).mean().sqrt() / x.pow(2).mean().sqrt()))
    mean = sum(ratios) / len(ratios)
    assert 0.08 < mean < 0.12, ratios
    assert all(0.05 < r < 0.16 for r in ratios), ratios


def test_alpha_changes_scale_not_delta_size():
    adapter = make_adapter(**SMALL, ref_alpha=4, seed=0, scale=0.1)
    pair = adapter.ref_loras[0]["self_attn.v_proj"]
    assert pair.scale == 0.25
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    ratio = float(pair.delta(x).pow(2).mean().sqrt() / x.pow(2).mean().sqrt())
    assert 0.05 < ratio < 0.16


def test_zero_adapter_is_an_exact_no_op():
    adapter = make_adapter(**SMALL, init="zero")
    x = torch.randn(8, 64)
    for block in (*adapter.ref_loras, *adapter.target_loras):
        for pair in block.values():
            assert torch.count_nonzero(pair.up) == 0
            assert torch.count_nonzero(pair.down) == pair.down.numel()  # standard LoRA init: down random
    assert torch.equal(adapter.target_loras[1]["self_attn.q_proj"].delta(x), torch.zeros(8, 64))
    assert adapter.identity != make_adapter(**SMALL, init="random").identity


def test_dtype_and_weight_format():
    adapter = make_adapter(**SMALL, dtype=torch.bfloat16)
    assert adapter.ref_loras[0]["mlp.layer2"].down.dtype == torch.bfloat16
    assert adapter.meta.weight_format == "bf16"
    assert adapter.mode_weights["cs"].dtype == torch.float32
    with pytest.raises(ValueError, match="dtype must be one of"):
        make_adapter(**SMALL, dtype=torch.int8)


def test_modes():
    adapter = make_adapter(**SMALL)
    assert adapter.meta.modes == ("cs", "char")
    assert adapter.block_weights("cs").tolist() == [1.0] * 4
    assert torch.equal(adapter.block_weights("char"), char_mode_weights(4))
    assert make_adapter(**SMALL, modes=("cs",)).meta.modes == ("cs",)
    with pytest.raises(ValueError, match=r"make_adapter knows modes cs, char, found \['style'\]"):
        make_adapter(**SMALL, modes=("cs", "style"))
    with pytest.raises(AdapterError, match=r"has no mode 'char' \(modes: cs\)"):
        make_adapter(**SMALL, modes=("cs",)).block_weights("char")


def test_char_vector_shape():
    w = char_mode_weights(28)
    assert w.dtype == torch.float32 and w.shape == (28,)
    assert w[:19].tolist() == [1.0] * 19  # full reference read in the first two thirds
    assert float(w[-1]) == pytest.approx(0.25)
    assert all(float(a) >= float(b) for a, b in zip(w[:-1], w[1:]))  # fades monotonically
    assert char_mode_weights(1).tolist() == [1.0]


def test_meta_adapter_keeps_real_mode_vectors():
    adapter = make_adapter(num_blocks=2, device="meta")
    assert adapter.mode_weights["cs"].device.type == "cpu"
    assert adapter.block_weights("char").tolist() == [1.0, 0.25]


def test_defaults_describe_the_real_adapter():
    meta = make_adapter(num_blocks=1, device="meta").meta
    assert (meta.base_model, meta.model_channels, meta.ref_rank, meta.target_rank) == ("anima-base-v1.0", 2048, 128, 64)
    assert (meta.ref_alpha, meta.target_alpha) == (128, 64)
    assert meta.ref_rope_offset == (0, "after_target", "after_target")


def test_bad_arguments():
    with pytest.raises(ValueError, match="init must be 'random' or 'zero', found 'ones'"):
        make_adapter(**SMALL, init="ones")  # type: ignore[arg-type]
    with pytest.raises(AdapterError, match="'ref_rank' must be a positive integer, found 0"):
        make_adapter(**{**SMALL, "ref_rank": 0})
