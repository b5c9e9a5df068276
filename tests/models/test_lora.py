import logging

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from snapref_ray.models import ops
from snapref_ray.models.block_map import INHERITED_28_TO_40, INSERTED_28_TO_40
from snapref_ray.models.lora import LoRAError, LoRAModule, merge_loras, read_lora

D, CTX, HIDDEN, ADALN, RANK = 8, 6, 16, 4, 2


class Holder(nn.Module):
    def __init__(self, **children: nn.Module) -> None:
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)


def linear(i: int, o: int, gen: torch.Generator) -> ops.Linear:
    layer = ops.Linear(i, o)
    layer.weight.data = torch.randn(o, i, generator=gen)
    return layer


def stand_in(num_blocks: int = 2, seed: int = 0) -> nn.Module:
    """Tiny module tree with ops.Linear at the Anima DiT's module paths (docs/design.md#dit, #llm-adapter)."""
    g = torch.Generator().manual_seed(seed)

    def attn(q_in, kv_in, out_name):
        return Holder(
            q_proj=linear(q_in, D, g),
            k_proj=linear(kv_in, D, g),
            v_proj=linear(kv_in, D, g),
            **{out_name: linear(D, D, g)},
        )

    def adaln(out):
        return nn.Sequential(nn.SiLU(), linear(D, ADALN, g), linear(ADALN, out, g))

    blocks = nn.ModuleList(
        Holder(
            self_attn=attn(D, D, "output_proj"),
            cross_attn=attn(D, CTX, "output_proj"),
            mlp=Holder(layer1=linear(D, HIDDEN, g), layer2=linear(HIDDEN, D, g)),
            adaln_modulation_self_attn=adaln(3 * D),
            adaln_modulation_cross_attn=adaln(3 * D),
            adaln_modulation_mlp=adaln(3 * D),
        )
        for _ in range(num_blocks)
    )
    adapter_block = Holder(
        self_attn=attn(D, D, "o_proj"),
        cross_attn=attn(D, D, "o_proj"),
        mlp=nn.Sequential(linear(D, HIDDEN, g), nn.GELU(), linear(HIDDEN, D, g)),
    )
    return Holder(
        t_embedder=nn.Sequential(nn.Identity(), Holder(linear_1=linear(D, D, g), linear_2=linear(D, 3 * D, g))),
        x_embedder=Holder(proj=nn.Sequential(nn.Identity(), linear(68, D, g))),
        blocks=blocks,
        final_layer=Holder(linear=linear(D, 64, g), adaln_modulation=adaln(2 * D)),
        llm_adapter=Holder(blocks=nn.ModuleList([adapter_block]), out_proj=linear(D, D, g)),
    )


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, ops.Linear)}


def random_lora(model: nn.Module, paths, seed: int = 1, alpha: float | None = 1.0) -> dict[str, LoRAModule]:
    g = torch.Generator().manual_seed(seed)
    modules = dict(model.named_modules())
    return {
        p: LoRAModule(
            down=torch.randn(RANK, modules[p].in_features, generator=g),
            up=torch.randn(modules[p].out_features, RANK, generator=g),
            alpha=alpha,
        )
        for p in paths
    }


def expected_delta(module: LoRAModule) -> torch.Tensor:
    scale = 1.0 if module.alpha is None else module.alpha / module.down.shape[0]
    return (module.up.double() @ module.down.double() * scale).float()


PATHS = [
    "blocks.0.self_attn.q_proj",
    "blocks.1.cross_attn.k_proj",
    "blocks.1.mlp.layer2",
    "blocks.0.adaln_modulation_mlp.1",
    "final_layer.linear",
    "final_layer.adaln_modulation.2",
    "x_embedder.proj.1",
    "t_embedder.1.linear_2",
    "llm_adapter.blocks.0.self_attn.o_proj",
    "llm_adapter.blocks.0.mlp.2",
    "llm_adapter.out_proj",
]
DIT_ONLY = [p for p in PATHS if not p.startswith("llm_adapter.")]


