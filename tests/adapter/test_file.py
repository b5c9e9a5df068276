"""anima_ref_kv/1 files: round trips in every weight format, detection from metadata only, clear refusals."""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from snapref_ray.adapter import (
    FORMAT,
    REF_LINEARS,
    TARGET_LINEARS,
    AdapterError,
    AdapterMeta,
    adapter_identity,
    check_adapter_file,
    estimate_file_size,
    format_inspection,
    inspect_adapter,
    load_adapter,
    make_adapter,
    save_adapter,
)
from snapref_ray.adapter import file as adapter_file
from snapref_ray.adapter.file import adapter_state_dict, lora_key, quantize_fp8_rowwise

TINY = dict(num_blocks=3, model_channels=32, context_dim=16, mlp_hidden=64, ref_rank=4, target_rank=2)
EXACT_FORMATS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@pytest.fixture(scope="module")
def tiny():
    return make_adapter(**TINY, seed=1)


@pytest.fixture
def tiny_file(tiny, tmp_path) -> Path:
    path = tmp_path / "tiny.safetensors"
    save_adapter(tiny, path, "bf16")
    return path


def write(path: Path, sd: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> Path:
    save_file(sd, str(path), metadata=metadata)
    return path


def pairs(adapter):
    for branch, blocks in (("ref", adapter.ref_loras), ("target", adapter.target_loras)):
        for i, block in enumerate(blocks):
            for linear, pair in block.items():
                yield f"{branch}.{i}.{linear}", pair


# ---------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("weight_format", list(EXACT_FORMATS))
def test_round_trip_exact_formats(tiny, tmp_path, weight_format):
    path = tmp_path / f"a_{weight_format}.safetensors"
    save_adapter(tiny, path, weight_format)
    loaded = load_adapter(path)
    store = EXACT_FORMATS[weight_format]
    assert loaded.meta == AdapterMeta(**{**tiny.meta.__dict__, "weight_format": weight_format})
    originals = dict(pairs(tiny))
    loaded_pairs = dict(pairs(loaded))
    assert sorted(loaded_pairs) == sorted(originals) and len(originals) == 3 * (10 + 1)
    for name, pair in loaded_pairs.items():
        assert pair.down.dtype == store and pair.up.dtype == store
        # bf16/fp16 storage is exactly the rounded fp32 value, nothing more lost.
        assert torch.equal(pair.down, originals[name].down.to(store)), name
        assert torch.equal(pair.up, originals[name].up.to(store)), name
        assert pair.scale == 1.0
    for mode in ("cs", "char"):
        assert loaded.mode_weights[mode].dtype == torch.float32
        assert torch.equal(loaded.mode_weights[mode], tiny.mode_weights[mode])
    # Per block: ref r=4 · (6·(32+32) + 2·(16+32) + 2·(32+64)) = 2688, target r=2 · (32+32) = 128.
    assert loaded.num_parameters() == tiny.num_parameters() == 3 * (2688 + 128)
    assert loaded.source == str(path)


def test_round_trip_fp8_rowwise(tiny, tmp_path):
    path = tmp_path / "a_fp8.safetensors"
    save_adapter(tiny, path, "fp8_e4m3fn_rowwise")
    header = json.loads(path.read_bytes()[8 : 8 + int.from_bytes(path.read_bytes()[:8], "little")])
    key = lora_key("ref", 2, "mlp.layer1", "up")
    assert header[key]["dtype"] == "F8_E4M3" and header[key]["shape"] == [64, 4]
    assert header[key + "_scale"] == {**header[key + "_scale"], "dtype": "F32", "shape": [64]}
    assert header["__metadata__"]["weight_format"] == "fp8_e4m3fn_rowwise"

    loaded = load_adapter(path)
    originals = dict(pairs(tiny))
    worst = 0.0
    for name, pair in pairs(loaded):
        for w, ref in ((pair.down, originals[name].down), (pair.up, originals[name].up)):
            assert w.dtype == torch.float32
            row_scale = ref.abs().amax(dim=1, keepdim=True) / 448
            # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values, and at most half
            # a subnormal step (2^-10 of the row scale) for values far below the row's maximum.
            bound = ref.abs() / 16 + row_scale * 2.0**-10
            assert bool(((w - ref).abs() <= bound).all()), name
            normal = ref.abs() >= row_scale * 2.0**-6  # e4m3's smallest normal is 2^-6
            worst = max(worst, float(((w - ref).abs() / ref.abs())[normal].max()))
    assert 0.02 < worst <= 1 / 16  # really quantised, and no worse than fp8 allows


def test_fp8_quantisation_keeps_zero_rows_exact():
    w = torch.tensor([[0.0, 0.0, 0.0], [1.0, -448.0, 0.5], [1e-3, 2e-3, -3e-3]])
    q, scale = quantize_fp8_rowwise(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert scale.tolist() == pytest.approx([1.0, 1.0, 3e-3 / 448])
    assert torch.equal(q.float()[0], torch.zeros(3))
    assert (q.float() * scale[:, None])[1].tolist() == [1.0, -448.0, 0.5]


def test_load_casts_to_requested_dtype(tmp_path, tiny):
    path = tmp_path / "a.safetensors"
    save_adapter(tiny, path, "fp8_e4m3fn_rowwise")
    loaded = load_adapter(path, dtype=torch.bfloat16, device="cpu")
    pair = loaded.ref_loras[0]["self_attn.q_proj"]
    assert pair.down.dtype == torch.bfloat16 and pair.up.dtype == torch.bfloat16
    assert loaded.mode_weights["cs"].dtype == torch.float32


def test_zero_adapter_survives_fp8(tmp_path):
    zero = make_adapter(**TINY, init="zero")
    path = tmp_path / "zero.safetensors"
    save_adapter(zero, path, "fp8_e4m3fn_rowwise")
    loaded = load_adapter(path)
    assert all(torch.count_nonzero(pair.up) == 0 for _, pair in pairs(loaded))


def test_estimate_matches_written_size(tiny, tmp_path):
    for weight_format in ("bf16", "fp16", "fp32", "fp8_e4m3fn_rowwise"):
        path = tmp_path / f"{weight_format}.safetensors"
        save_adapter(tiny, path, weight_format)
        assert estimate_file_size(tiny, weight_format) == path.stat().st_size, weight_format


def test_to_moves_weights_and_keeps_identity(tiny):
    moved = tiny.to(dtype=torch.float16)
    assert moved.ref_loras[1]["mlp.layer2"].up.dtype == torch.float16
    assert moved.mode_weights["char"].dtype == torch.float32
    assert moved.identity == tiny.identity and moved.meta == tiny.meta
    assert tiny.ref_loras[1]["mlp.layer2"].up.dtype == torch.float32  # the original is untouched


def test_metadata_strings(tiny):
    md = make_adapter(**TINY, ref_alpha=2, target_alpha=0.5, device="meta").meta.to_metadata()
    assert md == {
        "format": "anima_ref_kv/1",
        "base_model": "anima-base-v1.0",
        "num_blocks": "3",
        "model_channels": "32",
        "ref_rank": "4",
        "target_rank": "2",
        "ref_alpha": "2",
        "target_alpha": "0.5",
        "ref_rope_offset": '[0, "after_target", "after_target"]',
        "weight_format": "fp32",
        "modes": '["cs", "char"]',
    }
    assert AdapterMeta.from_metadata(md).ref_scale == 0.5


def test_alpha_absent_means_alpha_equals_rank(tiny, tmp_path):
    md = tiny.meta.to_metadata()
    del md["ref_alpha"], md["target_alpha"]
    path = write(tmp_path / "a.safetensors", adapter_state_dict(tiny, "fp32"), md)
    loaded = load_adapter(path)
    assert (loaded.meta.ref_alpha, loaded.meta.target_alpha) == (4, 2)
    assert loaded.ref_loras[0]["mlp.layer1"].scale == 1.0


def test_alpha_sets_lora_scale(tmp_path):
    adapter = make_adapter(**TINY, ref_alpha=8, target_alpha=1)
    path = tmp_path / "a.safetensors"
    save_adapter(adapter, path, "fp32")
    loaded = load_adapter(path)
    assert loaded.ref_loras[2]["cross_attn.v_proj"].scale == 2.0
    assert loaded.target_loras[2]["self_attn.q_proj"].scale == 0.5


def test_resolve_rope_offset(tiny, tmp_path):
    assert tiny.resolve_rope_offset((1, 38, 26)) == (0, 38, 26)
    custom = make_adapter(**TINY, ref_rope_offset=(0, 0, 100), device="meta")
    assert custom.resolve_rope_offset((1, 38, 26)) == (0, 0, 100)
    path = tmp_path / "a.safetensors"
    save_adapter(make_adapter(**TINY, ref_rope_offset=(1, "after_target", 7)), path, "bf16")
    assert load_adapter(path).resolve_rope_offset((1, 64, 48)) == (1, 64, 7)


# ---------------------------------------------------------------------------------------------
# Detection from metadata only


def test_adapter_with_any_name_loads(tiny_file, tmp_path):
    renamed = tmp_path / "lora.ckpt"
    shutil.copy(tiny_file, renamed)
    loaded = load_adapter(renamed)
    assert loaded.meta.num_blocks == 3
    # The identity is the content, not the name: a renamed copy hits the same RefKV cache entries.
    assert loaded.identity == load_adapter(tiny_file).identity


def test_plain_lora_named_like_an_adapter_is_rejected(tmp_path):
    sd = {
        f"diffusion_model.blocks.{i}.self_attn.q_proj.{part}.weight": torch.zeros(shape)
        for i in range(2)
        for part, shape in (("lora_down", (4, 32)), ("lora_up", (32, 4)))
    }
    path = write(tmp_path / "x_anima_ref_kv.safetensors", sd, {"ss_network_dim": "4"})
    with pytest.raises(AdapterError) as e:
        load_adapter(path)
    msg = str(e.value)
    assert msg.startswith(
        f"{path}: looks like a standard LoRA (4 tensors, e.g."
        " 'diffusion_model.blocks.0.self_attn.q_proj.lora_down.weight'; no 'format' metadata)"
    )
    assert "format='anima_ref_kv/1'" in msg
    assert msg.endswith("A plain LoRA is merged with --lora.")


def test_plain_lora_with_kohya_keys_is_rejected(tmp_path):
    path = write(
        tmp_path / "k.safetensors",
        {
            "lora_unet_blocks_0_self_attn_q_proj.lora_down.weight": torch.zeros(4, 32),
            "lora_unet_blocks_0_self_attn_q_proj.alpha": torch.tensor(4.0),
        },
        None,
    )
    with pytest.raises(AdapterError, match=r"looks like a standard LoRA \(2 tensors"):
        load_adapter(path)


@pytest.mark.parametrize("prefix", ["net.", "", "model.diffusion_model."])
def test_base_model_file_is_rejected(tmp_path, prefix):
    sd = {}
    for i in range(2):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "mlp.layer1"):
            sd[f"{prefix}blocks.{i}.{name}.weight"] = torch.zeros(8, 8)
    sd[f"{prefix}x_embedder.proj.1.weight"] = torch.zeros(8, 68)
    path = write(tmp_path / "anima.safetensors", sd, None)
    with pytest.raises(AdapterError) as e:
        load_adapter(path)
    assert str(e.value) == (
        f"{path}: looks like an Anima base model (DiT weights, 2 blocks, e.g."
        f" '{prefix}blocks.0.self_attn.q_proj.weight'), not a SnapRef adapter; give it as"
        f" the model and the anima_ref_kv/1 adapter file separately"
    )


def test_hf_format_pt_file_is_rejected(tmp_path):
    path = write(tmp_path / "w.safetensors", {"some.weight": torch.zeros(2)}, {"format": "pt"})
    with pytest.raises(AdapterError) as e:
        load_adapter(path)
    assert str(e.value) == (
        f"{path}: not a SnapRef adapter (format 'pt', 1 tensors, e.g. 'some.weight'); a SnapRef"
        " adapter is a safetensors file whose __metadata__ has format='anima_ref_kv/1'"
    )


def test_other_format_version_is_rejected(tiny, tmp_path):
    md = {**tiny.meta.to_metadata(), "format": "anima_ref_kv/2"}
    path = write(tmp_path / "v2.safetensors", adapter_state_dict(tiny), md)
    with pytest.raises(
        AdapterError,
        match=re.escape("format 'anima_ref_kv/2' is not supported; this version reads 'anima_ref_kv/1' only"),
    ):
        load_adapter(path)


def test_stripped_metadata_is_named(tiny, tmp_path):
    path = write(tmp_path / "stripped.safetensors", adapter_state_dict(tiny), None)
    with pytest.raises(
        AdapterError,
        match=r"has SnapRef-style tensors \(e.g. 'modes.char.block_weight'\) but no"
        r" 'format' metadata; its metadata is missing or was stripped",
    ):
        load_adapter(path)


# ---------------------------------------------------------------------------------------------
# Broken files


def test_truncated_file(tiny_file):
    data = tiny_file.read_bytes()
    tiny_file.write_bytes(data[:-100])
    with pytest.raises(AdapterError) as e:
        load_adapter(tiny_file)
    msg = str(e.value)
    assert msg.startswith(f"{tiny_file}: file is truncated: tensor ")
    assert msg.endswith("expected a SnapRef adapter (a safetensors file with metadata format='anima_ref_kv/1')")


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"", "0 bytes, too short for a header"),
        (
            b"\x80\x04\x95" + b"\x00" * 64,
            "does not fit a 67-byte file; a pickle .ckpt/.pt file, or a truncated download?",
        ),
    ],
)
def test_not_safetensors(tmp_path, data, reason):
    path = tmp_path / "adapter.safetensors"
    path.write_bytes(data)
    with pytest.raises(AdapterError, match=re.escape(reason)):
        load_adapter(path)


