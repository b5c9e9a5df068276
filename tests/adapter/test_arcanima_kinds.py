"""Which kind a file is (metadata, then tensor signature), inspect/convert/make-tiny on the CLI, kinds
kept apart, block layouts, and the per-kind settings (defaults, misfits, strength and fidelity)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from snapref_ray.adapter.arcanima import load_arcanima, make_arcanima, save_arcanima
from snapref_ray.adapter.controls import SettingsError, resolve_settings
from snapref_ray.adapter.file import AdapterError, load_adapter
from snapref_ray.adapter.inspect import inspect_file
from snapref_ray.adapter.kinds import detect_kind
from snapref_ray.cli import main
from snapref_ray.engine import Renderer, RenderError
from snapref_ray.models.block_map import INHERITED_28_TO_40, BlockLayoutError
from snapref_ray.requests import RenderRequest, RenderSettings
from snapref_ray.tiny import TinyConfig, make_tiny, write_tiny_adapter

W = 16  # width of the signature-only files: the signature is ranks, blocks and linears, not widths
SMALL = dict(width=256, height=256, steps=2, sampler="euler")


def real_layout_file(path: Path, kind: str, spelling: str) -> Path:
    """28 blocks x ten linears at the published rank, no metadata, in a given key spelling."""
    adapter = make_arcanima(kind, model_channels=W, context_dim=W, mlp_hidden=4 * W, rank=None)
    sd = {}
    for i, block in enumerate(adapter.loras):
        for linear, pair in block.items():
            if spelling == "peft":
                stem = f"base_model.model.diffusion_model.blocks.{i}.{linear}"
                sd[f"{stem}.lora_A.weight"], sd[f"{stem}.lora_B.weight"] = pair.down, pair.up
            else:  # kohya
                stem = f"lora_unet_blocks_{i}_{linear.replace('.', '_')}"
                sd[f"{stem}.lora_down.weight"], sd[f"{stem}.lora_up.weight"] = pair.down, pair.up
                sd[f"{stem}.alpha"] = torch.tensor(float(pair.down.shape[0]))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("kinds")
    models = make_tiny(d / "m")  # adapter.safetensors is a SnapRef file
    out = {"models": models, "snapref": models / "adapter.safetensors", "dit": models / "dit.safetensors"}
    for kind in ("arcanima-v2", "arcanima-pilot"):
        out[kind] = write_tiny_adapter(d / f"{kind}.safetensors", TinyConfig(), kind)
    out["v2_peft"] = real_layout_file(d / "renamed_v2.safetensors", "arcanima-v2", "peft")
    out["pilot_kohya"] = real_layout_file(d / "some_name.safetensors", "arcanima-pilot", "kohya")
    # A plain style LoRA with the pilot's rank on the ten linears, but also on the adaLN modulation.
    style = {}
    for i in range(28):
        for linear in ("self_attn.q_proj", "mlp.layer1", "adaln_modulation_mlp.1"):
            style[f"diffusion_model.blocks.{i}.{linear}.lora_down.weight"] = torch.randn(32, W)
            style[f"diffusion_model.blocks.{i}.{linear}.lora_up.weight"] = torch.zeros(W, 32)
    save_file(style, str(d / "style.safetensors"))
    out["style"] = d / "style.safetensors"
    (d / "junk.safetensors").write_bytes(b"not a safetensors file at all")
    out["junk"] = d / "junk.safetensors"
    return out


@pytest.mark.parametrize(
    "name, kind, how",
    [
        ("snapref", "snapref", "metadata"),
        ("arcanima-v2", "arcanima-v2", "metadata"),
        ("arcanima-pilot", "arcanima-pilot", "metadata"),
        ("v2_peft", "arcanima-v2", "tensor signature"),
        ("pilot_kohya", "arcanima-pilot", "tensor signature"),
        ("style", "lora", "tensor signature"),
        ("dit", "unusable", "not an adapter"),
        ("junk", "unusable", "not an adapter"),
    ],
)
def test_inspect_names_each_kind(files, name, kind, how, capsys):
    info = inspect_file(files[name])
    assert (info["kind"], info["detected_by"]) == (kind, how)
    assert info["is_adapter"] == (kind in ("snapref", "arcanima-v2", "arcanima-pilot"))
    rc = main(["adapter", "inspect", str(files[name])])
    text = capsys.readouterr().out
    assert rc == (1 if kind == "unusable" else 0)
    assert "kind:" in text and kind in text
    if kind == "lora":
        assert "NOT a reference adapter" in text and "adapts 28 non-block" not in text
    if kind.startswith("arcanima"):
        assert "method:" in text and ("asymmetric attention" in text if kind == "arcanima-v2" else "two frames" in text)


def test_signature_needs_the_whole_published_layout(tmp_path):
    adapter = make_arcanima("arcanima-v2", num_blocks=27, model_channels=W, context_dim=W, mlp_hidden=4 * W)
    save_arcanima(adapter, tmp_path / "a.safetensors", with_kind_metadata=False)
    d = detect_kind(tmp_path / "a.safetensors")
    assert d.kind == "lora" and "27 blocks, expected 28" in d.reason


def test_inspect_json_and_real_size_parameters(files, capsys):
    assert main(["adapter", "inspect", "--json", str(files["v2_peft"])]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["rank"] == "64" and info["num_blocks"] == 28 and len(info["linears"]) == 10
    # The published v2: rank 64 on ten linears of 28 blocks = 28 x 64 x 51,200 = 91,750,400 parameters.
    assert make_arcanima("arcanima-v2", device="meta").num_parameters() == 91_750_400


def test_kinds_never_cross(files):
    with pytest.raises(AdapterError, match="not an ArcAnima adapter"):
        load_arcanima(files["snapref"])
    with pytest.raises(AdapterError, match="reference adapter of kind arcanima-v2.*--adapter"):
        load_adapter(files["arcanima-v2"])
    with pytest.raises(AdapterError, match="is arcanima-pilot, expected arcanima-v2"):
        load_arcanima(files["arcanima-pilot"], expected_kind="arcanima-v2")
    snap = Renderer.from_folder(files["models"], device="cpu")
    v2 = snap.with_adapter(files["arcanima-v2"])
    assert (snap.adapter_kind, v2.adapter_kind) == ("snapref", "arcanima-v2")
    ref = (files["models"] / "reference.png").read_bytes()
    kv = snap.encode_reference(ref, width=256, height=256)
    with pytest.raises(RenderError, match="different adapter"):
        v2.render(RenderRequest(prompt="x", settings=RenderSettings(**SMALL)), refkv=kv)
    with pytest.raises(RenderError, match="plain LoRA.*--lora"):
        snap.with_adapter(files["style"])


def test_lora_flag_refuses_a_reference_adapter(files, tmp_path, capsys):
    rc = main(
        [
            "txt2img",
            "--models",
            str(files["models"]),
            "--prompt",
            "x",
            "--out",
            str(tmp_path / "o.png"),
            "--lora",
            str(files["arcanima-pilot"]),
            "--steps",
            "1",
            "--width",
            "256",
            "--height",
            "256",
        ]
    )
    assert rc == 2 and "pass it with --adapter" in capsys.readouterr().err


@pytest.mark.slow
def test_block_layouts(tmp_path, files):
    three = write_tiny_adapter(tmp_path / "v2_3.safetensors", TinyConfig(), "arcanima-v2", num_blocks=3)
    base = Renderer.from_folder(files["models"], device="cpu")
    with pytest.raises(BlockLayoutError, match="3 blocks .* 2 blocks"):
        base.with_adapter(three)
    # A 28-block adapter on the 40-block model: hooks on the inherited blocks, K/V read in all 40.
    deep = make_tiny(tmp_path / "deep", TinyConfig(num_blocks=40), with_adapter=False)
    adapter28 = write_tiny_adapter(tmp_path / "v2_28.safetensors", TinyConfig(), "arcanima-v2", num_blocks=28)
    r = Renderer.from_folder(deep, adapter=adapter28, device="cpu")
    hooked = [i for i, k in enumerate(r.adapter.hooked) if k is not None]
    assert hooked == list(INHERITED_28_TO_40)
    loras = r.adapter.full_loras()
    assert all(loras[i] is None for i in range(40) if i not in INHERITED_28_TO_40)
    kv = r.encode_reference((deep / "reference.png").read_bytes(), width=256, height=256)
    assert kv.num_blocks == 40


def test_convert_renames_tensors_and_stamps_the_kind(files, tmp_path, capsys):
    src = tmp_path / "odd.safetensors"
    adapter = make_arcanima("arcanima-pilot", num_blocks=2, model_channels=W, context_dim=W, mlp_hidden=4 * W)
    sd = {
        f"ref_adapter.blocks.{i}.{lin}.{part}": getattr(p, part).contiguous()
        for i, b in enumerate(adapter.loras)
        for lin, p in b.items()
        for part in ("down", "up")
    }
    save_file(sd, str(src))
    assert inspect_file(src)["kind"] == "unusable"
    mapping = tmp_path / "map.yaml"
    mapping.write_text(
        'rename:\n  - ["^ref_adapter\\\\.", "diffusion_model."]\n'
        '  - ["\\\\.(down|up)$", ".lora_\\\\1.weight"]\nkind: arcanima-pilot\n'
    )
    out = tmp_path / "fixed.safetensors"
    assert main(["adapter", "convert", str(src), str(out), "--map", str(mapping)]) == 0
    assert "arcanima-pilot" in capsys.readouterr().out
    assert detect_kind(out).kind == "arcanima-pilot" and load_arcanima(out).rank == 32
    mapping.write_text('rename:\n  - ["^ref_adapter\\\\.", "diffusion_model."]\nkind: arcanima-v2\n')
    assert main(["adapter", "convert", str(src), str(tmp_path / "bad.safetensors"), "--map", str(mapping)]) == 2
    assert "the map says kind 'arcanima-v2'" in capsys.readouterr().err and not (tmp_path / "bad.safetensors").exists()


@pytest.mark.parametrize("kind", ["snapref", "arcanima-v2", "arcanima-pilot"])
def test_make_tiny_writes_each_kind(tmp_path, kind):
    assert main(["make-tiny", str(tmp_path / "t"), "--adapter-kind", kind]) == 0
    assert detect_kind(tmp_path / "t" / "adapter.safetensors").kind == kind


# -- settings per kind ---------------------------------------------------------------------------


def test_text_cfg_default_is_4_5():
    assert RenderSettings().cfg == 4.5


def test_kind_defaults_and_user_set_fields_win():
    s = RenderSettings()
    assert (resolve_settings(s, "snapref").ref_guidance, resolve_settings(s, "snapref").ref_in_uncond) == (1.0, False)
    for kind in ("arcanima-v2", "arcanima-pilot"):
        r = resolve_settings(s, kind)
        assert (r.ref_guidance, r.correction, r.ref_in_uncond, r.strength) == (4.5, "apg", True, 1.0)
        assert resolve_settings(RenderSettings(ref_guidance=2.0, ref_in_uncond=False), kind).ref_guidance == 2.0
        assert resolve_settings(RenderSettings(ref_in_uncond=False), kind).ref_in_uncond is False
    # Through a full dump and rebuild (what job specs and the HTTP body do) unset stays unset.
    rebuilt = RenderSettings(**RenderSettings(steps=3).model_dump())
    assert resolve_settings(rebuilt, "arcanima-v2").ref_guidance == 4.5
    assert resolve_settings(resolve_settings(rebuilt, "snapref"), "snapref") == resolve_settings(rebuilt, "snapref")


def test_strength_and_fidelity_per_kind():
    snap = resolve_settings(RenderSettings(strength=0.7, fidelity=3.0), "snapref")
    assert (snap.ref_weight, snap.ref_guidance) == (0.7, 3.0)
    arc = resolve_settings(RenderSettings(strength=0.7, fidelity=3.0), "arcanima-v2")
    assert (arc.strength, arc.ref_weight, arc.ref_guidance) == (0.7, 1.0, 3.0)
    with pytest.raises(SettingsError, match="fidelity=3 and ref_guidance=2 disagree"):
        resolve_settings(RenderSettings(fidelity=3.0, ref_guidance=2.0), "arcanima-v2")
    with pytest.raises(SettingsError, match="strength=0.5 and ref_weight=0.8 disagree"):
        resolve_settings(RenderSettings(strength=0.5, ref_weight=0.8), "snapref")


@pytest.mark.parametrize(
    "field, value, kind",
    [
        ("mode", "char", "arcanima-v2"),
        ("ref_caption", "1girl", "arcanima-v2"),
        ("ref_weight", 0.5, "arcanima-pilot"),
        ("ref_megapixels", 0.5, "arcanima-pilot"),
        ("recompute_reference_every_step", True, "arcanima-v2"),
        ("ref_outside", "no_reference", "snapref"),
    ],
)
def test_settings_that_do_not_apply_are_refused_by_name(field, value, kind):
    with pytest.raises(SettingsError) as e:
        resolve_settings(RenderSettings(**{field: value}), kind)
    assert e.value.field == field and kind in str(e.value)


def test_renderer_refuses_a_misfit_setting(files):
    v2 = Renderer.from_folder(files["models"], adapter=files["arcanima-v2"], device="cpu")
    with pytest.raises(RenderError, match="mode='char' does not apply to arcanima-v2 adapters"):
        v2.render(
            RenderRequest(prompt="x", settings=RenderSettings(mode="char", **SMALL)),
            references=[(files["models"] / "reference.png").read_bytes()],
        )


def test_arcanima_guidance_rows_and_the_outside_option():
    from snapref_ray.sampling.ref_guidance import Row, step_rows

    v2 = resolve_settings(RenderSettings(ref_end=0.5), "arcanima-v2")
    inside, outside = step_rows(v2, 0.99, True), step_rows(v2, 0.05, True)
    assert inside.rows == (Row.COND, Row.UNCOND, Row.COND_NOREF) and inside.reads == (True, True, False)
    assert outside.rows == (Row.COND, Row.UNCOND) and outside.reads == (True, True)  # outside: "reference"
    plain = resolve_settings(RenderSettings(ref_end=0.5, ref_outside="no_reference"), "arcanima-v2")
    assert step_rows(plain, 0.05, True).reads == (False, False)
    assert step_rows(plain, 0.99, True).reads == (True, True, False)
    # SnapRef keeps its own default: only the cond row reads, no extra row.
    snap = step_rows(resolve_settings(RenderSettings(), "snapref"), 0.99, True)
    assert snap.rows == (Row.COND, Row.UNCOND) and snap.reads == (True, False)


def test_two_characters_stitched_and_no_multi_reference(files):
    ref = (files["models"] / "reference.png").read_bytes()  # 128 x 192
    base = Renderer.from_folder(files["models"], device="cpu")
    v2, pilot = base.with_adapter(files["arcanima-v2"]), base.with_adapter(files["arcanima-pilot"])
    one = v2.encode_reference(ref, width=256, height=256)
    pair = v2.encode_reference([ref, ref], layout="pair", width=256, height=256)
    assert pair.grids[0][2] == 2 * one.grids[0][2] and pair.offsets[0] == (0, 16, 16)  # past the 16x16 target grid
    frame = pilot.encode_reference([ref, ref], layout="pair", width=384, height=256)
    assert frame.payload == "frame_latent" and frame.kv_N2HLD.shape[-2:] == (32, 48)  # the output size
    with pytest.raises(RenderError, match="layout: several references of one character are a SnapRef feature"):
        v2.encode_reference([ref, ref], layout="multi", width=256, height=256)