def to_comfyui(lora, prefix="diffusion_model."):
    sd = {}
    for p, m in lora.items():
        sd[f"{prefix}{p}.lora_down.weight"] = m.down
        sd[f"{prefix}{p}.lora_up.weight"] = m.up
        sd[f"{prefix}{p}.alpha"] = torch.tensor(m.alpha)
    return sd


def to_peft(lora, prefix="diffusion_model."):
    # No alpha in a PEFT file (scale 1), so fold alpha/r into B to describe the same update.
    return {
        k: v
        for p, m in lora.items()
        for k, v in ((f"{prefix}{p}.lora_A.weight", m.down), (f"{prefix}{p}.lora_B.weight", m.up * (m.alpha / RANK)))
    }


def to_kohya(lora):
    sd = {}
    for p, m in lora.items():
        name = "lora_unet_" + p.replace(".", "_")
        sd[f"{name}.lora_down.weight"], sd[f"{name}.lora_up.weight"] = m.down, m.up
        sd[f"{name}.alpha"] = torch.tensor(m.alpha)
    return sd


DIFFUSERS_NAMES = {
    "blocks.0.self_attn.q_proj": "transformer_blocks.0.attn1.to_q",
    "blocks.1.cross_attn.k_proj": "transformer_blocks.1.attn2.to_k",
    "blocks.1.mlp.layer2": "transformer_blocks.1.ff.net.2",
    "blocks.0.adaln_modulation_mlp.1": "transformer_blocks.0.norm3.linear_1",
    "final_layer.linear": "proj_out",
    "final_layer.adaln_modulation.2": "norm_out.linear_2",
    "x_embedder.proj.1": "patch_embed.proj",
    "t_embedder.1.linear_2": "time_embed.t_embedder.linear_2",
}


def to_diffusers(lora):
    return to_peft({DIFFUSERS_NAMES[p]: m for p, m in lora.items()}, prefix="transformer.")