def test_missing_file(tmp_path):
    with pytest.raises(AdapterError, match="no such file"):
        load_adapter(tmp_path / "nope.safetensors")


def test_wrong_rank_shape_names_key_expected_and_found(tiny, tmp_path):
    sd = adapter_state_dict(tiny)
    key = "ref.blocks.1.self_attn.k_proj.lora_down.weight"
    sd[key] = torch.zeros(8, 32, dtype=torch.bfloat16)
    path = write(tmp_path / "a.safetensors", sd, tiny.meta.to_metadata() | {"weight_format": "bf16"})
    with pytest.raises(AdapterError) as e:
        load_adapter(path)
    assert str(e.value) == (
        f"{path}: invalid anima_ref_kv/1 adapter: tensor {key!r} has shape [8, 32], expected"
        " [4, 32] (LoRA down [rank, in], ref_rank 4, model_channels 32)"
    )


def test_target_rank_mismatch(tiny, tmp_path):
    sd = adapter_state_dict(tiny)
    key = lora_key("target", 0, "self_attn.q_proj", "up")
    sd[key] = torch.zeros(32, 3, dtype=torch.bfloat16)
    path = write(tmp_path / "a.safetensors", sd, tiny.meta.to_metadata() | {"weight_format": "bf16"})
    with pytest.raises(
        AdapterError,
        match=re.escape(f"tensor {key!r} has shape [32, 3], expected [32, 2] (LoRA up [out, rank], target_rank 2"),
    ):
        load_adapter(path)


def test_inconsistent_context_dim_between_blocks(tiny, tmp_path):
    sd = adapter_state_dict(tiny)
    key = lora_key("ref", 2, "cross_attn.v_proj", "down")
    sd[key] = torch.zeros(4, 24, dtype=torch.bfloat16)
    path = write(tmp_path / "a.safetensors", sd, tiny.meta.to_metadata() | {"weight_format": "bf16"})
    with pytest.raises(AdapterError, match=re.escape(f"tensor {key!r} has shape [4, 24], expected [4, 16]")):
        load_adapter(path)


def test_missing_block_tensors(tiny, tmp_path):
    sd = {k: v for k, v in adapter_state_dict(tiny).items() if not k.startswith("ref.blocks.2.mlp.")}
    path = write(tmp_path / "a.safetensors", sd, tiny.meta.to_metadata() | {"weight_format": "bf16"})
    with pytest.raises(AdapterError) as e:
        load_adapter(path)
    assert str(e.value) == (
        f"{path}: invalid anima_ref_kv/1 adapter: missing 4 tensor(s), e.g."
        " 'ref.blocks.2.mlp.layer1.lora_down.weight', 'ref.blocks.2.mlp.layer1.lora_up.weight',"
        " 'ref.blocks.2.mlp.layer2.lora_down.weight'"
    )