FORMATS = {
    "comfyui": lambda lora: to_comfyui(lora),
    "comfyui-net": lambda lora: to_comfyui(lora, "net."),
    "comfyui-bare": lambda lora: to_comfyui(lora, ""),
    "peft": lambda lora: to_peft(lora),
    "peft-base-model": lambda lora: to_peft(lora, "base_model.model.diffusion_model."),
    "kohya": to_kohya,
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_merges_to_the_same_weights(fmt):
    model = stand_in()
    before = weights(model)
    lora = random_lora(model, PATHS)
    parsed = read_lora(FORMATS[fmt](lora))
    assert sorted(parsed) == sorted(PATHS)
    merge_loras(model, [(parsed, 1.0)])
    after = weights(model)
    for name in after:
        expected = before[name] + expected_delta(lora[name]) if name in lora else before[name]
        assert torch.allclose(after[name], expected, atol=1e-5), name


def test_diffusers_names_merge_like_comfyui():
    lora = random_lora(stand_in(), DIT_ONLY)
    via_diffusers, via_comfyui = stand_in(), stand_in()
    merge_loras(via_diffusers, [(read_lora(to_diffusers(lora)), 1.0)])
    merge_loras(via_comfyui, [(read_lora(to_comfyui(lora)), 1.0)])
    a, b = weights(via_diffusers), weights(via_comfyui)
    assert all(torch.allclose(a[n], b[n], atol=1e-6) for n in a)
    assert not torch.equal(a["blocks.0.self_attn.q_proj"], weights(stand_in())["blocks.0.self_attn.q_proj"])


def test_read_from_file_with_bf16_fp16_and_fp8_tensors(tmp_path):
    model = stand_in()
    before = weights(model)
    lora = random_lora(model, ["blocks.0.self_attn.q_proj", "blocks.1.mlp.layer1", "llm_adapter.out_proj"])
    lora["blocks.0.self_attn.q_proj"].down = lora["blocks.0.self_attn.q_proj"].down.bfloat16()
    lora["blocks.1.mlp.layer1"].up = lora["blocks.1.mlp.layer1"].up.half()
    lora["llm_adapter.out_proj"].up = lora["llm_adapter.out_proj"].up.to(torch.float8_e4m3fn)
    sd = to_comfyui(lora)
    sd["diffusion_model.blocks.1.mlp.layer1.alpha"] = torch.tensor(1.0, dtype=torch.bfloat16)
    path = tmp_path / "style.safetensors"
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    parsed = read_lora(path)
    assert parsed["llm_adapter.out_proj"].up.dtype == torch.float8_e4m3fn
    merge_loras(model, [(parsed, 1.0)])
    after = weights(model)
    for name, module in lora.items():
        exact = LoRAModule(module.down.float(), module.up.float(), module.alpha)  # the stored (rounded) values
        assert torch.allclose(after[name], before[name] + expected_delta(exact), atol=1e-5), name


def test_strength_scales_the_update():
    lora = random_lora(stand_in(), ["blocks.1.cross_attn.v_proj"], alpha=4.0)
    base = weights(stand_in())["blocks.1.cross_attn.v_proj"]
    delta = expected_delta(lora["blocks.1.cross_attn.v_proj"])  # alpha 4 / rank 2 = scale 2
    for strength in (0.0, 0.35, -1.5):
        model = stand_in()
        merge_loras(model, [(lora, strength)])
        assert torch.allclose(weights(model)["blocks.1.cross_attn.v_proj"], base + strength * delta, atol=1e-5)


def test_alpha_none_means_scale_one():
    m = LoRAModule(down=torch.ones(4, 3), up=torch.ones(2, 4), alpha=None)
    assert m.scale == 1.0 and m.rank == 4
    assert torch.equal(m.delta_weight(), torch.full((2, 3), 4.0))
    assert LoRAModule(down=torch.ones(4, 3), up=torch.ones(2, 4), alpha=2.0).scale == 0.5


def test_two_loras_stack():
    model = stand_in()
    before = weights(model)
    first = random_lora(model, ["blocks.0.self_attn.q_proj", "blocks.0.mlp.layer1"], seed=1)
    second = random_lora(model, ["blocks.0.self_attn.q_proj", "llm_adapter.out_proj"], seed=2)
    merge_loras(model, [(first, 0.8), (second, -0.5)])
    after = weights(model)
    q = "blocks.0.self_attn.q_proj"
    assert torch.allclose(
        after[q], before[q] + 0.8 * expected_delta(first[q]) - 0.5 * expected_delta(second[q]), atol=1e-5
    )
    assert torch.allclose(
        after["blocks.0.mlp.layer1"],
        before["blocks.0.mlp.layer1"] + 0.8 * expected_delta(first["blocks.0.mlp.layer1"]),
        atol=1e-5,
    )
    assert torch.allclose(
        after["llm_adapter.out_proj"],
        before["llm_adapter.out_proj"] - 0.5 * expected_delta(second["llm_adapter.out_proj"]),
        atol=1e-5,
    )


def test_28_block_lora_on_40_block_model_hits_the_inherited_blocks_only():
    model = stand_in(num_blocks=40)
    before = weights(model)
    paths = [f"blocks.{k}.self_attn.q_proj" for k in range(28)] + ["llm_adapter.blocks.0.cross_attn.k_proj"]
    lora = random_lora(stand_in(28), paths)
    merge_loras(model, [(lora, 1.0)])
    after = weights(model)
    for k, new in enumerate(INHERITED_28_TO_40):
        name = f"blocks.{new}.self_attn.q_proj"
        assert torch.allclose(
            after[name], before[name] + expected_delta(lora[f"blocks.{k}.self_attn.q_proj"]), atol=1e-5
        ), (k, new)
    for new in INSERTED_28_TO_40:
        assert torch.equal(after[f"blocks.{new}.self_attn.q_proj"], before[f"blocks.{new}.self_attn.q_proj"])
    # the LLM adapter's blocks are not DiT blocks: never remapped
    k_proj = "llm_adapter.blocks.0.cross_attn.k_proj"
    assert torch.allclose(after[k_proj], before[k_proj] + expected_delta(lora[k_proj]), atol=1e-5)
    changed = {n for n in after if not torch.equal(after[n], before[n])}
    assert changed == {f"blocks.{n}.self_attn.q_proj" for n in INHERITED_28_TO_40} | {k_proj}


def test_lora_blocks_overrides_the_guess():
    model = stand_in(num_blocks=40)
    before = weights(model)
    lora = random_lora(model, ["blocks.2.mlp.layer1"])  # touches only block 2: guessed as a 28-block LoRA
    merge_loras(model, [(lora, 1.0)], lora_blocks=40)
    after = weights(model)
    assert torch.allclose(
        after["blocks.2.mlp.layer1"],
        before["blocks.2.mlp.layer1"] + expected_delta(lora["blocks.2.mlp.layer1"]),
        atol=1e-5,
    )
    guessed = stand_in(num_blocks=40)
    merge_loras(guessed, [(lora, 1.0)])
    assert torch.equal(weights(guessed)["blocks.2.mlp.layer1"], before["blocks.2.mlp.layer1"])  # inserted block
    assert not torch.equal(weights(guessed)["blocks.3.mlp.layer1"], before["blocks.3.mlp.layer1"])


def test_lora_layout_without_a_map_is_an_error():
    lora = random_lora(stand_in(28), ["blocks.27.mlp.layer1"])
    with pytest.raises(LoRAError, match="LoRA 1 of 1: an adapter with 28 blocks cannot be attached to a model with 30"):
        merge_loras(stand_in(num_blocks=30), [(lora, 1.0)], lora_blocks=28)
    with pytest.raises(LoRAError, match="LoRA 1 of 1: has weights for block 27, but the model has only 2 blocks"):
        merge_loras(stand_in(num_blocks=2), [(lora, 1.0)])


def test_lora_matching_nothing_is_an_error():
    lora = random_lora(stand_in(), ["blocks.0.self_attn.q_proj"])
    lora = {"llm_adapter.blocks.3.self_attn.q_proj": lora["blocks.0.self_attn.q_proj"]}
    model = stand_in()
    before = weights(model)
    with pytest.raises(
        LoRAError,
        match=r"LoRA 1 of 1: none of its 1 modules exist in the model"
        r" \(e.g. 'llm_adapter.blocks.3.self_attn.q_proj'\)",
    ):
        merge_loras(model, [(lora, 1.0)])
    assert all(torch.equal(before[n], w) for n, w in weights(model).items())


def test_partial_match_logs_the_count(caplog):
    model = stand_in()
    lora = random_lora(model, ["blocks.0.self_attn.q_proj", "blocks.1.self_attn.q_proj"])
    lora["llm_adapter.blocks.5.mlp.0"] = LoRAModule(torch.ones(RANK, D), torch.ones(HIDDEN, RANK), None)
    with caplog.at_level(logging.INFO, logger="snapref_ray.models.lora"):
        merge_loras(model, [(lora, 1.0)])
    assert "LoRA 1 of 1: 2 of 3 modules matched; not in the model: 'llm_adapter.blocks.5.mlp.0'" in caplog.text


def test_shape_mismatch_names_the_module_and_changes_nothing():
    model = stand_in()
    before = weights(model)
    good = random_lora(model, ["blocks.0.mlp.layer1"])
    bad = {"blocks.1.cross_attn.k_proj": LoRAModule(torch.ones(RANK, D), torch.ones(D, RANK), 1.0)}  # in is CTX
    with pytest.raises(
        LoRAError,
        match=r"LoRA 2 of 2: module 'blocks.1.cross_attn.k_proj' gives a \[8, 8\] update,"
        r" but the weight is \[8, 6\]",
    ):
        merge_loras(model, [(good, 1.0), (bad, 1.0)])
    assert all(torch.equal(before[n], w) for n, w in weights(model).items())


def test_unparseable_keys_are_named():
    sd = to_comfyui(random_lora(stand_in(), ["blocks.0.self_attn.q_proj"]))
    sd["lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight"] = torch.ones(2, 4)
    sd["diffusion_model.blocks.0.self_attn.q_proj.dora_scale"] = torch.ones(1, 8)
    with pytest.raises(
        LoRAError,
        match=r"LoRA state dict: 2 key\(s\) are not LoRA weights of an Anima DiT linear"
        r".*'lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight',"
        r" 'diffusion_model.blocks.0.self_attn.q_proj.dora_scale'",
    ):
        read_lora(sd)


def test_unknown_kohya_module_is_named():
    with pytest.raises(LoRAError, match="'lora_unet_blocks_0_self_attn_qkv.lora_up.weight'"):
        read_lora({"lora_unet_blocks_0_self_attn_qkv.lora_up.weight": torch.ones(8, 2)})


def test_missing_half_and_rank_mismatch_are_named():
    with pytest.raises(
        LoRAError,
        match=r"module 'blocks.0.mlp.layer1' has no up matrix \(found only"
        r" 'diffusion_model.blocks.0.mlp.layer1.lora_down.weight'\)",
    ):
        read_lora({"diffusion_model.blocks.0.mlp.layer1.lora_down.weight": torch.ones(2, 8)})
    with pytest.raises(LoRAError, match=r"module 'blocks.0.mlp.layer1': down .* has rank 2 but up .* has rank 3"):
        read_lora(
            {
                "diffusion_model.blocks.0.mlp.layer1.lora_down.weight": torch.ones(2, 8),
                "diffusion_model.blocks.0.mlp.layer1.lora_up.weight": torch.ones(16, 3),
            }
        )


def test_float8_weight_is_dequantised_and_stored_merged():
    model = stand_in()
    layer = dict(model.named_modules())["blocks.0.self_attn.k_proj"]
    w = torch.randn(D, D, generator=torch.Generator().manual_seed(3))
    layer.weight = nn.Parameter(w.to(torch.float8_e4m3fn), requires_grad=False)
    layer.weight_scale = torch.tensor(0.5)
    dequantised = layer.weight.float() * 0.5
    lora = random_lora(model, ["blocks.0.self_attn.k_proj"])
    merge_loras(model, [(lora, 1.0)], fp8_dtype=torch.float32)
    assert layer.weight.dtype == torch.float32 and layer.weight_scale is None
    assert torch.allclose(layer.weight, dequantised + expected_delta(lora["blocks.0.self_attn.k_proj"]), atol=1e-5)


def test_float8_weight_defaults_to_bf16_and_bf16_weights_stay_bf16():
    model = stand_in()
    modules = dict(model.named_modules())
    fp8, bf16 = modules["blocks.0.self_attn.k_proj"], modules["blocks.0.self_attn.v_proj"]
    fp8.weight = nn.Parameter(fp8.weight.to(torch.float8_e4m3fn), requires_grad=False)
    bf16.weight = nn.Parameter(bf16.weight.bfloat16(), requires_grad=False)
    bf16_before = bf16.weight.clone()
    lora = random_lora(model, ["blocks.0.self_attn.k_proj", "blocks.0.self_attn.v_proj"])
    merge_loras(model, [(lora, 1.0)])
    assert fp8.weight.dtype == torch.bfloat16 and fp8.weight_scale is None
    expected = (bf16_before.float() + lora["blocks.0.self_attn.v_proj"].delta_weight()).bfloat16()
    assert bf16.weight.dtype == torch.bfloat16 and torch.equal(bf16.weight, expected)


def test_merge_into_the_real_dit():
    from snapref_ray.models.dit import load_dit
    from snapref_ray.models.tiny_dit import make_tiny_dit_state_dict

    dit = load_dit(make_tiny_dit_state_dict(num_blocks=2, model_channels=64, adapter_blocks=1))
    before = weights(dit)
    paths = [
        "blocks.1.self_attn.q_proj",
        "blocks.0.cross_attn.k_proj",
        "blocks.1.adaln_modulation_cross_attn.2",
        "final_layer.adaln_modulation.1",
        "x_embedder.proj.1",
        "llm_adapter.blocks.0.cross_attn.v_proj",
    ]
    lora = random_lora(dit, paths)
    merge_loras(dit, [(read_lora(to_kohya(lora)), 0.5)])
    after = weights(dit)
    for name in after:
        expected = before[name] + 0.5 * expected_delta(lora[name]) if name in lora else before[name]
        assert torch.allclose(after[name], expected, atol=1e-5), name