def test_more_blocks_than_metadata_says(tiny, tmp_path):
    md = tiny.meta.to_metadata() | {"weight_format": "bf16", "num_blocks": "2"}
    path = write(tmp_path / "a.safetensors", adapter_state_dict(tiny), md)
    with pytest.raises(AdapterError) as e:
        load_adapter(path)
    # The mode vectors have 3 entries and block 2 exists although the metadata says 2 blocks.
    assert "tensor 'modes.cs.block_weight' is F32 [3], expected F32 [2] (num_blocks)" in str(e.value)
    assert "22 tensor(s) outside the 2-block layout the metadata describes, e.g." in str(e.value)


def test_dtype_must_match_weight_format(tiny, tmp_path):
    md = tiny.meta.to_metadata() | {"weight_format": "fp16"}
    path = write(tmp_path / "a.safetensors", adapter_state_dict(tiny, "bf16"), md)
    with pytest.raises(AdapterError) as e:
        load_adapter(path)
    assert str(e.value) == (
        f"{path}: invalid anima_ref_kv/1 adapter: 66 LoRA tensor(s) are BF16, expected F16"
        " (weight_format 'fp16'), e.g. 'ref.blocks.0.self_attn.q_proj.lora_down.weight'"
    )


def test_fp8_without_scales(tiny, tmp_path):
    sd = {k: v for k, v in adapter_state_dict(tiny, "fp8_e4m3fn_rowwise").items() if not k.endswith("_scale")}
    md = tiny.meta.to_metadata() | {"weight_format": "fp8_e4m3fn_rowwise"}
    path = write(tmp_path / "a.safetensors", sd, md)
    with pytest.raises(AdapterError) as e:
        load_adapter(path)
    assert str(e.value) == (
        f"{path}: invalid anima_ref_kv/1 adapter: missing 66 row-scale tensor(s) (a float32"
        " [rows] `.weight_scale` goes with every fp8 weight), e.g."
        " 'ref.blocks.0.self_attn.q_proj.lora_down.weight_scale'"
    )


def test_missing_mode_vector(tiny, tmp_path):
    sd = adapter_state_dict(tiny)
    del sd["modes.char.block_weight"]
    path = write(tmp_path / "a.safetensors", sd, tiny.meta.to_metadata() | {"weight_format": "bf16"})
    with pytest.raises(AdapterError) as e:
        load_adapter(path)
    assert str(e.value) == (
        f"{path}: invalid anima_ref_kv/1 adapter: mode 'char' is listed in metadata 'modes' but"
        " tensor 'modes.char.block_weight' is missing (expected float32 [3])"
    )


def test_missing_metadata_keys(tiny, tmp_path):
    md = tiny.meta.to_metadata()
    del md["ref_rank"], md["modes"]
    path = write(tmp_path / "a.safetensors", adapter_state_dict(tiny), md)
    with pytest.raises(AdapterError) as e:
        load_adapter(path)
    assert str(e.value) == f"{path}: anima_ref_kv/1 metadata is incomplete: missing key(s) 'ref_rank', 'modes'"


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("num_blocks", "many", "malformed anima_ref_kv/1 metadata: 'num_blocks' = 'many' is not an integer"),
        ("modes", "cs", "malformed anima_ref_kv/1 metadata: 'modes' = 'cs' is not a JSON list"),
        (
            "weight_format",
            "int4",
            "adapter metadata 'weight_format' is 'int4', expected one of bf16, fp16, fp32, fp8_e4m3fn_rowwise",
        ),
        (
            "ref_rope_offset",
            '[0, "after", 3]',
            "adapter metadata 'ref_rope_offset' must be [dt, dh, dw], each an"
            " integer or 'after_target', found [0, 'after', 3]",
        ),
        ("ref_rank", "0", "adapter metadata 'ref_rank' must be a positive integer, found 0"),
    ],
)
def test_malformed_metadata(tiny, tmp_path, key, value, message):
    md = tiny.meta.to_metadata() | {key: value}
    path = write(tmp_path / "a.safetensors", adapter_state_dict(tiny), md)
    with pytest.raises(AdapterError) as e:
        load_adapter(path)
    assert str(e.value) == f"{path}: {message}"


def test_non_finite_weights_are_refused(tiny, tmp_path):
    sd = adapter_state_dict(tiny, "fp32")
    key = lora_key("ref", 1, "mlp.layer2", "up")
    sd[key] = sd[key].clone()
    sd[key][3, 1] = float("nan")
    path = write(tmp_path / "a.safetensors", sd, tiny.meta.to_metadata())
    with pytest.raises(AdapterError, match=re.escape(f"tensor {key!r} contains non-finite values")):
        load_adapter(path)


def test_cs_only_file_rejects_char_mode(tmp_path):
    path = tmp_path / "cs_only.safetensors"
    save_adapter(make_adapter(**TINY, modes=("cs",)), path)
    adapter = load_adapter(path)
    assert adapter.block_weights("cs").tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(AdapterError) as e:
        adapter.block_weights("char")
    assert str(e.value) == f"adapter {path} has no mode 'char' (modes: cs)"


def test_check_adapter_file_reads_header_only(tiny_file):
    meta, layout = check_adapter_file(tiny_file)
    assert (meta.num_blocks, layout.context_dim, layout.mlp_hidden) == (3, 16, 64)
    assert layout.num_parameters == make_adapter(**TINY, device="meta").num_parameters()
    assert layout.num_tensors == 3 * 22 + 2 and layout.tensor_dtypes == ("BF16", "F32")


def test_cannot_save_meta_adapter(tmp_path):
    with pytest.raises(AdapterError, match="lives on the meta device"):
        save_adapter(make_adapter(**TINY, device="meta"), tmp_path / "m.safetensors")
    assert list(tmp_path.iterdir()) == []  # no partial or temporary file left behind


def test_save_rejects_unknown_weight_format(tiny, tmp_path):
    with pytest.raises(AdapterError, match="weight_format 'int8' is not one of bf16, fp16, fp32, fp8_e4m3fn_rowwise"):
        save_adapter(tiny, tmp_path / "a.safetensors", "int8")


# ---------------------------------------------------------------------------------------------
# Identity


def test_identity_is_sha256_of_the_file(tiny_file, tmp_path):
    assert adapter_identity(tiny_file) == "sha256:" + hashlib.sha256(tiny_file.read_bytes()).hexdigest()
    other = tmp_path / "other.safetensors"
    save_adapter(make_adapter(**TINY, seed=2), other)
    assert adapter_identity(other) != adapter_identity(tiny_file)


def test_identity_of_large_files_is_sampled(tiny_file, monkeypatch):
    monkeypatch.setattr(adapter_file, "FULL_HASH_LIMIT", 1000)
    first = adapter_identity(tiny_file)
    assert first.startswith("sha256-sampled:") and first == adapter_identity(tiny_file)
    data = bytearray(tiny_file.read_bytes())
    data[-1] ^= 0xFF  # the last sample covers the end of the file
    tiny_file.write_bytes(bytes(data))
    assert adapter_identity(tiny_file) != first


def test_meta_validation_rejects_bad_values():
    good = make_adapter(**TINY, device="meta").meta
    with pytest.raises(AdapterError, match=r"'modes' must be a non-empty list of distinct names"):
        AdapterMeta(**{**good.__dict__, "modes": ("cs", "cs")})
    with pytest.raises(AdapterError, match=r"'target_alpha' must be a positive number, found nan"):
        AdapterMeta(**{**good.__dict__, "target_alpha": math.nan})


def test_linear_sets():
    assert len(REF_LINEARS) == 10 and TARGET_LINEARS == ("self_attn.q_proj",)
    assert FORMAT == "anima_ref_kv/1"


# ---------------------------------------------------------------------------------------------
# Inspection (`snapref-ray adapter inspect FILE`)


def test_inspect_adapter(tiny, tmp_path):
    path = tmp_path / "renamed.bin"
    save_adapter(tiny, path, "fp8_e4m3fn_rowwise")
    info = inspect_adapter(path)
    json.dumps(info)  # the CLI may print it as JSON
    assert info == {
        "path": str(path),
        "file_size": path.stat().st_size,
        "format": "anima_ref_kv/1",
        "base_model": "anima-base-v1.0",
        "num_blocks": 3,
        "model_channels": 32,
        "context_dim": 16,
        "mlp_hidden": 64,
        "ref_rank": 4,
        "target_rank": 2,
        "ref_alpha": 4.0,
        "target_alpha": 2.0,
        "ref_scale": 1.0,
        "target_scale": 1.0,
        "ref_linears": list(REF_LINEARS),
        "target_linears": ["self_attn.q_proj"],
        "ref_rope_offset": [0, "after_target", "after_target"],
        "modes": ["cs", "char"],
        "mode_weights": {"cs": [1.0, 1.0, 1.0], "char": [1.0, 1.0, 0.25]},
        "num_parameters": 8448,
        "weight_format": "fp8_e4m3fn_rowwise",
        "tensor_dtypes": ["F32", "F8_E4M3"],
        "num_tensors": 2 * 66 + 2,
        "identity": adapter_identity(path),
    }


def test_format_inspection(tiny_file):
    info = inspect_adapter(tiny_file)
    text = format_inspection(info)
    assert text.splitlines() == [
        f"file:                  {tiny_file} ({tiny_file.stat().st_size / 1e3:.1f} kB)",
        "format:                anima_ref_kv/1",
        "base model:            anima-base-v1.0",
        "blocks:                3 (model channels 32, cross-attn context 16, MLP hidden 64)",
        "reference LoRA:        rank 4, alpha 4 (scale 1), 10 linears per block",
        "target LoRA:           rank 2, alpha 2 (scale 1), self_attn.q_proj",
        "parameters:            8,448 (8.4k)",
        "weights:               bf16 (tensor dtypes: BF16, F32; 68 tensors)",
        'reference RoPE offset: [0, "after_target", "after_target"]',
        "mode cs:               all 1 (3 blocks)",
        "mode char:             [1.00, 1.00, 0.25]",
        f"identity:              {adapter_identity(tiny_file)}",
    ]
    # Real-size numbers print the way the seeds quote them.
    real = format_inspection(info | {"num_parameters": 190_840_832, "file_size": 381_757_176})
    assert "parameters:            190,840,832 (190.8M)" in real and "(381.8 MB)" in real


def test_inspect_refuses_what_load_refuses(tmp_path):
    path = write(tmp_path / "lora.safetensors", {"unet.x.lora_up.weight": torch.zeros(2, 2)}, None)
    with pytest.raises(AdapterError, match="looks like a standard LoRA"):
        inspect_adapter(path)


def test_negative_mode_weights_are_refused(tiny, tmp_path):
    # The read adds log(w · b_i) to the reference logits: a negative block weight has no meaning.
    sd = adapter_state_dict(tiny)
    sd["modes.char.block_weight"] = torch.tensor([1.0, -0.5, 0.25])
    path = write(tmp_path / "a.safetensors", sd, tiny.meta.to_metadata() | {"weight_format": "bf16"})
    with pytest.raises(AdapterError) as e:
        load_adapter(path)
    assert str(e.value) == (
        f"{path}: tensor 'modes.char.block_weight' must hold finite weights >= 0, found [1.0, -0.5, 0.25]"
    )
